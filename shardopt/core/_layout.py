"""Partition math for the flat buffers: pure functions over small frozen dataclasses.

This module owns every index computation of shardopt and knows nothing of torch.distributed.

[Note: the four ranges]
Four kinds of element ranges appear in ZeRO bookkeeping and must never be confused:

* ``global_range``: elements of the whole flat buffer (what every rank holds for parameters).
* ``bucket_range``: elements relative to the start of one communication bucket.
* ``local_range``: elements relative to the start of *this rank's shard*.
* ``param_range``: elements within one flattened parameter.

A fifth, ``logical`` offsets, names elements independently of the world size (see [Note: logical
offsets]); it is never used to index a tensor.

[Note: alignment, padding and shards]
Parameters are laid out one after another, each starting at a multiple of ``alignment``
elements (8 by default, so every parameter view is 16/32-byte aligned for vector units and
tensor cores). Buckets are consecutive runs of whole parameters (a bucket never splits a
parameter) used to batch gradient reductions and weight gathers; they tile the buffer. Each
bucket is padded at its end to a multiple of ``world_size * alignment`` elements and split into
``world_size`` equal, contiguous pieces, one per rank in rank order, each a multiple of
``alignment`` long:

    bucket b = [piece of rank 0 | piece of rank 1 | ... | piece of rank N-1]

so a bucket's reduction is one ``reduce_scatter_tensor`` and its gather one
``all_gather_into_tensor``, the collectives NCCL runs natively (Megatron-LM pads its buckets the
same way). A rank's *shard* is its pieces of every bucket, in bucket order: every rank's shard has
``shard_numel`` elements, and its local coordinates (the master weights', the moments', the
stage-2 gradient shard's) run through its pieces one bucket after another; bucket ``b``'s piece
sits at ``[b.local_start, b.local_start + b.piece_numel)`` of every rank's shard. In the flat
buffer a shard is therefore not one range but one range per bucket (``shard_runs``). A piece may
start or end inside a parameter, hold only part of it, hold many small parameters, or hold only
padding. Padding elements are zero, receive zero gradients and therefore stay zero under AdamW.

[Note: logical offsets]
Where an element sits in the flat buffer depends on the world size (the bucket padding), but
what an element's random bits are keyed by (stochastic rounding) must not, or a run would round
differently on another number of ranks. Each element therefore also has a *logical* offset: its
offset in the same layout built for one rank (buckets cut at the same parameters, padded to
``alignment`` only). Within a bucket the two differ by a constant (``Bucket.logical_start``); the
extra padding at a bucket's end gets the logical offsets that follow, which its zeros never use
(a zero rounds to zero whatever its bits).
"""
from __future__ import annotations

import bisect
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

    def shifted(self, by: int) -> Range:
        """This range moved by ``by`` elements (e.g. piece -> local)."""
        return Range(self.start + by, self.end + by)

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
    """A run of whole parameters reduced and gathered together, in equal per-rank pieces."""

    index: int
    global_range: Range  # its parameters and its padding: world_size * piece_numel elements
    params: tuple[int, ...]  # indices into ``FlatLayout.params``
    piece_numel: int = 0  # elements of each rank's piece (a multiple of the alignment)
    local_start: int = 0  # where every rank's piece starts in that rank's shard
    logical_start: int = 0  # the logical offset of its first element (see [Note: logical offsets])

    def piece(self, rank: int) -> Range:
        """Global range of ``rank``'s piece."""
        start = self.global_range.start + rank * self.piece_numel
        return Range(start, start + self.piece_numel)

    @property
    def local(self) -> Range:
        """Every rank's piece of it, in that rank's shard (local coordinates)."""
        return Range(self.local_start, self.local_start + self.piece_numel)


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
    numel: int  # padded total: the buckets' sizes, each a multiple of world_size * alignment
    world_size: int
    alignment: int

    @property
    def shard_numel(self) -> int:
        """Elements in every rank's shard (all shards are equal): its pieces of every bucket."""
        return self.numel // self.world_size

    @property
    def param_numel(self) -> int:
        """Elements that belong to parameters (the buffer minus padding)."""
        return sum(p.numel for p in self.params)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank out of range: {rank=} {self.world_size=}")

    def shard_runs(self, rank: int) -> list[tuple[Range, Range]]:
        """``rank``'s shard in the flat buffer: (local range, global range) of its piece of each
        bucket, in bucket order, empty pieces left out. The local ranges tile ``[0, shard_numel)``."""
        self._check_rank(rank)
        return [(b.local, b.piece(rank)) for b in self.buckets if b.piece_numel]

    def bucket_at(self, local: int) -> Bucket:
        """The bucket whose piece holds local element ``local`` of every shard."""
        return self.buckets[max(0, bisect.bisect_right(self.buckets, local, key=lambda b: b.local_start) - 1)]

    def to_global(self, rank: int, local: Range) -> Range:
        """Global range of ``rank``'s local range ``local``, which lies in one bucket's piece."""
        b = self.bucket_at(local.start)
        if local.end > b.local.end:
            raise AssertionError(f"local range {local} spans the pieces of buckets {b.index} and {b.index + 1}")
        return local.shifted(b.piece(rank).start - b.local_start)

    def logical_offset(self, rank: int, local: int) -> int:
        """The logical offset of ``rank``'s local element ``local`` (see [Note: logical offsets])."""
        b = self.bucket_at(local)
        return b.logical_start + rank * b.piece_numel + local - b.local_start

    def shard_pieces(self, rank: int) -> list[ShardPiece]:
        """The pieces of parameters that fall into ``rank``'s shard, in shard (and buffer) order."""
        self._check_rank(rank)
        pieces = []
        for b in self.buckets:
            piece = b.piece(rank)
            for i in b.params:
                span = self.params[i]
                overlap = span.global_range.intersect(piece)
                if overlap.size == 0:
                    continue
                pieces.append(
                    ShardPiece(
                        param=i,
                        param_range=overlap.relative_to(span.global_range.start),
                        global_range=overlap,
                        local_range=overlap.relative_to(piece.start).shifted(b.local_start),
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
        """For each rank, the global range of its piece of ``bucket`` (all the same size)."""
        b = self.buckets[bucket]
        return [b.piece(r) for r in range(self.world_size)]

    def bucket_pieces(self, bucket: int) -> list[Range]:
        """For each rank, its piece of ``bucket`` relative to the bucket start: how a bucket's
        reduction is cut (equal, in rank order)."""
        p = self.buckets[bucket].piece_numel
        return [Range(r * p, (r + 1) * p) for r in range(self.world_size)]

    def bucket_local_ranges(self, rank: int) -> list[Range]:
        """For each bucket, ``rank``'s piece of it relative to that rank's shard start (the same
        on every rank); the buckets tile the shard."""
        self._check_rank(rank)
        return [b.local for b in self.buckets]

    def segments(self, rank: int, keys: Sequence[Hashable]) -> list[tuple[Hashable, Range]]:
        """Split ``rank``'s shard into maximal local ranges whose parameters share a key.

        ``keys[i]`` is the key (e.g. the param-group index) of parameter ``i``; ``None`` leaves the
        parameter out. Without ``None`` keys the returned ranges tile the whole shard, padding
        included (padding goes with the parameter before it, or at a shard's start with the one after it), so one kernel call per segment covers every element once; a left-out parameter's
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


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _numel(shape: Sequence[int]) -> int:
    size = 1
    for s in shape:
        size *= int(s)
    return size


def bucket_cuts(shapes: Sequence[Sequence[int]], *, alignment: int = DEFAULT_ALIGNMENT,
                bucket_numel: int | None = None) -> list[list[int]]:
    """The parameters of each bucket (indices, in order): consecutive runs whose aligned elements,
    packed back to back, stay within ``bucket_numel`` (a larger parameter gets a bucket of its
    own; ``None``: one bucket). The same at every world size."""
    if bucket_numel is not None and bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1 or None, got {bucket_numel=}")
    cuts: list[list[int]] = []
    size = 0  # elements of the open bucket, packed
    for i, shape in enumerate(shapes):
        end = _round_up(size, alignment) + _numel(shape)
        if not cuts or (bucket_numel is not None and cuts[-1] and end > bucket_numel):
            cuts.append([])
            end = _numel(shape)
        cuts[-1].append(i)
        size = end
    return cuts


def build_layout(
    shapes: Sequence[Sequence[int]],
    world_size: int,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    bucket_numel: int | None = None,
    pieces: Sequence[tuple[Sequence[int], int]] | None = None,
) -> FlatLayout:
    """Lay out parameters of the given shapes, in the given order, in one flat buffer of
    equal-pieced buckets (see [Note: alignment, padding and shards]).

    ``bucket_numel`` caps a bucket's parameters (elements, alignment gaps included; a larger
    parameter gets a bucket of its own); ``None`` puts everything into one bucket. ``pieces``
    places the parameters explicitly instead: one entry per bucket, (the start of each of its
    parameters relative to the bucket, each a multiple of ``alignment``, increasing; the bucket's
    piece size, a multiple of ``alignment``), the buckets taking the parameters in order, e.g. so
    that each parameter lies whole in one rank's piece (see _muon_packing). Valid on any rank; no
    communication.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size=}")
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment=}")
    numels = [_numel(s) for s in shapes]
    if pieces is None:
        placed: list[tuple[list[int], int]] = []
        for members in bucket_cuts(shapes, alignment=alignment, bucket_numel=bucket_numel):
            starts, at = [], 0
            for i in members:
                starts.append(_round_up(at, alignment))
                at = starts[-1] + numels[i]
            placed.append((starts, _round_up(at, world_size * alignment) // world_size))
        given = False
    else:
        placed = [(list(s), int(p)) for s, p in pieces]
        given = True
    if sum(len(s) for s, _ in placed) != len(numels):
        raise ValueError(f"pieces place {sum(len(s) for s, _ in placed)} parameters, there are {len(numels)}")

    spans: list[ParamSpan] = []
    buckets: list[Bucket] = []
    start = local = logical = 0
    for b, (starts, piece) in enumerate(placed):
        size = world_size * piece
        indices = tuple(range(len(spans), len(spans) + len(starts)))
        end_of_last = 0
        for i, at in zip(indices, starts):
            if at < end_of_last or at % alignment or piece % alignment:
                raise ValueError(f"parameter {i} placed at element {at} of bucket {b}: starts must increase "
                                 f"without overlap and, with the piece size ({piece}), be multiples of the "
                                 f"alignment ({alignment})")
            end_of_last = at + numels[i]
            spans.append(ParamSpan(index=i, shape=tuple(int(s) for s in shapes[i]),
                                   global_range=Range(start + at, start + at + numels[i])))
        if end_of_last > size:
            raise ValueError(f"bucket {b}'s parameters need {end_of_last} elements, more than {world_size} pieces "
                             f"of {piece}")
        buckets.append(Bucket(index=b, global_range=Range(start, start + size), params=indices, piece_numel=piece,
                              local_start=local, logical_start=start if given else logical))
        start, local = start + size, local + piece
        logical += _round_up(end_of_last, alignment)
    return FlatLayout(params=tuple(spans), buckets=tuple(buckets), numel=start, world_size=world_size,
                      alignment=alignment)
