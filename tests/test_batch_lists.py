"""A Python list (or tuple) of per-sample values in a batch, as long as the batch, is split like a tensor: each
micro-batch gets its samples' values. Other lists go whole to every micro-batch, and a list of one record per
sample of another length is refused with the key it sits under."""

from __future__ import annotations

import copy

import pytest
import torch
from test_step import make_plan
from torch import nn

import autotune
from autotune.training.step import TrainingStep
from autotune.workload import batch as batches

pytestmark = pytest.mark.usefixtures("private_cache")


class LengthMasked(nn.Module):
    """A model that takes each sample's length and name as Python lists: a mean over samples of each sample's
    mean over its first `lengths[i]` positions."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor, lengths: list[int], names: tuple[str, ...]) -> torch.Tensor:
        if len(names) != len(x):
            raise ValueError(f"{len(names)} names for {len(x)} samples")
        counted = torch.tensor(lengths)
        mask = torch.arange(x.shape[1])[None, :] < counted[:, None]  # (B, T): fails where lengths is not B long
        y = self.lin(x).squeeze(-1).pow(2)
        return ((y * mask).sum(1) / counted).mean()


def example(n: int = 7, t: int = 6) -> dict:
    g = torch.Generator().manual_seed(0)
    lengths = [1 + (3 * i) % t for i in range(n)]
    return {"x": torch.randn(n, t, 3, generator=g, dtype=torch.float64), "lengths": lengths,
            "names": tuple(f"sample {i}" for i in range(n))}


def test_lists_of_per_sample_values_are_split_like_the_tensors():
    model, batch = LengthMasked(), example()
    want = copy.deepcopy(model)
    opt = torch.optim.SGD(want.parameters(), lr=0.1)
    want_loss = want(**batch)
    want_loss.backward()
    opt.step()
    with TrainingStep(make_plan(2, 7), model, torch.optim.SGD(model.parameters(), lr=0.1)) as step:
        loss = step(batch)
    assert loss == pytest.approx(float(want_loss.detach()), rel=1e-12)
    for p, q in zip(model.parameters(), want.parameters()):
        assert float((p - q).abs().max()) <= 1e-12


def test_fit_tunes_a_batch_with_per_sample_lists():
    plan = autotune.fit(LengthMasked(), example(), device="cpu", memory_budget="64MiB", cache=False,
                        progress=False, trial_steps=1, max_trials=2, techniques=())
    assert plan.micro_batch_size >= 1
    assert ("lengths(per-sample list)", (), "list") in batches.signature(example())


def test_the_batch_operations_split_lists_as_long_as_the_batch_and_keep_the_others_whole():
    batch = {"x": torch.arange(4), "words": ["a", "b", "c", "d"], "pair": ("p", "q"),
             "tokens": [[1, 2], [3], [4, 5, 6], []], "boxes": [{"xy": torch.ones(k, 2)} for k in (1, 0, 3, 2)]}
    assert batches.batch_size(batch) == 4  # the records' tensors hold objects, not samples
    part = batches.take(batch, 1, 3)
    assert part["words"] == ["b", "c"] and part["tokens"] == [[3], [4, 5, 6]]
    assert part["pair"] == ("p", "q")  # not as long as the batch: every micro-batch gets it whole
    assert [b["xy"].shape[0] for b in part["boxes"]] == [0, 3]
    assert batches.pick(batch, [3, 0])["words"] == ["d", "a"]
    assert batches.resize(batch, 6)["words"] == ["a", "b", "c", "d", "a", "b"]
    moved = batches.to_device(batch, torch.device("cpu"))
    assert moved["words"] == batch["words"] and torch.equal(moved["boxes"][2]["xy"], batch["boxes"][2]["xy"])


def test_records_per_sample_of_another_length_are_refused_naming_the_key():
    batch = {"x": torch.zeros(4, 2), "targets": [{"boxes": torch.ones(1, 4)}] * 3}
    with pytest.raises(autotune.InvalidSetting, match=r"batch\['targets'\] is a list of 3 records.*4 samples"):
        batches.batch_size(batch)


def test_the_fullest_padded_sample_goes_first_where_the_first_is_not_padded():
    """`padded_first`: the trials' micro-batch is the first samples; with a padded sample first, a trial at 1
    builds the attention mask that training's padded samples build. Lists of per-sample values follow."""
    ids = torch.arange(20).reshape(4, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    batch = {"input_ids": ids, "attention_mask": mask, "names": ["a", "b", "c", "d"]}
    moved = batches.padded_first(batch)
    assert moved["names"] == ["c", "a", "b", "d"]
    order = [2, 0, 1, 3]
    assert torch.equal(moved["input_ids"], ids[order]) and torch.equal(moved["attention_mask"], mask[order])
    # nothing to move: the first sample padded already, none padded, no mask, a mask that is not zeros and ones
    for unchanged in ({"input_ids": ids, "attention_mask": mask[[1, 0, 2, 3]]},
                      {"input_ids": ids, "attention_mask": torch.ones_like(mask)},
                      {"input_ids": ids}, (ids, mask),
                      {"input_ids": ids, "attention_mask": mask * 2}):
        assert batches.padded_first(unchanged) is unchanged
