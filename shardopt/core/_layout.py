"""Partition math for the flat buffers: pure functions over small frozen dataclasses.

This module owns every index computation of shardopt and knows nothing of torch.distributed.

[Note: the four ranges]
Four kinds of element ranges appear in ZeRO bookkeeping and must never be confused:

* ``global_range``: elements of the whole flat buffer (what every rank holds for parameters).
* ``bucket_range``: elements relative to the start of one communication bucket.
* ``local_range``: elements relative to the start of *this rank's shard*.
* ``param_range``: elements within one flattened parameter.

[Note: alignment, padding and shards]
Parameters are laid out one after another, each starting at a multiple of ``alignment``
elements (8 by default, so every parameter view is 16/32-byte aligned for vector units and
tensor cores). The buffer is padded at the end to a multiple of ``world_size * alignment``
elements, so it splits into ``world_size`` equal, contiguous shards, each a multiple of
``alignment`` long. Shards ignore parameter boundaries: a shard may start or end inside a
parameter, hold only part of it, hold many small parameters, or hold only padding. Padding
elements are zero, receive zero gradients and therefore stay zero under AdamW.

Buckets are consecutive runs of whole parameters (a bucket never splits a parameter) used to
batch gradient reductions; they tile the buffer exactly, the last one absorbing the final
padding. A bucket is cut from the shards independently, so each rank owns a possibly empty
piece of each bucket.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

DEFAULT_ALIGNMENT = 8


@dataclass(frozen=True)
class Range:
    """Half-open element range ``[start, end)``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise AssertionError(f"a range must have 0 <= start <= end, got Range({self.start}, {self.end})")

    @property
    def size(self) -> int:
        return self.end - self.start

    def intersect(self, other: Range) -> Range:
        """The overlap with ``other``; an empty range placed at a clamped position if none."""
        start = max(self.start, other.start)
        end = min(self.end, other.end)
        return Range(start, max(start, end)) if start <= end else Range(start, start)

    def relative_to(self, origin: int) -> Range:
        """This range expressed relative to ``origin`` (e.g. global -> local)."""
        return Range(self.start - origin, self.end - origin)

    def as_slice(self) -> slice:
        return slice(self.start, self.end)


@dataclass(frozen=True)
class ParamSpan:
    """Where one parameter lives in the flat buffer."""

    index: int  # position in the sequence given to ``build_layout``
    shape: tuple[int, ...]
    global_range: Range  # the parameter's own elements, without alignment padding

    @property
    def numel(self) -> int:
        return self.global_range.size


@dataclass(frozen=True)
class Bucket:
    """A run of whole parameters reduced together."""

    index: int
    global_range: Range  # covers its parameters and any padding up to the next bucket
    params: tuple[int, ...]  # indices into ``FlatLayout.params``


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that one rank owns."""

    param: int  # index into ``FlatLayout.params``
    param_range: Range  # within the flattened parameter
    global_range: Range
    local_range: Range  # within the owning rank's shard


@dataclass(frozen=True)
class FlatLayout:
    """Placement of a list of parameters in one flat buffer split over ``world_size`` ranks."""

    params: tuple[ParamSpan, ...]
    buckets: tuple[Bucket, ...]
    numel: int  # padded total, a multiple of world_size * alignment
    world_size: int
    alignment: int

    @property
    def shard_numel(self) -> int:
        """Elements in every rank's shard (all shards are equal)."""
        return self.numel // self.world_size

    @property
    def param_numel(self) -> int:
        """Elements that belong to parameters (the buffer minus padding)."""
        return sum(p.numel for p in self.params)

    def shard_range(self, rank: int) -> Range:
        """Global range of ``rank``'s shard."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank out of range: {rank=} {self.world_size=}")
        return Range(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def shard_pieces(self, rank: int) -> list[ShardPiece]:
        """The pieces of parameters that fall into ``rank``'s shard, in buffer order."""
        shard = self.shard_range(rank)
        pieces = []
        for i, span in enumerate(self.params):
            overlap = span.global_range.intersect(shard)
            if overlap.size == 0:
                continue
            pieces.append(
                ShardPiece(
                    param=i,
                    param_range=overlap.relative_to(span.global_range.start),
                    global_range=overlap,
                    local_range=overlap.relative_to(shard.start),
                )
            )
        return pieces

    def local_ranges(self, rank: int) -> dict[int, Range]:
        """Parameter index -> the local range of its piece in ``rank``'s shard, for the parameters
        that have one."""
        return {piece.param: piece.local_range for piece in self.shard_pieces(rank)}

    def param_runs(self, indices: Sequence[int]) -> list[Range]:
        """Global ranges covering the parameters ``indices``, one per run of consecutive indices
        (alignment padding between them included)."""
        runs: list[Range] = []
        last = None
        for i in sorted(set(indices)):
            r = self.params[i].global_range
            if runs and last == i - 1:
                runs[-1] = Range(runs[-1].start, r.end)
            else:
                runs.append(r)
            last = i
        return runs

    def bucket_shard_ranges(self, bucket: int) -> list[Range]:
        """For each rank, the global range of ``bucket`` that rank owns (possibly empty)."""
        b = self.buckets[bucket].global_range
        return [b.intersect(self.shard_range(r)) for r in range(self.world_size)]

    def bucket_pieces(self, bucket: int) -> list[Range]:
        """For each rank, its piece of ``bucket`` relative to the bucket start (empty: ``Range(0, 0)``):
        how a bucket's reduction is cut."""
        start = self.buckets[bucket].global_range.start
        return [r.relative_to(start) if r.size else Range(0, 0) for r in self.bucket_shard_ranges(bucket)]

    def bucket_local_ranges(self, rank: int) -> list[Range]:
        """For each bucket, ``rank``'s piece of it relative to that rank's shard start (empty:
        ``Range(0, 0)``); the buckets tile the shard."""
        start = self.shard_range(rank).start
        return [r.relative_to(start) if r.size else Range(0, 0)
                for r in (self.bucket_shard_ranges(b.index)[rank] for b in self.buckets)]

    def segments(self, rank: int, keys: Sequence[Hashable]) -> list[tuple[Hashable, Range]]:
        """Split ``rank``'s shard into maximal local ranges whose parameters share a key.

        ``keys[i]`` is the key (e.g. the param-group index) of parameter ``i``; ``None`` leaves the
        parameter out. Without ``None`` keys the returned ranges tile the whole shard, padding
        included, so one kernel call per segment covers every element once; a left-out parameter's
        run (and the padding after it) is omitted. An all-padding shard yields one segment keyed
        ``keys[0]``.
        """
        pieces = self.shard_pieces(rank)
        if not pieces:
            key = keys[0] if keys else None
            return [(key, Range(0, self.shard_numel))] if self.shard_numel and (key is not None or not keys) else []
        out: list[tuple[Hashable, Range]] = []
        start, key = 0, keys[pieces[0].param]
        for piece in pieces[1:]:
            k = keys[piece.param]
            if k != key:
                if key is not None:
                    out.append((key, Range(start, piece.local_range.start)))
                start, key = piece.local_range.start, k
        if key is not None:
            out.append((key, Range(start, self.shard_numel)))
        return out


def receive_chunks(pieces: Sequence[Range]) -> list[list[Range]]:
    """Split a reduction whose ranks own ``pieces`` (each rank's range relative to the bucket
    start, in rank order, tiling it; an empty piece may sit anywhere) into consecutive chunks in which no rank owns more than
    ``ceil(bucket / world_size)`` elements.

    Each chunk is a list of per-rank ranges relative to the bucket start, tiling one contiguous
    run of it. An all-to-all reduction receives ``world_size`` copies of a rank's piece, so per
    chunk a rank receives at most about one bucket (``world_size * ceil(bucket / world_size)``
    elements) whatever the world size: one chunk when the bucket spans every shard evenly,
    ``world_size`` chunks when one rank owns all of it."""
    owned = [r for r in pieces if r.size]
    if not owned:
        return []
    start, end = owned[0].start, owned[-1].end
    limit = max(1, -(-(end - start) // len(pieces)))
    chunks: list[list[Range]] = []
    while start < end:
        chunk, pos, open_ = [], start, True
        for r in pieces:
            if open_ and r.start <= pos < r.end:
                take = min(r.end, pos + limit)
                chunk.append(Range(pos, take))
                pos, open_ = take, take == r.end  # a piece cut short ends the chunk
            else:
                chunk.append(Range(pos, pos))  # nothing of this rank's in this chunk
        chunks.append(chunk)
        start = pos
    return chunks


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_layout(
    shapes: Sequence[Sequence[int]],
    world_size: int,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    bucket_numel: int | None = None,
    starts: Sequence[int] | None = None,
    numel: int | None = None,
) -> FlatLayout:
    """Lay out parameters of the given shapes, in the given order, in one flat buffer.

    ``bucket_numel`` caps a bucket's size in elements (a larger parameter gets a bucket of its
    own); ``None`` puts everything into one bucket. ``starts`` (elements, increasing, each a
    multiple of ``alignment``) and ``numel`` (a multiple of ``world_size * alignment``) place the
    parameters and size the buffer explicitly, e.g. so that each parameter lies whole in one rank's
    shard (see _muon_packing); by default parameters are packed back to back. Valid on any rank;
    no communication.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size=}")
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment=}")
    if bucket_numel is not None and bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1 or None, got {bucket_numel=}")

    spans: list[ParamSpan] = []
    offset = 0
    for i, shape in enumerate(shapes):
        shape = tuple(int(s) for s in shape)
        size = 1
        for s in shape:
            size *= s
        start = _round_up(offset, alignment) if starts is None else int(starts[i])
        if start < offset or start % alignment:
            raise ValueError(f"parameter {i} placed at element {start}: starts must increase without overlap and be "
                             f"multiples of the alignment ({alignment})")
        spans.append(ParamSpan(index=i, shape=shape, global_range=Range(start, start + size)))
        offset = start + size
    total = max(_round_up(offset, world_size * alignment), 0)
    if numel is not None:
        if numel < offset or numel % (world_size * alignment):
            raise ValueError(f"numel={numel} must cover the parameters ({offset} elements) and be a multiple of "
                             f"world_size * alignment ({world_size * alignment})")
        total = numel

    buckets: list[Bucket] = []
    members: list[int] = []
    bucket_start = 0
    for i, span in enumerate(spans):
        if members and bucket_numel is not None and span.global_range.end - bucket_start > bucket_numel:
            buckets.append(Bucket(len(buckets), Range(bucket_start, span.global_range.start), tuple(members)))
            bucket_start, members = span.global_range.start, []
        members.append(i)
    if members or total > bucket_start:
        buckets.append(Bucket(len(buckets), Range(bucket_start, total), tuple(members)))
    return FlatLayout(
        params=tuple(spans), buckets=tuple(buckets), numel=total, world_size=world_size, alignment=alignment
    )
