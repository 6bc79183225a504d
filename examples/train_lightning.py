"""Train a small GPT with PyTorch Lightning's `LightningCLI`: an ordinary Lightning script, unaware of autotune.

Every setting is a LightningCLI flag (--data.batch_size, --trainer.accumulate_grad_batches,
--trainer.precision, --model.gradient_checkpointing...), so `autotune run --preset lightning-cli` tunes it
in zero-change mode (the checkpointing switch is this model's own, so it is mapped beside the preset):

    autotune run --preset lightning-cli --global-batch-size 32 --budget 40MiB \\
        --map checkpointing=--model.gradient_checkpointing=true \\
        examples/train_lightning.py fit --trainer.max_steps 20

Lightning runs forward and backward inside `optimizer.step(closure)`; autotune times whole optimizer
steps, so that is measured as it trains. The data are synthetic counting sequences (no download).
On its own: python examples/train_lightning.py fit --data.batch_size 8 --trainer.accumulate_grad_batches 4
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

try:
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI
except ImportError as exc:  # the examples must not break a machine without lightning
    print("examples/train_lightning.py needs lightning and jsonargparse: "
          f"pip install lightning 'jsonargparse[signatures]' ({exc})", file=sys.stderr)
    raise SystemExit(4) from None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt import GPT, CountingSequences, GPTConfig

# Trainer defaults that suit an example: no checkpoints, no logger files, no progress bar in a log.
TRAINER_DEFAULTS = {"max_steps": 20, "enable_checkpointing": False, "logger": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "accelerator": "auto", "devices": 1}


class Checkpointed(nn.Module):
    """Recompute a block in backward instead of storing its activations."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


class CountingData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 8, seq_len: int = 64, vocab_size: int = 512, num_samples: int = 100_000,
                 num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.num_workers = batch_size, num_workers
        self.data = CountingSequences(num_samples, seq_len, vocab_size)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, shuffle=True, drop_last=True,
                                           num_workers=self.num_workers)


class GPTModule(pl.LightningModule):
    def __init__(self, layers: int = 4, width: int = 128, heads: int = 4, seq_len: int = 64, vocab_size: int = 512,
                 learning_rate: float = 1e-3, gradient_checkpointing: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(n_layer=layers, n_embd=width, n_head=heads, seq_len=seq_len,
                                   vocab_size=vocab_size))
        if gradient_checkpointing:
            self.model.blocks = nn.ModuleList(Checkpointed(b) for b in self.model.blocks)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        loss = self.model(ids, labels)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)
        # A warm-up schedule, stepped by Lightning after each optimizer step.
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class CLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:  # jsonargparse's parser, unannotated
        # The data decide the sequence length and vocabulary; the model follows (--data.seq_len 1024).
        parser.link_arguments("data.seq_len", "model.seq_len")
        parser.link_arguments("data.vocab_size", "model.vocab_size")


def main() -> None:
    CLI(GPTModule, CountingData, trainer_defaults=TRAINER_DEFAULTS, save_config_callback=None,
        seed_everything_default=0)


if __name__ == "__main__":
    main()
