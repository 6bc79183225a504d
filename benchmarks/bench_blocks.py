"""Which blocks to recompute: bytes per sample of a ResNet with the old choice and the new one.

The old choice was the one group of same-class blocks holding the most parameters: on a ResNet its last stage
(ResNet-152's `layer4`, 3 of 50 bottlenecks), which holds the fewest activations. The new one
(`autotune.techniques.profile_blocks`) takes every stage, ordered by the activation memory each block holds.
For each configuration this measures, with autotune's own trial runner, the peak at two micro-batches and
their slope (bytes each sample adds), and samples/s at the larger one.

    python benchmarks/bench_blocks.py --device cuda --out blocks.jsonl           # W3's ResNet-152, 224x224
    python benchmarks/bench_blocks.py --device cpu --micro 4 12 --out x.jsonl    # a tiny ResNet, simulated

On the CPU the model is a torchvision-layout ResNet at toy size (four stages of two basic blocks, 32x32) and
the bytes are the simulated ceiling's count; on CUDA it is W3's ResNet-152 (torchvision or timm) in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import WORKLOADS, build, classify_loss

from autotune.devices.placement import resolve_device
from autotune.plan import Rung
from autotune.search.trial import TrialRunner, Workload
from autotune.techniques import profile_blocks
from autotune.techniques.blocks import BlockGroup
from autotune.workload.optimizers import OptimizerSpec


class Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class TinyResNet(nn.Module):
    def __init__(self, widths: tuple[int, ...] = (16, 32, 64, 128)) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0])
        cin = widths[0]
        for i, w in enumerate(widths, start=1):
            setattr(self, f"layer{i}", nn.Sequential(Basic(cin, w, 1 if i == 1 else 2), Basic(w, w, 1)))
            cin = w
        self.fc = nn.Linear(cin, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        return self.fc(self.layer4(self.layer3(self.layer2(self.layer1(x)))).mean((2, 3)))


def largest_by_parameters(model: nn.Module) -> BlockGroup:
    """The old rule: the same-class children of one ModuleList/Sequential with the most parameters."""
    best, best_params = BlockGroup(path=""), -1
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, list[tuple[str, nn.Module]]] = defaultdict(list)
        for name, child in container.named_children():
            by_class[type(child)].append((f"{path}.{name}" if path else name, child))
        for members in by_class.values():
            params = sum(p.numel() for _, b in members for p in b.parameters())
            if len(members) >= 2 and params > best_params:
                best = BlockGroup(path=path, blocks=[b for _, b in members], paths=[p for p, _ in members])
                best_params = params
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--micro", type=int, nargs=2, default=(16, 48), help="the two micro-batches measured")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    placement = resolve_device(args.device)
    if placement.simulated:
        torch.manual_seed(0)
        model = TinyResNet()
        batch = (torch.randn(max(args.micro), 3, 32, 32), torch.randint(0, 10, (max(args.micro),)))
        precision = "fp32"
    else:
        model, batch, _ = build(WORKLOADS["W3"], args.device)
        batch = tuple(t[:1].repeat(max(args.micro), *([1] * (t.dim() - 1))) for t in batch)
        precision = "bf16"
    new = profile_blocks(model, batch, classify_loss, placement)
    old = largest_by_parameters(model)
    n = len(new.blocks)
    configs = [("no recompute", new, 0), (f"old: {old.path} ({len(old.blocks)} blocks)", old, len(old.blocks))]
    configs += [(f"new: first {k} of {n}", new, k) for k in sorted({max(1, n // 4), n // 2, n})]
    with open(args.out, "a") as out:
        for name, blocks, k in configs:
            work = Workload(model=model, batch=batch, loss_fn=classify_loss, spec=OptimizerSpec.from_user(None, model),
                            placement=placement, budget_bytes=2**40, limit_bytes=2**40, per_rank=max(args.micro),
                            blocks=blocks, measured_steps=3)
            rung = Rung(precision=precision, checkpointing="none" if k == 0 else "full", checkpointed_blocks=k)
            small, large = (TrialRunner(work)(rung, m) for m in args.micro)
            per_sample = (large.peak_bytes - small.peak_bytes) / (args.micro[1] - args.micro[0])
            row = {"config": name, "blocks": blocks.paths[:k], "device": placement.name, "micro": list(args.micro),
                   "peaks": [small.peak_bytes, large.peak_bytes], "bytes_per_sample": per_sample,
                   "samples_per_second": large.samples_per_second}
            out.write(json.dumps(row) + "\n")
            print(f"{name:32} {per_sample / 2**20:9.2f} MiB/sample  {large.samples_per_second:9.1f} samples/s",
                  flush=True)


if __name__ == "__main__":
    main()
