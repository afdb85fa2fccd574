"""Whole-matrix ownership for a sharded Muon: pure packing math, no torch.distributed.

Muon orthogonalizes each weight matrix as a whole, so a sharded Muon cannot cut matrices at
arbitrary shard boundaries as the AdamW layout does (``_layout.py``). Instead every matrix is
owned by exactly one rank of the shard group, and the flat gradient buffer is ordered so that a
reduce-scatter of ``world_size`` equal chunks delivers each matrix whole to its owner (shown here
for one bucket; ``owned_layout`` cuts the chunks into buckets, see [Note: Muon's buckets]):

    buffer = [chunk of rank 0 | chunk of rank 1 | ... | chunk of rank N-1]   (N * chunk_numel)

A rank's chunk holds its matrices back to back in their given order, each starting at a multiple
of ``alignment`` elements (8, as in ``_layout.py``); the chunk is padded at its end to
``chunk_numel``, the largest rank's total rounded up to ``alignment``. All counts are elements.

[Note: balance]
The owner's work is the Newton-Schulz iteration, whose products of an (m, n) matrix cost a
multiple of ``m * n * min(m, n)`` multiply-adds (``X X^T`` alone is exactly that). Matrices are
placed by longest-processing-time greedy on that cost: largest first, each on the rank with the
least cost so far. Ties (common: a model's layers repeat the same shapes) go to the rank holding
the fewest elements, because the largest rank's elements set the chunk and so the padding every
rank holds. Matrices of equal cost are taken larger first, then in their given order. No
randomness and only integer arithmetic: every rank computes the same packing from the same shapes.

Greedy list scheduling bounds the result (Graham): the rank with the most cost received its last
matrix ``j`` when it had the least, at most the mean of the others, so
``max cost <= mean cost + (1 - 1/N) * cost_j``.

[Note: owners of tensor-parallel pieces]
A matrix split over tensor-parallel ranks (a DTensor with a Shard placement) is orthogonalised
whole: its owner at each tensor-parallel position gathers the pieces from the owners at the
others (see _muon_tp). So the owners must be the same data-parallel rank at every position, and
the placement reads the *whole* matrix's shape (``whole_shapes``), alike everywhere, never the
piece's: an uneven split (``torch.chunk`` of 15 rows over 2 ranks gives 8 and 7) gives the
positions different pieces, whose costs would order the matrices differently and pair one
position's gather with another matrix, or with none, at the next. The whole matrix's cost is also
the owner's work. Only where the piece lies in its owner's chunk (offsets, chunk and bucket
sizes) follows the piece's own elements. A piece may be empty (4 rows over 3 ranks: 2, 2, 0): it
takes no elements, and its owner still gathers and orthogonalises the whole matrix with the
others (see _muon_tp).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from shardopt.core._layout import DEFAULT_ALIGNMENT, FlatLayout, Range, _round_up, build_layout

__all__ = ["MuonPacking", "ns_cost", "pack_matrices"]


def ns_cost(shape: tuple[int, int]) -> int:
    """The balance weight of an (m, n) matrix: ``m * n * min(m, n)`` multiply-adds, the Gram
    product of one Newton-Schulz iteration (each iteration costs a small multiple of it)."""
    m, n = shape
    return m * n * min(m, n)


@dataclass(frozen=True)
class MuonPacking:
    """Which rank owns each matrix and where it sits in that rank's chunk; all sizes in elements."""

    shapes: tuple[tuple[int, int], ...]
    world_size: int
    alignment: int
    owner: tuple[int, ...]  # rank owning matrix i
    offset: tuple[int, ...]  # start of matrix i within its owner's chunk, a multiple of alignment
    chunk_numel: int  # elements of every rank's chunk, a multiple of alignment
    padding_numel: int  # world_size * chunk_numel minus the matrices' elements (alignment gaps included)
    ns_cost: tuple[int, ...]  # per rank: the sum of ns_cost() of its matrices (a piece's: its whole's), multiply-adds

    @property
    def numel(self) -> int:
        """Elements of all matrices, without padding."""
        return sum(m * n for m, n in self.shapes)

    @property
    def buffer_numel(self) -> int:
        """Elements of the whole reduce-scatter input: ``world_size * chunk_numel``."""
        return self.world_size * self.chunk_numel

    @property
    def padding_fraction(self) -> float:
        """Padding per matrix element (0.05: the buffer is 5% larger than the matrices)."""
        return self.padding_numel / self.numel if self.numel else 0.0

    @property
    def imbalance(self) -> float:
        """Largest rank's Newton-Schulz cost over the mean (1.0: perfectly even)."""
        total = sum(self.ns_cost)
        return max(self.ns_cost) * self.world_size / total if total else 1.0

    @property
    def idle_ranks(self) -> tuple[int, ...]:
        """Ranks that own no matrix (there are more ranks than matrices): their chunk is padding."""
        owners = set(self.owner)
        return tuple(r for r in range(self.world_size) if r not in owners)

    def rank_matrices(self, rank: int) -> tuple[int, ...]:
        """Indices of the matrices ``rank`` owns, in chunk order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank out of range: {rank=} {self.world_size=}")
        return tuple(i for i, r in enumerate(self.owner) if r == rank)

    def matrix_range(self, i: int) -> Range:
        """Elements of matrix ``i`` in the whole buffer (``owner * chunk_numel + offset``)."""
        start = self.owner[i] * self.chunk_numel + self.offset[i]
        m, n = self.shapes[i]
        return Range(start, start + m * n)


def _matrices(shapes: Sequence[Sequence[int]], least: int = 1) -> list[tuple[int, int]]:
    """``shapes`` as (m, n) pairs, each size an int of at least ``least`` (0: a tensor-parallel
    piece, which an uneven split may leave empty, see [Note: owners of tensor-parallel pieces])."""
    dims: list[tuple[int, int]] = []
    for i, shape in enumerate(shapes):
        shape = tuple(shape)
        if len(shape) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= least for s in shape):
            raise ValueError(f"matrix {i}: Muon packs 2-D matrices whose sizes are integers of at least {least}, "
                             f"got shape {shape}")
        dims.append((shape[0], shape[1]))
    return dims


def pack_matrices(shapes: Sequence[Sequence[int]], world_size: int, *, alignment: int = DEFAULT_ALIGNMENT,
                  whole_shapes: Sequence[Sequence[int]] | None = None) -> MuonPacking:
    """Assign each (m, n) matrix to one of ``world_size`` ranks; see [Note: balance].
    ``whole_shapes[i]``: the whole matrix ``shapes[i]`` is a tensor-parallel piece of, which places
    it (see [Note: owners of tensor-parallel pieces]); default ``shapes``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size=}")
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment=}")
    dims = _matrices(shapes, least=1 if whole_shapes is None else 0)
    wholes = dims if whole_shapes is None else _matrices(whole_shapes)
    if len(wholes) != len(dims):
        raise ValueError(f"whole_shapes names {len(wholes)} matrices for {len(dims)} pieces")

    costs = [ns_cost(s) for s in wholes]
    sizes = [_round_up(m * n, alignment) for m, n in wholes]  # the whole matrices' elements: the placement's ties
    footprints = [_round_up(m * n, alignment) for m, n in dims]  # elements up to the next aligned start
    rank_cost, rank_elems = [0] * world_size, [0] * world_size
    owner = [0] * len(dims)
    for i in sorted(range(len(dims)), key=lambda i: (-costs[i], -sizes[i], i)):
        r = min(range(world_size), key=lambda r: (rank_cost[r], rank_elems[r], r))
        owner[i] = r
        rank_cost[r] += costs[i]
        rank_elems[r] += sizes[i]

    offset, fill = [0] * len(dims), [0] * world_size
    for i, r in enumerate(owner):  # each chunk in the matrices' given order
        offset[i], fill[r] = fill[r], fill[r] + footprints[i]
    chunk = max(fill)  # a sum of multiples of alignment
    return MuonPacking(shapes=tuple(dims), world_size=world_size, alignment=alignment, owner=tuple(owner),
                       offset=tuple(offset), chunk_numel=chunk,
                       padding_numel=world_size * chunk - sum(m * n for m, n in dims), ns_cost=tuple(rank_cost))


def owned_layout(shapes: Sequence[Sequence[int]], world_size: int, *, alignment: int = DEFAULT_ALIGNMENT,
                 bucket_numel: int | None = None,
                 whole_shapes: Sequence[Sequence[int]] | None = None) -> tuple[FlatLayout, MuonPacking, list[int]]:
    """The flat buffer ShardedMuon lays its matrices out in: every matrix whole in its owner's
    piece of one bucket (see [Note: Muon's buckets]). Returns (layout, packing, order): ``order[k]``
    is the index in ``shapes`` of the layout's ``k``-th parameter (bucket by bucket, each bucket's
    matrices by owner, then chunk offset), and ``packing`` is indexed in that buffer order, its
    ``padding_numel`` the layout's. ``whole_shapes``: as ``pack_matrices``'s, the whole matrices
    that place tensor-parallel pieces (the owners then agree at every tensor-parallel position;
    see [Note: owners of tensor-parallel pieces]). Valid on any rank; no communication.

    [Note: Muon's buckets]
    A bucket is ``world_size`` equal pieces, one per rank (see core._layout); a reduce-scatter
    hands each rank its piece. So a bucket takes, from each rank's matrices in chunk order, the next
    ones that fit in ``bucket_numel / world_size`` elements (at least one while any is left), and
    its piece size is the fullest rank's. Owners stay the packing's (the balance is kept); a bucket
    where ranks fill unequally is padded up to the fullest, which ``padding_numel`` counts."""
    packing = pack_matrices(shapes, world_size, alignment=alignment, whole_shapes=whole_shapes)
    footprints = [_round_up(m * n, alignment) for m, n in packing.shapes]
    queues = [list(packing.rank_matrices(r)) for r in range(world_size)]
    cap = None if bucket_numel is None else max(1, bucket_numel // world_size)
    order: list[int] = []
    pieces: list[tuple[list[int], int]] = []
    while any(queues):
        taken: list[list[int]] = []
        fills: list[int] = []
        for q in queues:
            take: list[int] = []
            fill = 0
            while q and (not take or cap is None or fill + footprints[q[0]] <= cap):
                fill += footprints[q[0]]
                take.append(q.pop(0))
            taken.append(take)
            fills.append(fill)
        piece = max(fills)  # a sum of multiples of alignment
        starts = []
        for r, take in enumerate(taken):
            at = r * piece
            for i in take:
                order.append(i)
                starts.append(at)
                at += footprints[i]
        pieces.append((starts, piece))
    reordered: dict[str, Any] = {k: tuple(getattr(packing, k)[i] for i in order) for k in ("shapes", "owner", "offset")}
    layout = build_layout(reordered["shapes"], world_size, alignment=alignment, pieces=pieces)
    packing = dataclasses.replace(packing, **reordered, padding_numel=layout.numel - packing.numel)
    return layout, packing, order
