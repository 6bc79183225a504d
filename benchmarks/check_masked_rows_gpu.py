"""Why padding a sliding-window model's attention can give NaN on a GPU: the zoo's tiny ModernBERT trained 20 plain
bf16 steps (no autotune) at its batch's length, padded to 64 tokens by hand with cuDNN's attention on, and the same
with it off. Each line gives the first and last loss and how many steps had a non-finite gradient.

    python benchmarks/check_masked_rows_gpu.py
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import zoo_models


def padded(batch: dict[str, torch.Tensor], to: int) -> dict[str, torch.Tensor]:
    """The batch right-padded to `to` tokens: pad id 0, attention mask 0, labels ignored."""
    pad = to - batch["input_ids"].shape[1]
    return {"input_ids": F.pad(batch["input_ids"], (0, pad), value=0),
            "attention_mask": F.pad(batch["attention_mask"], (0, pad), value=0),
            "labels": F.pad(batch["labels"], (0, pad), value=-100)}


def train(model: torch.nn.Module, batch: dict[str, torch.Tensor], cudnn: bool, steps: int = 20) -> list[tuple]:
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        bad = sum(int(not torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append((round(float(loss.detach()), 4), bad))
    torch.backends.cuda.enable_cudnn_sdp(True)
    return out


def main() -> None:
    model64, batch64 = zoo_models.modernbert_mlm()
    model = model64.float().cuda()
    batch = {k: v.cuda() for k, v in batch64.items()}
    for name, b, cudnn in [("batch length", batch, True), ("padded to 64, cuDNN on", padded(batch, 64), True),
                           ("padded to 64, cuDNN off", padded(batch, 64), False)]:
        losses = train(model, b, cudnn)
        print(json.dumps({"variant": name, "first": losses[0][0], "last": losses[-1][0],
                          "steps_with_non_finite_gradients": sum(1 for _, n in losses if n)}))


if __name__ == "__main__":
    main()
