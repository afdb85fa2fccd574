"""A shard in two pieces, each with its own placement: ``offload_fraction`` below 1.

[Note: offload fraction]
With ``offload="cpu", offload_fraction=f`` a rank keeps the first buckets of each buffer's shard
(in buffer order, about ``f`` of its elements) in host memory and the rest beside the weights.
Bucket ranges are contiguous and ordered within a shard, so the host piece is the prefix
``[0, split)`` and the device piece ``[split, shard_numel)``. Each piece has its own master-weight
and moment strategy over its own range; the strategy's global offset (which keys stochastic
rounding) and the 8-bit blocks (the split is a bucket boundary, so a parameter and a block
boundary) are those of the whole shard, so the results do not depend on ``f``.

:class:`SplitMaster` and :class:`SplitMoments` give the buffer the interface of one strategy over
the whole shard: a local range (always inside one bucket, so inside one piece) goes to its piece,
translated; whole-shard reads concatenate the pieces (on the host), whole-shard loads split them.
"""
from __future__ import annotations

from typing import Any, Generic, Sequence, TypeVar, cast

import torch
from torch import Tensor

from shardopt.core._layout import Range
from shardopt.core._records import BucketRecord
from shardopt.update._master import FP32Master, MasterWeights
from shardopt.update._moments import Moments

_Strategy = TypeVar("_Strategy", bound="MasterWeights | Moments")  # what one piece holds


def split_point(buckets: Sequence[BucketRecord], shard_numel: int, fraction: float) -> int:
    """The element offset in the shard where the host piece ends: the first bucket boundary at or
    past ``fraction`` of the shard, so that a fraction above 0 offloads at least one bucket. Local."""
    target = fraction * shard_numel
    return min((b.local.end for b in buckets if b.local.size and b.local.end >= target), default=shard_numel)


def _routed(name: str) -> Any:
    """A method that calls the piece holding its local range ``r`` (first argument), with ``r``
    made relative to that piece."""
    def method(self: _Pieces, r: Range, *args: Any) -> Any:
        part, local = self._find(r)
        return getattr(part, name)(local, *args)
    method.__name__ = name
    return method


def _summed(name: str) -> property:
    """A property that adds the pieces' own (bytes)."""
    return property(lambda self: sum(getattr(p, name) for p in self.parts))


class _Pieces(Generic[_Strategy]):
    """Routes local ranges to the piece holding them. The callers move values to the piece's
    device themselves (``FlatGroup.place_of``)."""

    def __init__(self, parts: Sequence[_Strategy], starts: Sequence[int]) -> None:
        self.parts, self.starts = list(parts), list(starts)
        self.name = parts[0].name

    def _find(self, r: Range) -> tuple[_Strategy, Range]:
        k = sum(1 for start in self.starts[1:] if r.start >= start)  # the last piece starting at or before r
        if k + 1 < len(self.starts) and r.end > self.starts[k + 1]:
            raise AssertionError(f"range {r} spans two pieces of the shard (split at {self.starts[1:]})")
        return self.parts[k], r.relative_to(self.starts[k])

    def _cat(self, tensors: Sequence[Tensor]) -> Tensor:
        return torch.cat([t.cpu() for t in tensors])

    def _split(self, t: Tensor, sizes: Sequence[int]) -> list[Tensor]:
        return list(torch.split(t.reshape(-1), list(sizes)))


class SplitMaster(_Pieces[MasterWeights]):
    """One master-weight strategy per piece, as one over the whole shard (see [Note: offload fraction])."""

    update_ = _routed("update_")
    kernels_for = _routed("kernels_for")
    read_fp32 = _routed("read_fp32")
    write_fp32_ = _routed("write_fp32_")
    refresh_ = _routed("refresh_")
    master_bytes = _summed("master_bytes")
    extra_bytes = _summed("extra_bytes")

    @property
    def seed(self) -> int:
        return self.parts[0].seed

    @seed.setter
    def seed(self, value: int) -> None:
        for p in self.parts:
            p.seed = value

    def fp32(self) -> Tensor:
        return self._cat([p.fp32() for p in self.parts])

    def state_tensors(self) -> dict[str, Tensor]:
        return {"master": self.fp32()}

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        for part, piece in zip(self.parts, self._split(tensors["master"], [p.param_shard.numel() for p in self.parts])):
            part.load_state_tensors({"master": piece.to(part.param_shard.device)})

    @property
    def master(self) -> Tensor:  # the fp32 copy, for inspect(): a host copy of both pieces
        return self._cat([cast(Tensor, cast(FP32Master, p).master) for p in self.parts])  # read when owns_copy: fp32 pieces

    @property
    def owns_copy(self) -> bool:
        return all(getattr(p, "owns_copy", False) for p in self.parts)


class SplitMoments(_Pieces[Moments]):
    """One moment strategy per piece, as one over the whole shard (see [Note: offload fraction])."""

    prepare = _routed("prepare")
    max_operand = _routed("max_operand")
    state_piece = _routed("state_piece")
    write_piece = _routed("write_piece")
    read = _routed("read")
    write_ = _routed("write_")
    exp_avg_bytes = _summed("exp_avg_bytes")
    exp_avg_sq_bytes = _summed("exp_avg_sq_bytes")

    @property
    def live(self) -> bool:
        return self.parts[0].live

    @property
    def state_keys(self) -> tuple[str, ...]:
        return self.parts[0].state_keys

    def fp32(self) -> tuple[Tensor, ...]:
        each = [p.fp32() for p in self.parts]
        return tuple(self._cat([t[k] for t in each]) for k in range(len(each[0])))

    def load_(self, exp_avg: Tensor, exp_avg_sq: Tensor, max_exp_avg_sq: Tensor | None = None) -> None:
        sizes = [p.numel for p in self.parts]
        v_sizes = sizes if exp_avg_sq.numel() else [0] * len(sizes)  # Muon: no second moment
        vmaxes = self._split(max_exp_avg_sq, sizes) if max_exp_avg_sq is not None else [None] * len(sizes)
        for part, m, v, vmax in zip(self.parts, self._split(exp_avg, sizes), self._split(exp_avg_sq, v_sizes), vmaxes):
            part.load_(m.to(part.device), v.to(part.device), None if vmax is None else vmax.to(part.device))

    def tensors(self) -> dict[str, Tensor]:
        named = [p.tensors() for p in self.parts]
        return {k: self._cat([t[k] for t in named]) for k in named[0]}

    def load_tensors(self, tensors: dict[str, Tensor]) -> None:
        named = [p.tensors() for p in self.parts]
        for k in named[0]:
            for t, piece in zip((n[k] for n in named), self._split(tensors[k], [n[k].numel() for n in named])):
                t.copy_(piece)
