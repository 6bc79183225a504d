"""Stepping the host share of optimizer offload on the GPU, its state streamed over PCIe (issue 12).

Optimizer offload keeps the FP32 masters and the AdamW moments of its share in host memory. Stepping them on
the CPU costs, on W1's share (GPT-2 large, 690 M parameters, one H100 host with 16 cores): 0.27 s, of which
the fused CPU AdamW is 0.14 s and the rest widening gradients, narrowing weights and copies. Streaming the
three FP32 tensors of each segment to the GPU, stepping them there with the fused CUDA AdamW and streaming
them back moves 24 bytes a parameter over a link that carries about 50 GB/s each way at once: 0.17 s for the
same share, the CPU free (benchmarks/bench_host_step.py; RESULTS.md). And it needs no CPU threads during the
last backward, whose kernel launches the CPU worker slowed.

How: a ring of device buffer sets, each holding one segment (`SEGMENT` elements of one parameter) of the
master, both moments and the FP32 gradient. Per segment, three streams: copy in (master, moments), step
(the gradient widened from the 16-bit device gradient, times the clipping factor, then torch's fused Adam
or AdamW kernel, the same one torch's `fused=True` optimizers call), copy out (master, moments; and the
16-bit weight, either into the device parameter or, during backward, into the pinned staging buffer that
`HostOptimizer` sends back after backward). A slot is reused once its copies out are done.

The arithmetic is the host optimizer's: the same kernel, on the same FP32 gradient, with the step count
kept in the host state (so `state_dict()` and a later CPU step see it). On the CPU test device the
"device" is the CPU, there are no streams, and the result is bitwise the CPU step's.

Only Adam and AdamW without amsgrad stream (their state is two moments the shape of the parameter and a
step count); any other optimizer, a GradScaler (FP16: the unscale and inf check run on the host
gradients), or FSDP2 shards keep the CPU step.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

SEGMENT = 1 << 22  # 4 Mi elements: 16 MiB per FP32 buffer; a slot holds 4 of them (+ the 16-bit weight)
RING = 3  # slots: copy in, step and copy out of three segments run at once


def stream_setting() -> bool | None:
    """$AUTOTUNE_OFFLOAD_STREAM: 0 keeps the CPU step, 1 streams wherever the optimizer allows (the CPU test
    device included), unset streams on CUDA."""
    value = os.environ.get("AUTOTUNE_OFFLOAD_STREAM", "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    return None


def streamable(optimizer: torch.optim.Optimizer) -> str | None:
    """Why `optimizer`'s host share cannot be stepped on the device, or None when it can."""
    if type(optimizer).__name__ not in ("Adam", "AdamW"):
        return f"{type(optimizer).__name__} is stepped on the CPU (only Adam and AdamW stream)"
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("differentiable"):
            return "Adam with amsgrad or differentiable=True is stepped on the CPU"
    return None


class DeviceStepper:
    """Steps host masters (`masters[i]`, FP32, pinned) with `optimizer`'s state on `device`.

    Args:
        optimizer: the host optimizer (Adam or AdamW) whose param groups and state hold the masters.
        masters: host master by parameter position.
        params: the device parameters by position (their `.grad` is read, their `.data` written).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, masters: dict[int, torch.Tensor],
                 params: Sequence[torch.nn.Parameter], device: torch.device) -> None:
        self.optimizer = optimizer
        self.masters = masters
        self.params = params
        self.device = device
        self.cuda = device.type == "cuda"
        self._group = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self._largest = min(SEGMENT, max(m.numel() for m in masters.values()))
        self._slots = [[torch.empty(self._largest, device=device) for _ in range(4)] for _ in range(RING if self.cuda else 1)]
        self._narrow: list[dict[torch.dtype, torch.Tensor]] = [{} for _ in self._slots]  # 16-bit weights going out
        self._freed: list[Any] = [None] * len(self._slots)
        self._next = 0
        self._steps: dict[int, torch.Tensor] = {}  # the step count on the device, per parameter
        self._pinned: set[int] = set()
        if self.cuda:
            self.copy_in, self.compute, self.copy_out = (torch.cuda.Stream(device) for _ in range(3))

    def step(self, indices: Sequence[int], *, factor: float = 1.0,
             staging: dict[int, torch.Tensor] | None = None, landed: bool = False) -> None:
        """Step the masters at `indices` with their parameters' device gradients (times `factor`) and put
        each updated weight into the device parameter, or into `staging[i]` (pinned, host) when given.
        `landed`: the gradients are known complete (the offload pipeline's worker waited for each one);
        otherwise the step waits for the current stream's work so far."""
        ready = None
        if self.cuda and not landed:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        for i in indices:
            state, group = self._state(i), self._group[id(self.masters[i])]
            state["step"] += 1  # the host's count, as the CPU step keeps it
            steps = self._steps.setdefault(i, torch.zeros((), device=self.device))
            source = self.params[i].grad
            for start in range(0, self.masters[i].numel(), SEGMENT):
                stop = min(start + SEGMENT, self.masters[i].numel())
                self._segment(i, start, stop, state, group, steps, source, factor, staging, ready)

    def wait(self) -> None:
        """Block until every segment's copies out are done (host masters and moments current), and make
        the current stream wait for the weights written into the device parameters."""
        if self.cuda:
            self.copy_out.synchronize()
            torch.cuda.current_stream(self.device).wait_stream(self.compute)

    def forget_pins(self) -> None:
        """The host state was replaced (a loaded state dict): check it is pinned again before streaming."""
        self._pinned = set()

    # -- one segment --------------------------------------------------------------------------------------
    def _segment(self, i: int, start: int, stop: int, state: dict[str, Any], group: dict[str, Any],
                 steps: torch.Tensor, source: torch.Tensor | None, factor: float,
                 staging: dict[int, torch.Tensor] | None, ready: Any) -> None:
        n = stop - start
        slot = self._next % len(self._slots)
        self._next += 1
        master, m, v, grad = (b[:n] for b in self._slots[slot])
        host = [t.view(-1)[start:stop] for t in (self.masters[i], state["exp_avg"], state["exp_avg_sq"])]
        with self._on("copy_in", wait=self._freed[slot]):
            for dst, src in zip((master, m, v), host):
                dst.copy_(src, non_blocking=True)
            arrived = self._event("copy_in")
        with self._on("compute", wait=arrived, also=ready):
            if source is None:
                grad.zero_()
            else:
                grad.copy_(source.detach().reshape(-1)[start:stop])
                if factor != 1.0:
                    grad.mul_(factor)
            steps.fill_(float(state["step"]))
            self._kernel(group)([master], [grad], [m], [v], [], [steps], amsgrad=False, lr=float(group["lr"]),
                                beta1=float(group["betas"][0]), beta2=float(group["betas"][1]),
                                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                                grad_scale=None, found_inf=None)
            target = self.params[i].data.view(-1)[start:stop]
            if staging is not None:
                weight = self._narrow_buffer(slot, target.dtype)[:n]
                weight.copy_(master)  # narrowed on the device: 2 bytes a parameter go out
            else:
                target.copy_(master)
            stepped = self._event("compute")
        with self._on("copy_out", wait=stepped):
            for dst, src in zip(host, (master, m, v)):
                dst.copy_(src, non_blocking=True)
            if staging is not None:
                staging[i].view(-1)[start:stop].copy_(weight, non_blocking=True)
            self._freed[slot] = self._event("copy_out")

    def _narrow_buffer(self, slot: int, dtype: torch.dtype) -> torch.Tensor:
        buffers = self._narrow[slot]
        if dtype not in buffers:
            buffers[dtype] = torch.empty(self._largest, dtype=dtype, device=self.device)
        return buffers[dtype]

    def _kernel(self, group: dict[str, Any]) -> Callable[..., Any]:
        decoupled = group.get("decoupled_weight_decay", type(self.optimizer).__name__ == "AdamW")
        return torch._fused_adamw_ if decoupled else torch._fused_adam_

    def _state(self, i: int) -> dict[str, Any]:
        """The host state of master i, made as torch's Adam makes it (pinned, for the copies) if missing."""
        master = self.masters[i]
        state = self.optimizer.state[master]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(master, pin_memory=self.cuda)
            state["exp_avg_sq"] = torch.zeros_like(master, pin_memory=self.cuda)
        elif self.cuda and i not in self._pinned:  # loaded from a user's state dict: pageable memory
            for key in ("exp_avg", "exp_avg_sq"):
                if not state[key].is_pinned():
                    state[key] = state[key].pin_memory()
        self._pinned.add(i)
        return state

    # -- streams --------------------------------------------------------------------------------------------
    def _on(self, name: str, *, wait: Any = None, also: Any = None) -> Any:
        if not self.cuda:
            return contextlib.nullcontext()
        stream = getattr(self, name)
        for event in (wait, also):
            if event is not None:
                stream.wait_event(event)
        return torch.cuda.stream(stream)

    def _event(self, name: str) -> Any:
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(getattr(self, name))
        return event

