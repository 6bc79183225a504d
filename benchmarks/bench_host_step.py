"""Where optimizer offload's tail goes, on bare tensors: the host AdamW against stepping the host
share on the GPU with its state streamed over PCIe, and the two side by side.

W1's host share (GPT-2 large, 89% of 774 M parameters, about 690 M) in chunks of 16 Mi elements. For each
way, the time from "every 16-bit gradient is on the device" to "every 16-bit weight is back":

- `cpu`: what the host-stepped engine (`HostSteppedEngine`) does after backward: gradients to pinned host
  memory (2 bytes a parameter), widened to FP32, torch's fused CPU AdamW over the FP32 masters, narrowed to 16
  bits and sent back, chunk by chunk (the copy back of one chunk overlaps the step of the next).
- `stream`: FP32 master and both moments of a chunk copied to the device (12 bytes a parameter), stepped there
  by the fused CUDA AdamW, the 16-bit weight written in place and the three FP32 tensors copied back to the
  host (12 bytes), with copies in, the step and copies out on three streams over a ring of buffers.
- `hybrid X`: the first X of the chunks by the `cpu` way in a thread, the rest by `stream`, at once.

Also the link's bandwidth alone (host to device, device to host, both at once) and the two AdamW kernels.

    python benchmarks/bench_host_step.py --params 690e6 --out host_step.jsonl
    python benchmarks/bench_host_step.py --params 20e6 --device cpu          # CPU smoke run (no streams)
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import torch

CHUNK = 1 << 24
HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)


def adamw(params: list[torch.Tensor], grads: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor],
          steps: list[torch.Tensor]) -> None:
    """torch's fused AdamW kernel, the one `torch.optim.AdamW(fused=True)` calls, on either device."""
    torch._fused_adamw_(params, grads, m, v, [], steps, grad_scale=None, found_inf=None, **HYPER)


class Share:
    """A host share of `numel` parameters in chunks: FP32 masters, grads and moments in pinned host memory,
    16-bit weights and gradients on the device."""

    def __init__(self, numel: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        sizes = [CHUNK] * (numel // CHUNK) + ([numel % CHUNK] if numel % CHUNK else [])
        self.master = [torch.randn(n, pin_memory=pin) for n in sizes]
        self.grad = [torch.zeros(n, pin_memory=pin) for n in sizes]
        self.m = [torch.zeros(n, pin_memory=pin) for n in sizes]
        self.v = [torch.zeros(n, pin_memory=pin) for n in sizes]
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in sizes]
        self.staging = [torch.empty(n, dtype=torch.bfloat16, pin_memory=pin) for n in sizes]
        self.weight = [w.to(device, torch.bfloat16) for w in self.master]
        self.dgrad = [torch.randn(n, device=device, dtype=torch.bfloat16) * 1e-3 for n in sizes]
        self.device = device


def cpu_way(share: Share, chunks: list[int]) -> None:
    cuda = share.device.type == "cuda"
    for c in chunks:
        share.staging[c].copy_(share.dgrad[c], non_blocking=True)
    if cuda:
        torch.cuda.synchronize()
    for c in chunks:
        share.grad[c].copy_(share.staging[c])
        adamw([share.master[c]], [share.grad[c]], [share.m[c]], [share.v[c]], [share.steps[c]])
        share.staging[c].copy_(share.master[c])
        share.weight[c].copy_(share.staging[c], non_blocking=True)


class Streamer:
    """The `stream` way: a ring of device buffer sets, copies in / step / copies out on three streams."""

    def __init__(self, share: Share, ring: int = 3) -> None:
        self.share = share
        dev = share.device
        self.buffers = [[torch.empty(CHUNK, device=dev) for _ in range(3)] for _ in range(ring)]
        self.steps = [torch.zeros((), device=dev) for _ in share.master]
        self.copy_in, self.compute, self.copy_out = (torch.cuda.Stream(dev) for _ in range(3))
        self.freed = [None] * ring

    def run(self, chunks: list[int]) -> None:
        s = self.share
        for k, c in enumerate(chunks):
            slot = k % len(self.buffers)
            p, m, v = (b[: s.master[c].numel()] for b in self.buffers[slot])
            with torch.cuda.stream(self.copy_in):
                if self.freed[slot] is not None:
                    self.copy_in.wait_event(self.freed[slot])
                for dst, src in ((p, s.master[c]), (m, s.m[c]), (v, s.v[c])):
                    dst.copy_(src, non_blocking=True)
                arrived = torch.cuda.Event()
                arrived.record(self.copy_in)
            with torch.cuda.stream(self.compute):
                self.compute.wait_event(arrived)
                adamw([p], [s.dgrad[c].float()], [m], [v], [self.steps[c]])
                s.weight[c].copy_(p)
                stepped = torch.cuda.Event()
                stepped.record(self.compute)
            with torch.cuda.stream(self.copy_out):
                self.copy_out.wait_event(stepped)
                for dst, src in ((s.master[c], p), (s.m[c], m), (s.v[c], v)):
                    dst.copy_(src, non_blocking=True)
                self.freed[slot] = torch.cuda.Event()
                self.freed[slot].record(self.copy_out)
        torch.cuda.synchronize()


def timed(fn: Any, repeat: int) -> float:
    fn()  # warm-up: pinned pages touched, kernels loaded
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def link(share: Share, repeat: int) -> dict[str, float]:
    """GB/s of FP32 chunks host to device, device to host, and both directions at once."""
    n = len(share.master)
    dev = [torch.empty(CHUNK, device=share.device) for _ in range(2)]
    a, b = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d() -> None:
        with torch.cuda.stream(a):
            for c in range(n):
                dev[0][: share.master[c].numel()].copy_(share.master[c], non_blocking=True)

    def d2h() -> None:
        with torch.cuda.stream(b):
            for c in range(n):
                share.m[c].copy_(dev[1][: share.m[c].numel()], non_blocking=True)

    def both() -> None:
        h2d()
        d2h()

    nbytes = sum(t.numel() for t in share.master) * 4
    return {"h2d_GBps": nbytes / timed(h2d, repeat) / 1e9, "d2h_GBps": nbytes / timed(d2h, repeat) / 1e9,
            "both_GBps_each": nbytes / timed(both, repeat) / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=690e6, help="host share in parameters (690e6: W1's 89%%)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hybrid", default="0.25,0.35,0.45",
                        help="shares of the chunks the CPU steps beside the stream")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    share = Share(int(args.params), device)
    every = list(range(len(share.master)))
    rows: list[dict[str, Any]] = [{"case": "setup", "params": int(args.params), "chunks": len(every),
                                   "threads": torch.get_num_threads(), "device": str(device)}]
    rows.append({"case": "cpu", "seconds": timed(lambda: cpu_way(share, every), args.repeat)})
    rows.append({"case": "cpu_adamw_only", "seconds": timed(lambda: [adamw([share.master[c]], [share.grad[c]],
                 [share.m[c]], [share.v[c]], [share.steps[c]]) for c in every], args.repeat)})
    if device.type == "cuda":
        rows.append({"case": "link", **link(share, args.repeat)})
        streamer = Streamer(share)
        rows.append({"case": "stream", "seconds": timed(lambda: streamer.run(every), args.repeat)})
        for x in (float(v) for v in args.hybrid.split(",")):
            k = round(x * len(every))
            cpu_part, gpu_part = every[:k], every[k:]

            def hybrid(cpu_part: Any = cpu_part, gpu_part: Any = gpu_part) -> None:
                worker = threading.Thread(target=cpu_way, args=(share, cpu_part))
                worker.start()
                streamer.run(gpu_part)
                worker.join()

            rows.append({"case": f"hybrid {x}", "cpu_chunks": k, "seconds": timed(hybrid, args.repeat)})
    for row in rows:
        print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
