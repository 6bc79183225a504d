"""The peers' batch-size searches, run as their users run them, with every try recorded.

Both peers choose a batch size only; their users add BF16 autocast (Accelerate: `torch.autocast`;
Lightning: `precision="bf16-mixed"`) and train AdamW. A try is the user's training loop cut to
`probe_steps` optimizer steps at one batch size, without accumulation: Lightning's finder runs
`steps_per_trial=3` such steps by default, and the Accelerate loop here runs the same number so the two
probe alike. The accumulation that keeps the global batch comes after, in real training (`train_steps`).

On the CPU the searches run under `CudaLikeCeiling`, so the peers' own message-based OOM checks fire as
they would on a GPU; nothing of the peers is patched except a counter around Lightning's trial loop.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from workloads import Spec, emulated_ceiling

from autotune.errors import is_oom
from autotune.workload import batch as batches

DATASET_LENGTH = 1 << 20  # longer than any batch a finder tries: Lightning stops growing at the dataset's length


def preload(method: str) -> None:
    """Import the peer's library now, so that its import time (seconds for lightning) is charged to no clock."""
    if method == "accelerate":
        import accelerate.utils  # noqa: F401
    else:
        import lightning.pytorch
        import lightning.pytorch.tuner  # noqa: F401


def _bf16_autocast(device: str) -> torch.autocast:
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def _outcome(exc: BaseException, peer_says_oom: bool) -> str:
    if peer_says_oom:
        return "oom"
    return "oom (not recognised by the peer)" if is_oom(exc) else "error"


def accelerate_search(spec: Spec, model: nn.Module, batch: Any, loss_fn: Any, device: str,
                      probe_steps: int, start: int = 128) -> dict[str, Any]:
    """`accelerate.utils.find_executable_batch_size` from `start` (its default, 128), x0.9 per OOM."""
    from accelerate.utils import find_executable_batch_size
    from accelerate.utils.memory import should_reduce_batch_size

    tries: list[dict[str, Any]] = []

    @find_executable_batch_size(starting_batch_size=start)
    def train(batch_size: int) -> int:
        tries.append({"micro_batch_size": batch_size, "outcome": "running"})
        model.zero_grad(set_to_none=True)  # a careful user's loop starts clean
        model.train()
        optimizer = torch.optim.AdamW(model.parameters())
        data = batches.resize(batch, batch_size)
        try:
            for _ in range(probe_steps):
                with _bf16_autocast(device):
                    loss = loss_fn(model, data)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        except Exception as exc:
            tries[-1]["outcome"] = _outcome(exc, should_reduce_batch_size(exc))
            raise
        tries[-1]["outcome"] = "ok"
        return batch_size

    with emulated_ceiling(device, spec.budget, model, batch):
        answer, error = _answer(train)
    return {"answer": answer, "error": error, "tries": tries}


def lightning_search(spec: Spec, model: nn.Module, batch: Any, loss_fn: Any, device: str, mode: str,
                     probe_steps: int) -> dict[str, Any]:
    """`lightning.pytorch.tuner.Tuner.scale_batch_size` in `mode` ("power" or "binsearch") from its defaults."""
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner
    from lightning.pytorch.tuner import batch_size_scaling as scaling
    from lightning.pytorch.utilities.memory import is_oom_error

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # lightning's own deprecation noise
    tries: list[dict[str, Any]] = []
    module = _lightning_module(pl, model, batch, loss_fn)
    root = tempfile.mkdtemp(prefix="bench-lightning-")  # the finder saves (and restores) a checkpoint here
    trainer = pl.Trainer(accelerator="gpu" if device.startswith("cuda") else "cpu", devices=1,
                         precision="bf16-mixed", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                         num_sanity_val_steps=0, max_epochs=1)
    original = scaling._try_loop_run

    def counted(trainer: Any, params: Any) -> None:  # count the finder's trials; behaviour unchanged
        tries.append({"micro_batch_size": int(trainer.lightning_module.batch_size), "outcome": "running"})
        try:
            original(trainer, params)
        except Exception as exc:
            tries[-1]["outcome"] = _outcome(exc, is_oom_error(exc))
            raise
        tries[-1]["outcome"] = "ok"

    scaling._try_loop_run = counted
    try:
        with emulated_ceiling(device, spec.budget, model, batch):
            answer, error = _answer(lambda: Tuner(trainer).scale_batch_size(module, mode=mode,
                                                                            steps_per_trial=probe_steps))
    finally:
        scaling._try_loop_run = original
        shutil.rmtree(root, ignore_errors=True)
    return {"answer": answer, "error": error, "tries": tries}


def _answer(search: Any) -> tuple[int | None, str]:
    """Run a peer's search: (its answer, "") or (None, why it gave up)."""
    try:
        answer = search()
    except Exception as exc:  # noqa: BLE001 - a peer giving up is a result ("reached zero", batch_size=0)
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    if answer is None or int(answer) < 1:
        return None, f"no batch size returned ({answer!r})"
    return int(answer), ""


class _Rows(Dataset):
    """The example batch's rows, repeated: a long map-style dataset that costs no memory."""

    def __init__(self, batch: Any) -> None:
        self.batch = batches.to_device(batch, torch.device("cpu"))
        self.rows = batches.batch_size(batch)

    def __len__(self) -> int:
        return DATASET_LENGTH

    def __getitem__(self, i: int) -> Any:
        return _row(self.batch, i % self.rows)


def _row(batch: Any, i: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[i]
    if isinstance(batch, dict):
        return {k: _row(v, i) for k, v in batch.items()}
    return tuple(_row(v, i) for v in batch)


def _lightning_module(pl: Any, model: nn.Module, batch: Any, loss_fn: Any) -> Any:
    class Wrapped(pl.LightningModule):
        """The smallest LightningModule a user would write around an existing model."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.batch_size = 2  # the finder's `batch_arg_name`; its init_val is 2 as well
            self._rows = _Rows(batch)

        def training_step(self, data: Any, index: int) -> torch.Tensor:
            return loss_fn(self.model, data)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self._rows, batch_size=self.batch_size, shuffle=False)

    return Wrapped()
