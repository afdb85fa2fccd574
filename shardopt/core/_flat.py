"""Flat parameter buffers: one 1-D tensor per (dtype, device) whose slices back the model's parameters.

After :class:`FlatParams` is built, every parameter's ``.data`` is a view into ``FlatParams.data``,
so writing the flat buffer (e.g. the all-gather after an update) changes the model with no copy.
"""
from __future__ import annotations

import bisect
from typing import Sequence

import torch
from torch import Tensor

from shardopt.core._dtensor import rewrap
from shardopt.core._layout import FlatLayout, Range


class FlatParams:
    """Parameters of one dtype and device packed into one padded flat buffer."""

    data: Tensor  # 1D, param dtype, layout.numel elements; every param's .data is a view into it

    def __init__(self, params: Sequence[torch.nn.Parameter], layout: FlatLayout,
                 dtensors: Sequence[Tensor | None] | None = None) -> None:
        """``dtensors``: the DTensor parameter each of ``params`` stands in for (or None), rebuilt
        over the same view (see core._dtensor [Note: DTensor parameters])."""
        if len(params) != len(layout.params):
            raise AssertionError(f"a flat buffer of {len(params)} parameters laid out for {len(layout.params)}")
        self.params = list(params)
        self.layout = layout
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.data = torch.zeros(layout.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p, span in zip(self.params, layout.params):
                view = self.data[span.global_range.as_slice()].view(span.shape)
                view.copy_(p.detach())
                p.data = view
        for dt, p in zip(dtensors or [], self.params):
            if dt is not None:
                rewrap(dt, p.data)

    def param_view(self, flat: Tensor, index: int) -> Tensor:
        """Parameter ``index``'s slice of any flat tensor laid out like this buffer, shaped."""
        span = self.layout.params[index]
        return flat[span.global_range.as_slice()].view(span.shape)

    def slice(self, r: Range) -> Tensor:
        """A 1-D view of the buffer over global range ``r``."""
        return self.data[r.as_slice()]

    def shard(self, rank: int) -> ShardView:
        """Shard rank ``rank``'s pieces of the buffer, in local coordinates (views)."""
        return ShardView(self.data, self.layout.shard_runs(rank), self.layout.shard_numel)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class ShardView:
    """One rank's shard of a flat tensor laid out by a ``FlatLayout``: its piece of each bucket,
    addressed in local coordinates (see core._layout [Note: alignment, padding and shards]). The
    pieces are views of the flat tensor, apart from each other in it, so the shard is not one
    tensor: a local range inside one piece is a view (``[]``), the whole shard a copy (``read``)
    unless it is one piece. Element counts and ranges are in elements."""

    def __init__(self, flat: Tensor, runs: Sequence[tuple[Range, Range]], numel: int) -> None:
        self.flat = flat
        self.runs = list(runs)  # (local range, global range) per non-empty piece, in local order
        self._starts = [local.start for local, _ in self.runs]  # for a bisection: a step asks once per kernel call
        self._numel = numel
        self.dtype, self.device = flat.dtype, flat.device

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self.flat.element_size()

    def __getitem__(self, sl: slice) -> Tensor:
        """The view of local elements ``sl`` (a step-less slice within one piece)."""
        start, stop = sl.start or 0, self._numel if sl.stop is None else sl.stop
        if start == stop:
            return self.flat[:0]
        k = bisect.bisect_right(self._starts, start) - 1
        if k >= 0:
            local, glob = self.runs[k]
            if stop <= local.end:
                return self.flat[glob.start + start - local.start:glob.start + stop - local.start]
        raise AssertionError(f"local elements [{start}, {stop}) are not within one piece of the shard: "
                             f"{[local for local, _ in self.runs]}")

    def pieces(self) -> list[tuple[Range, Tensor]]:
        """(local range, view) of each non-empty piece, in local order."""
        return [(local, self.flat[glob.as_slice()]) for local, glob in self.runs]

    def read(self) -> Tensor:
        """The whole shard as one 1-D tensor: a view when its pieces follow each other in the flat
        tensor (one rank, or one bucket), else a copy."""
        adjacent = all(a[1].end == b[1].start for a, b in zip(self.runs, self.runs[1:]))
        if self.runs and adjacent and self.runs[-1][0].end - self.runs[0][0].start == self._numel:
            return self.flat[self.runs[0][1].start:self.runs[-1][1].end]
        out = torch.zeros(self._numel, dtype=self.dtype, device=self.device)
        for local, view in self.pieces():
            out[local.as_slice()].copy_(view)
        return out

    def window(self, r: Range) -> ShardView:
        """Local elements ``r`` of this shard as a shard of their own (local coordinates from ``r.start``)."""
        runs = []
        for local, glob in self.runs:
            mine = local.intersect(r)
            if mine.size:
                runs.append((mine.relative_to(r.start), mine.shifted(glob.start - local.start)))
        return ShardView(self.flat, runs, r.size)

    def float(self) -> Tensor:
        """The whole shard as fp32 (a copy unless fp32 and one piece)."""
        return self.read().float()

    def copy_(self, src: Tensor) -> ShardView:
        """Write the whole shard from ``src`` (1-D, ``numel()`` elements, any dtype), piece by piece."""
        for local, view in self.pieces():
            view.copy_(src[local.as_slice()])
        return self


def views(t: Tensor | ShardView) -> list[Tensor]:
    """``t`` without a copy: a ``ShardView``'s pieces (views), a tensor itself; for what reads
    every element in no particular order (a maximum, an inf/NaN test)."""
    return [view for _, view in t.pieces()] if isinstance(t, ShardView) else [t]


def whole(t: Tensor | ShardView) -> Tensor:
    """``t`` as one tensor: a ``ShardView`` read (see ``ShardView.read``), a tensor itself."""
    return t.read() if isinstance(t, ShardView) else t


def set_grad(param: Tensor, grad: Tensor | None) -> bool:
    """``param.grad = grad``; False, changing nothing, where torch would refuse it because the
    parameter was converted or replaced after the optimizer was built (another dtype, device or
    shape): dropped here so that a backward on one rank is not stopped, and reported by the
    binding check at step() on every rank."""
    # What torch's setter (THPVariable_set_grad) checks, in its order: dtype, device, layout (not
    # for a sparse COO gradient), size.
    if grad is not None and (grad.dtype != param.dtype or grad.device != param.device
                             or (grad.layout != param.layout and grad.layout is not torch.sparse_coo)
                             or grad.shape != param.shape):
        return False
    param.grad = grad
    return True


def copies_into(src: Tensor, dst: Tensor) -> bool:
    """Whether ``dst.copy_(src)`` takes ``src``'s shape: torch broadcasts ``src`` to ``dst``'s
    shape (no more dimensions than ``dst``; aligned from the last one, each of its sizes equal to
    ``dst``'s or 1). The dtype and device never stop a copy (it casts and moves). A question."""
    s, d = src.shape, dst.shape
    if s == d:
        return True
    return len(s) <= len(d) and all(a == b or a == 1 for a, b in zip(reversed(s), reversed(d)))
