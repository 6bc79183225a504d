"""Batches and models as people bring them: a tokenizer's `BatchEncoding` and other
mappings are batches; `fit` leaves the inputs' gradients alone; a model on the `meta` device is refused
with a setting error that says to materialize it.
"""

from __future__ import annotations

import collections
import copy
import math
from collections.abc import Iterator, Mapping

import pytest
import torch
from test_step import make_plan
from torch import nn

import autotune
from autotune.errors import InvalidSetting

pytestmark = pytest.mark.usefixtures("private_cache")  # conftest.py


class Regressor(nn.Module):
    """`model(x=..., y=...)`: the mean squared error, so a mapping batch goes in as keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.body(x).squeeze(-1) - y) ** 2).mean()


class Frozen(Mapping):
    """A read-only mapping whose constructor takes no dict (like many config or record types)."""

    def __init__(self, **items: torch.Tensor) -> None:
        self._items = items

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def xy(n: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 6, generator=g), "y": torch.randn(n, generator=g)}


def trained(model: nn.Module, batch, plan) -> nn.Module:
    m = copy.deepcopy(model)
    step = plan.apply(m, torch.optim.SGD(m.parameters(), lr=0.1))
    assert math.isfinite(step(batch))
    step.close()
    return m


@pytest.mark.parametrize("wrap", [collections.UserDict, collections.OrderedDict, lambda d: Frozen(**d)],
                         ids=["UserDict", "OrderedDict", "read-only Mapping"])
def test_any_mapping_is_a_batch_and_trains_like_a_dict(wrap):
    torch.manual_seed(0)
    model = Regressor()
    batch = wrap(xy())
    plan = autotune.fit(model, batch, device="cpu", memory_budget="40MiB", global_batch_size=8)
    assert plan.micro_batch_size >= 1 and plan.source == "tuned"
    again = autotune.fit(model, wrap(xy(seed=1)), device="cpu", memory_budget="40MiB", global_batch_size=8)
    assert again.source == "cache"  # the same signature as the dict it wraps: the key reads the mapping
    fixed = make_plan(3, 8)  # an uneven split, the same for both: the mapping is split like the dict
    got, want = trained(model, batch, fixed), trained(model, xy(), fixed)
    assert all(torch.equal(p, q) for p, q in zip(got.parameters(), want.parameters()))


@pytest.mark.slow
def test_a_tokenizers_batch_encoding_tunes_and_trains():
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = "the a cat dog sat ran on mat big small".split()
    core = tokenizers.Tokenizer(WordLevel({"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}},
                                          unk_token="[UNK]"))
    core.pre_tokenizer = Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]")
    texts = ["the cat sat on the mat", "a dog ran", "the big dog sat", "a small cat ran on a mat", "the dog",
             "a big cat sat", "the mat", "a dog sat on the big mat"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    assert isinstance(batch, transformers.BatchEncoding) and not isinstance(batch, dict)  # the premise

    config = transformers.GPT2Config(vocab_size=16, n_positions=16, n_layer=2, n_embd=16, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    plan = autotune.fit(model, batch, device="cpu", memory_budget="40MiB", cache=False)
    assert plan.global_batch_size == 8
    got, want = trained(model, batch, make_plan(3, 8)), trained(model, dict(batch), make_plan(3, 8))
    assert any(not torch.equal(p, q) for p, q in zip(got.parameters(), model.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(got.parameters(), want.parameters()))


def test_fit_leaves_the_gradients_of_inputs_alone():
    torch.manual_seed(0)
    model = Regressor()
    batch = xy()
    batch["x"].requires_grad_(True)
    fresh = autotune.fit(model, batch, device="cpu", memory_budget="40MiB", cache=False)
    assert batch["x"].grad is None and fresh.micro_batch_size >= 1
    earlier = torch.full_like(batch["x"], 0.5)  # a gradient the user computed before calling fit
    batch["x"].grad = earlier.clone()
    autotune.fit(model, batch, device="cpu", memory_budget="40MiB", cache=False)
    assert torch.equal(batch["x"].grad, earlier)


def test_a_loss_that_differentiates_by_its_inputs_still_can():
    # Gradient penalties take the gradient of the output by the input: the trials' inputs keep requires_grad.
    def penalized(model: Regressor, batch) -> torch.Tensor:
        out = model.body(batch["x"]).squeeze(-1)
        (dx,) = torch.autograd.grad(out.sum(), batch["x"], create_graph=True)
        return ((out - batch["y"]) ** 2).mean() + (dx ** 2).mean()

    torch.manual_seed(0)
    batch = xy()
    batch["x"].requires_grad_(True)
    plan = autotune.fit(Regressor(), batch, loss_fn=penalized, device="cpu", memory_budget="40MiB", cache=False)
    assert plan.samples_per_second > 0 and batch["x"].grad is None


def test_a_model_on_the_meta_device_is_refused_with_how_to_materialize_it():
    with torch.device("meta"):
        model = Regressor()
    with pytest.raises(InvalidSetting, match=r"'meta' device \(body.0.weight, .*\).* Materialize .*to_empty"):
        autotune.fit(model, xy(), device="cpu", memory_budget="40MiB", cache=False)
    with pytest.raises(InvalidSetting, match="Materialize the model first"):
        make_plan(2, 8).apply(model)


class GroupNormBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)
        self.n2, self.c2 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c2(nn.functional.silu(self.n2(self.c1(nn.functional.silu(self.n1(x))))))


class TinyUNet(nn.Module):
    """`model(image, noise)`: a denoiser's mean squared error; one level down and back up, with a skip."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, c, 3, padding=1)
        self.down = nn.ModuleList(GroupNormBlock(c) for _ in range(2))
        self.pool = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.mid = nn.ModuleList(GroupNormBlock(2 * c) for _ in range(2))
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.out = nn.Conv2d(2 * c, 3, 3, padding=1)

    def forward(self, image: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        h = self.inp(image)
        for block in self.down:
            h = block(h)
        skip, h = h, self.pool(h)
        for block in self.mid:
            h = block(h)
        return nn.functional.mse_loss(self.out(torch.cat([self.up(h), skip], dim=1)), noise)


def images(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randn(n, 3, 32, 32, generator=g)


@pytest.mark.slow  # seconds: searches that run real trial steps
@pytest.mark.parametrize("global_batch", [32, 64])
def test_an_image_batch_held_whole_is_in_the_plans_peak(global_batch):
    """`step(batch)` holds this rank's whole batch (here ~0.8 and 1.5 MiB of images, a fifth and more of the
    budget) while its micro-batches run; tuned from a 4-image example, the plan counts it, so the step stays
    within the plan's peak and needs no recovery."""
    torch.manual_seed(0)
    model = TinyUNet()
    plan = autotune.fit(model, images(4), global_batch_size=global_batch, memory_budget="4MiB", device="cpu",
                        cache=False, progress=False, trial_steps=1)
    with plan.apply(model, torch.optim.AdamW(model.parameters())) as step:
        for seed in range(2):
            step(images(global_batch, seed))
        assert step.recoveries == [] and step.last_peak_bytes <= plan.peak_memory_bytes, (step.recoveries, plan)
