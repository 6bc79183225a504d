"""The device stepper the streamed engine runs (`streamed_engine.py`): the host share of optimizer offload
stepped on the GPU, its state streamed over PCIe.

Optimizer offload keeps the FP32 masters and the AdamW moments of its share in host memory. Stepping them on
the CPU costs the fused CPU AdamW plus widening gradients, narrowing weights and copies. Streaming the three
FP32 tensors of each segment to the GPU, stepping them there with the fused CUDA AdamW and streaming them
back moves 24 bytes a parameter over a link that carries them both ways at once, and leaves the CPU free:
faster on the hosts measured (benchmarks/bench_host_step.py; docs/offload-engines.md).

Serial (`step`), it runs after backward. Overlapped (`begin`, `landed`, `finish`), each segment is issued from
the last backward's post-accumulate-grad hooks (the engine's) as soon as every parameter in it has its final
gradient, on the GPU's streams behind an event of the backward's stream: no thread, no host wait (issued from
the host-stepped engine's pipeline worker instead, the new weights staged through host memory, it was no
faster). An overlapped step
writes the new masters and moments into a second set of host buffers, made current by `finish`: an attempt
that runs out of memory half-way (`abort`) leaves the state as it was, puts the old weights back on the
device from the untouched masters, and the re-run is exact. It costs 12 more bytes of pinned host memory a
parameter, allocated when `StreamedEngine` is built for an overlapped plan (`reserve`).

How: the masters are views of one pinned FP32 buffer (`Shares` lays them out so) and the stepper
keeps both moments in two more, in the same order, so any run of parameters is one range of each. A ring
of device buffer sets each holds one segment (`SEGMENT` elements, across parameter boundaries) of the
master, both moments and the FP32 gradient. Per segment, on three streams: copy in (three ranges); step
(each parameter's piece of its 16-bit device gradient widened into the segment, times the clipping factor,
then torch's fused Adam or AdamW kernel over the pieces, the kernel torch's `fused=True` optimizers call);
copy out (three ranges), the 16-bit weights written into the device parameters on the step's stream. A
slot is reused once its copies out are done. Per-segment work, not per-parameter, keeps the CPU's share
small: streaming each parameter on its own spends as long issuing copies as the link takes to carry them.

The arithmetic is the host optimizer's: the same kernel, on the same FP32 gradient, with the step count
kept in the host state (so `state_dict()` and a later CPU step see it), and the same parameters: a piece
whose parameter got no gradient is not stepped (torch's Adam skips it), it only passes through its segment.
On the CPU test device the "device" is the CPU, there are no streams, and the result is bitwise the CPU
step's.

Only Adam and AdamW without amsgrad stream (their state is two moments the shape of the parameter and a
step count); any other optimizer, or a GradScaler (FP16: the unscale and inf check run on the host
gradients), keeps the CPU step. On FSDP2 shards each rank streams its own parts, serially: FSDP assigns the
reduced gradients on its own stream, outside the hooks an overlapped step is issued from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ... import settings, torch_private
from ...devices.ceiling import host_memory
from .flat_layout import Piece, cut_segments, flat_views, piece_views
from .host_buffers import host_like
from .local import local_part

SEGMENT = 1 << 22  # 4 Mi elements: 16 MiB per FP32 buffer; a slot holds 4 (master, 2 moments, gradient)
RING = 3  # slots: copy in, step and copy out of three segments run at once
STREAMED = ("Adam", "AdamW")  # their state: two moments the shape of the parameter and a step count


def stream_wanted(device_type: str) -> bool:
    """$AUTOTUNE_OFFLOAD_STREAM: 0 keeps the CPU step, 1 streams wherever the optimizer allows (the CPU test
    device included), unset streams on CUDA."""
    return settings.switch(settings.OFFLOAD_STREAM_ENV, default=device_type == "cuda")


def streams(device_type: str, optimizer_class: str, precision: str) -> bool:
    """Whether optimizer offload of this kind steps its host share on the device (`build_engine` decides
    the same from the built optimizer; the search asks before building one)."""
    return stream_wanted(device_type) and optimizer_class in STREAMED and precision != "fp16"


def streamable(optimizer: torch.optim.Optimizer) -> str | None:
    """Why `optimizer`'s host share cannot be stepped on the device, or None when it can."""
    if type(optimizer).__name__ not in STREAMED:
        return f"{type(optimizer).__name__} is stepped on the CPU (only Adam and AdamW stream)"
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("differentiable"):
            return "Adam with amsgrad or differentiable=True is stepped on the CPU"
    return None


class DeviceStepper:
    """Steps the host masters (`masters[i]`, views of the pinned FP32 buffer `flat`, in `order`) with
    `optimizer`'s state on `device`.

    Args:
        optimizer: the host optimizer (Adam or AdamW) whose param groups and state hold the masters.
        flat: the masters' buffer; `masters[order[k]]` follows `masters[order[k - 1]]` in it.
        params: the device parameters by position (their `.grad` is read, their `.data` written).

    Large: the masters' layout in `flat` (each parameter's offset and size), the moments laid out alike, the
    ring of device slots with the three streams and events that order their copies and compute, and the
    overlapped step's open segments. Every segment reads the same offsets, takes a slot from the same ring and
    waits on the same events, so the layout, the ring and the open step stay in one object.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, flat: torch.Tensor, masters: dict[int, torch.Tensor],
                 order: Sequence[int], params: Sequence[torch.nn.Parameter], device: torch.device) -> None:
        self.optimizer = optimizer
        self.flat = flat
        self.masters = masters
        self.params = params
        self.device = device
        self.cuda = device.type == "cuda"
        self._start: dict[int, int] = {}
        self._numel = {i: masters[i].numel() for i in order}
        offset = 0
        for i in order:
            self._start[i] = offset
            offset += self._numel[i]
        # The moments, laid out as the masters (host memory: 8 bytes a parameter, what torch's Adam holds).
        self._m, m_views = flat_views([masters[i].shape for i in order], pin=self.cuda, dtype=flat.dtype)
        self._v, v_views = flat_views([masters[i].shape for i in order], pin=self.cuda, dtype=flat.dtype)
        self._moments = {i: (m, v) for i, m, v in zip(order, m_views, v_views)}
        self._group = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self._largest = min(SEGMENT, offset)
        self._slots = [[torch.empty(self._largest, dtype=flat.dtype, device=device) for _ in range(4)]
                       for _ in range(RING if self.cuda else 1)]
        self._freed: list[Any] = [None] * len(self._slots)
        self._next = 0
        self._steps: dict[int, torch.Tensor] = {}  # the step count on the device, per parameter
        if self.cuda:
            self.copy_in, self.compute, self.copy_out = (torch.cuda.Stream(device) for _ in range(3))
            self._after_current()  # the slots were allocated on the current stream (see `_device_counts`)
        self._order = list(order)
        self._spare: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # an overlapped step writes here
        self._open: list[tuple[int, int, list[Piece]]] = []  # the armed step's segments
        self._waiting: list[set[int]] = []  # gradients each open segment still waits for
        self._of: dict[int, list[int]] = {}  # the open segments of each parameter
        self._issued: list[int] = []
        self._stepped: set[int] = set()  # parameters the armed step's issued segments stepped
        self.early = 0  # segments the last overlapped step issued during backward (the rest: in `finish`)

    def step(self, indices: Sequence[int], *, factor: float = 1.0) -> None:
        """Step the masters at `indices` whose parameters got a gradient (torch's optimizers skip the others:
        no weight decay, moments or step count) with those device gradients (times `factor`), after the
        current stream's work so far (backward), and write each updated weight into its parameter."""
        ready = self._current()
        live = [i for i in indices if self.params[i].grad is not None]
        self._device_counts(live, ahead=1)
        for start, stop, pieces in self._segments(live):
            self._segment(start, stop, pieces, factor, ready)
        for i in live:
            self._count(i)  # the host's count, as the CPU step keeps it

    # -- overlapped with the last backward --------------------------------------------------------------------
    def begin(self, indices: Sequence[int]) -> None:
        """The next backward is the last before the step: segments of `indices` will be issued as their
        gradients land (`landed`), writing into the spare buffers; `finish` or `abort` ends it."""
        self.reserve()
        self._device_counts(indices, ahead=1)  # the host's count moves only at `finish`
        self._open = self._segments(indices)
        self._waiting = [{p.index for p in pieces} for _, _, pieces in self._open]
        self._of = {}
        for k, waiting in enumerate(self._waiting):
            for i in waiting:
                self._of.setdefault(i, []).append(k)
        self._issued = []
        self._stepped = set()
        self.early = 0

    def reserve(self) -> None:
        """Allocate the spare buffers an overlapped step writes into (pinning 12 bytes a parameter takes seconds
        for a large share: `StreamedEngine` reserves them when it is built, not in a timed step)."""
        if self._spare is None:
            with host_memory():  # host buffers (on the CPU test device too: not the simulated device's memory)
                self._spare = (host_like(self.flat, pin=self.cuda), host_like(self._m, pin=self.cuda),
                               host_like(self._v, pin=self.cuda))

    def landed(self, i: int) -> None:
        """Parameter i's gradient is final (a hook in the last backward): issue every segment now complete."""
        for k in self._of.get(i, ()):
            waiting = self._waiting[k]
            if i in waiting:
                waiting.discard(i)
                if not waiting:
                    self._issue(k)
                    self.early += 1

    def issue_rest(self) -> None:
        """Issue the armed step's segments still open (their gradients are final: backward has ended)."""
        issued = set(self._issued)
        for k in range(len(self._open)):
            if k not in issued:
                self._issue(k)

    def finish(self) -> None:
        """Issue the segments still open, wait for all, and make the new masters and moments current (and the
        step count of each parameter stepped: one that got no gradient keeps its state as it was)."""
        self.issue_rest()
        self.wait()
        self._swap()
        for i in sorted(self._stepped):
            self._count(i)
        self._open, self._of, self._stepped = [], {}, set()

    def abort(self) -> None:
        """The armed backward failed: nothing changed but the weights of the segments issued, which go back
        to the (untouched) masters' values."""
        self.close()
        for k in self._issued:
            start, stop, pieces = self._open[k]
            for p in pieces:
                old = self.flat[start + p.at:start + p.at + p.hi - p.lo]
                self.params[p.index].data.view(-1)[p.lo:p.hi].copy_(old)
        self._open, self._of, self._issued, self._stepped = [], {}, [], set()

    @property
    def armed(self) -> bool:
        """Between `begin` and `finish` (or `abort`)."""
        return bool(self._of)

    @property
    def segments(self) -> int:
        """Segments of the armed step."""
        return len(self._open)

    def _issue(self, k: int) -> None:
        start, stop, pieces = self._open[k]
        self._segment(start, stop, pieces, 1.0, self._current(), out=self._spare)  # after this gradient's backward
        self._issued.append(k)

    def _swap(self) -> None:
        """The spare buffers become the masters' and moments' storage (the same tensors: the optimizer state
        keys on them), the old ones the spare."""
        assert self._spare is not None
        self._spare, (self.flat, self._m, self._v) = (self.flat, self._m, self._v), self._spare
        for i in self._order:
            start, n, shape = self._start[i], self.masters[i].numel(), self.masters[i].shape
            self.masters[i].data = self.flat[start:start + n].view(shape)
            m, v = (t[start:start + n].view(shape) for t in (self._m, self._v))
            self._moments[i] = (m, v)
            state = self.optimizer.state[self.masters[i]]
            if state:
                state["exp_avg"], state["exp_avg_sq"] = m, v

    def wait(self) -> None:
        """Block until every segment's copies out are done (host masters and moments current), and make
        the current stream wait for the weights written into the device parameters."""
        if self.cuda:
            self.copy_out.synchronize()
            torch.cuda.current_stream(self.device).wait_stream(self.compute)

    def close(self) -> None:
        """Block until nothing queued on the three streams remains (before their buffers may be freed, also
        after a step that failed half-way)."""
        if self.cuda:
            for stream in (self.copy_in, self.compute, self.copy_out):
                stream.synchronize()

    # -- segments -------------------------------------------------------------------------------------------
    def _segments(self, indices: Sequence[int]) -> list[tuple[int, int, list[Piece]]]:
        """(start, stop, pieces) over the flat layout: runs of neighbouring parameters cut every SEGMENT."""
        return cut_segments(indices, self._start, self._numel, self._largest)

    def _segment(self, start: int, stop: int, pieces: list[Piece], factor: float, ready: Any,
                 out: Sequence[torch.Tensor] | None = None) -> None:
        """Stream one segment in, step it, stream it out (into `out`'s ranges, the spare buffers, when given;
        else in place). Only the pieces whose parameter has a gradient are stepped; the others go out as they
        came in."""
        pieces = [p for p in pieces if self.params[p.index].grad is not None]
        self._stepped.update(p.index for p in pieces)
        n = stop - start
        slot = self._next % len(self._slots)
        self._next += 1
        master, m, v, grad = (b[:n] for b in self._slots[slot])
        host = [t[start:stop] for t in (self.flat, self._m, self._v)]
        back = [t[start:stop] for t in out] if out is not None else host
        with self._on("copy_in", wait=self._freed[slot]):
            for dst, src in zip((master, m, v), host):
                dst.copy_(src, non_blocking=True)
            arrived = self._event("copy_in")
        with self._on("compute", wait=arrived, also=ready):
            self._gather_grads(grad, pieces, factor)
            for group, members in self._by_group(pieces):
                self._kernel(group)(*piece_views(members, master, grad, m, v), [],
                                    [self._steps[p.index] for p in members],
                                    amsgrad=False, lr=float(group["lr"]), beta1=float(group["betas"][0]),
                                    beta2=float(group["betas"][1]), weight_decay=group["weight_decay"],
                                    eps=group["eps"], maximize=group["maximize"], grad_scale=None, found_inf=None)
            for p in pieces:  # of an FSDP2 shard, this rank's part: its FP32 storage, in place
                local_part(self.params[p.index].data).view(-1)[p.lo:p.hi].copy_(master[p.at:p.at + p.hi - p.lo])
            stepped = self._event("compute")
        with self._on("copy_out", wait=stepped):
            for dst, src in zip(back, (master, m, v)):
                dst.copy_(src, non_blocking=True)
            self._freed[slot] = self._event("copy_out")

    def _gather_grads(self, grad: torch.Tensor, pieces: list[Piece], factor: float) -> None:
        for piece in pieces:
            into = grad[piece.at:piece.at + piece.hi - piece.lo]
            source = self.params[piece.index].grad
            if source is None:
                into.zero_()
            else:
                into.copy_(local_part(source.detach()).reshape(-1)[piece.lo:piece.hi])
        if factor != 1.0:
            grad.mul_(factor)

    def _by_group(self, pieces: list[Piece]) -> list[tuple[dict[str, Any], list[Piece]]]:
        """The pieces by param group (each group's lr, betas... go to its own kernel call)."""
        groups: dict[int, tuple[dict[str, Any], list[Piece]]] = {}  # by id: groups are dicts, unhashable
        for piece in pieces:
            group = self._group[id(self.masters[piece.index])]
            groups.setdefault(id(group), (group, []))[1].append(piece)
        return list(groups.values())

    def _kernel(self, group: dict[str, Any]) -> Callable[..., Any]:
        decoupled = group.get("decoupled_weight_decay", type(self.optimizer).__name__ == "AdamW")
        return torch_private.fused_adam(decoupled)

    def _ready(self, i: int) -> float:
        """Master i's moments in the stepper's buffers, its step count: zeros and 0 before its first step (it
        has no host state then, as torch keeps none before a parameter's first gradient); a loaded state
        dict's moments are copied in (they arrive as separate, pageable tensors)."""
        state = self.optimizer.state.get(self.masters[i])
        m, v = self._moments[i]
        if not state:
            m.zero_()
            v.zero_()
            return 0.0
        for key, mine in (("exp_avg", m), ("exp_avg_sq", v)):
            theirs = state.get(key)
            if theirs is not mine:
                if theirs is not None:
                    mine.copy_(theirs)
                state[key] = mine
        return float(state["step"])

    def _count(self, i: int) -> None:
        """Master i was stepped: one more in its host state's count (the state made at its first step), its
        moments the stepper's buffers."""
        state = self.optimizer.state[self.masters[i]]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"], state["exp_avg_sq"] = self._moments[i]
        state["step"] += 1

    def _device_counts(self, indices: Sequence[int], *, ahead: int) -> None:
        """The step count the kernel reads, per parameter: the host's plus `ahead` (torch's Adam adds 1
        before calling the kernel). Allocated on the current stream (no pool of the stepper's own), filled on
        the step's stream once it has waited for the current stream's queued work: a block the allocator
        hands out may still be written by kernels queued for its last tenant; counts filled without that wait
        can read 0 or garbage after the first step, whose bias correction then makes the weights NaN
        (benchmarks/check_offload_loss.py)."""
        fresh = [i for i in indices if i not in self._steps]
        for i in fresh:
            self._steps[i] = torch.empty((), device=self.device)
        if fresh:
            self._after_current()
        with self._on("compute"):
            for i in indices:
                self._steps[i].fill_(self._ready(i) + ahead)

    # -- streams --------------------------------------------------------------------------------------------
    def _on(self, name: str, *, wait: Any = None, also: Any = None) -> Any:
        if not self.cuda:
            return contextlib.nullcontext()
        stream = getattr(self, name)
        for event in (wait, also):
            if event is not None:
                stream.wait_event(event)
        return torch.cuda.stream(stream)

    def _after_current(self) -> None:
        """Every stream of the stepper waits for the work queued on the current stream so far."""
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            for stream in (self.copy_in, self.compute, self.copy_out):
                stream.wait_stream(current)

    def _current(self) -> Any:
        """An event after the current stream's work so far (None on the CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _event(self, name: str) -> Any:
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(getattr(self, name))
        return event

