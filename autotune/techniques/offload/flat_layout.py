"""One flat buffer viewed as many tensors, and runs of those views cut into segments of pieces."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .host_buffers import host_empty


def flat_views(shapes: Sequence[torch.Size], *, pin: bool, dtype: torch.dtype = torch.float32
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One buffer of `dtype` (pinned when `pin`) and a view of it per shape, in order."""
    numel = sum(math.prod(s) for s in shapes)
    flat = host_empty(numel, dtype, pin=pin)  # from the tune's pool, between trials
    views, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        views.append(flat[offset:offset + n].view(shape))
        offset += n
    return flat, views


@dataclass(frozen=True, slots=True)
class Piece:
    index: int  # parameter position
    lo: int  # elements [lo, hi) of the parameter
    hi: int
    at: int  # where the piece starts in its segment


def cut_segments(indices: Sequence[int], start: Mapping[int, int], numel: Mapping[int, int], largest: int
                 ) -> list[tuple[int, int, list[Piece]]]:
    """(start, stop, pieces) over the flat layout (tensor i at `start[i]`, `numel[i]` long): runs of
    neighbouring tensors cut every `largest` elements."""
    out: list[tuple[int, int, list[Piece]]] = []
    for i in sorted(indices, key=start.__getitem__):
        lo, n = 0, numel[i]
        while lo < n:
            here = start[i] + lo
            if not out or out[-1][1] != here or out[-1][1] - out[-1][0] >= largest:
                out.append((here, here, []))
            first, stop, pieces = out[-1]
            take = min(n - lo, largest - (stop - first))
            pieces.append(Piece(i, lo, lo + take, stop - first))
            out[-1] = (first, stop + take, pieces)
            lo += take
    return out


def piece_views(pieces: Sequence[Piece], *buffers: torch.Tensor) -> list[list[torch.Tensor]]:
    """Per buffer, its range of each piece (a segment's buffers, in the pieces' order)."""
    return [[b[p.at:p.at + p.hi - p.lo] for p in pieces] for b in buffers]
