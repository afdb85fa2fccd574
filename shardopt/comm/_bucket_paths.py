"""How a bucket is reduced and gathered: the two bucket paths, strategies a ``Comm`` holds.

[Note: the bucket paths]
A bucket is ``world_size`` equal pieces in rank order (see core._layout [Note: alignment, padding
and shards]). Its reduction and gather take one of two paths (``Comm.path``), on any backend:

* ``native`` (NCCL's default): one ``reduce_scatter_tensor`` (``ReduceOp.AVG``) into this rank's
  piece and one in-place ``all_gather_into_tensor``; stage 1 one ``all_reduce`` of the bucket in
  place. The collectives NCCL runs natively (and NVLink SHARP and in-network reduction
  accelerate). No receive buffer; the sum runs in the gradient dtype unless ``reduce_dtype`` asks
  for more, from a cast copy of the bucket (held until the reduction lands, in the caller's ``InFlight``).
* ``rank-order`` (gloo's default): two all-to-alls (to the ranks below, then to the ranks
  above) that send every rank the other ranks' copies of its piece (its own stays in the
  bucket: gloo's all-to-all takes no split that skips its own rank), a sum in rank order in fp32
  (fp64 for fp64 gradients; those two are summed in the reduction's output itself) and a
  division; the gather one broadcast per rank. The same bits whatever the bucket size and, with
  16-bit gradients, an fp32 sum at no cost on the wire (an fp16 sum of N gradients overflows N
  times earlier than each one). gloo's own reduce-scatter runs as a whole all-reduce (its profiler records say
  ``gloo:all_reduce``): 2x slower here (16 MB of fp32 on 2 ranks: 44 ms against 22 ms; its
  all-gather 24-32 ms against 10-12 ms for the broadcasts), and its summation order depends on the
  message size, so at three ranks or more the result would change with ``bucket_cap_mb``. Its price
  is receive buffers of ``(world_size - 1) / world_size`` of a bucket per reduction in flight, and
  two collectives per bucket.

``SHARDOPT_COLLECTIVES=native`` (or ``rank-order``) chooses either on any backend; the tests run
the native path on gloo too (``tests/test_collectives.py``), so the calls a GPU run makes are calls
CPU tests make. With two ranks the two paths give the same bits for fp32 and bf16 gradients (one
sum of two numbers, halved). Pieces that are not a bucket's (a checkpoint's gather of one
parameter, cut wherever the bucket's pieces fall) are gathered by one broadcast per rank that
holds part of them, on either path.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from shardopt.comm._pending import CommStats, Pending, Waiter, and_then
from shardopt.core._layout import Range

# what a failed collective's message names (Comm.collective_failed)
REDUCTION = "a bucket's gradient reduction"
GATHER = "a gather of the flat buffer (the weights, or stage 1's averaged gradients)"


class InFlight:
    """The bytes one caller's reductions in flight hold beside its buckets: receive buffers
    (rank-order), cast copies (native), a hybrid mesh's partial sums. Each gradient store keeps its
    own, so that its memory accounting counts its own collectives only, never those of another flat
    buffer sharing the same Comm."""

    def __init__(self) -> None:
        self.nbytes = 0  # bytes held now


class PathComm(Waiter, Protocol):
    """What a bucket path asks of its comm (``_collectives.Comm``), beside what its handles do."""

    shard_group: Any
    shard_size: int
    shard_rank: int
    _shard_global: list[int]
    hybrid: bool
    cross: Any  # how pieces cross the replicas (_replicas): its size() is the replicas a sum is divided by
    stats: CommStats

    def _count(self, works: list, *, reduced: int = 0, gathered: int = 0, crossed: int = 0) -> list: ...

    def _cross(self, t: Tensor, avg: bool, then: Callable[[], None] | None = None) -> Pending: ...


def equal_pieces(pieces: Sequence[Range]) -> bool:
    """Whether ``pieces`` are equal and follow each other (what the native collectives take)."""
    return all(p.size == pieces[0].size for p in pieces) and \
        all(pieces[r].end == pieces[r + 1].start for r in range(len(pieces) - 1))


# torch 2.13 renamed the native collectives (the old names warn); torch 2.9 has only the old ones
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class NativePath:
    """A bucket's reduction as one ``reduce_scatter_tensor`` (``ReduceOp.AVG``) in ``out``'s dtype
    (from a cast copy of the bucket when that is not the bucket's), its gather as one
    ``all_gather_into_tensor``, stage 1's as one ``all_reduce``: what NCCL runs natively (see
    [Note: the bucket paths])."""

    name = "native"
    whole_all_reduce = True  # stage 1: one all-reduce of the bucket in place (two passes on the wire)

    def __init__(self, comm: PathComm) -> None:
        self.comm = comm

    def all_reduce_parts(self, bucket: Tensor, pieces: Sequence[Range], sum_dtype: torch.dtype | None,
                         held: InFlight) -> list[Callable[[], Pending]]:
        """``bucket`` averaged in place: one all-reduce (``ReduceOp.AVG``), unless ``sum_dtype`` is
        not the bucket's or the sharding is hybrid; see ``Comm.all_reduce_parts``."""
        c = self.comm
        if sum_dtype not in (None, bucket.dtype) or c.hybrid:
            return self._reduce_then_gather(bucket, pieces, sum_dtype, held)

        def whole() -> Pending:
            work = dist.all_reduce(bucket, op=dist.ReduceOp.AVG, group=c.shard_group, async_op=True)
            return Pending(c._count([work], reduced=bucket.nbytes), keep_alive=[bucket], stats=c.stats, comm=c,
                           what=REDUCTION)
        return [whole]

    def _reduce_then_gather(self, bucket: Tensor, pieces: Sequence[Range], sum_dtype: torch.dtype | None,
                            held: InFlight) -> list[Callable[[], Pending]]:
        """``bucket`` averaged in place as its reduce-scatter (summed in ``sum_dtype``) followed,
        once the last part is waited, by the gather of the averaged pieces."""
        own = bucket[pieces[self.comm.shard_rank].as_slice()]
        out = own if sum_dtype in (None, bucket.dtype) else torch.empty_like(own, dtype=sum_dtype)
        parts = self.reduce_scatter_parts(out, bucket, pieces, held)
        issue_last = parts[-1]

        def reduce_then_gather() -> Pending:
            reduced = issue_last()

            def gather() -> Pending:
                if out is not own:
                    own.copy_(out)
                return self.gather(bucket, pieces)

            return and_then(reduced, gather)

        return parts[:-1] + [reduce_then_gather]

    def gather(self, flat: Tensor, pieces: Sequence[Range]) -> Pending:
        """Every rank's piece into ``flat``, in place: equal pieces (a bucket's) by one in-place
        ``all_gather_into_tensor``, others by broadcasts; see ``Comm.all_gather_inplace``."""
        c = self.comm
        if not equal_pieces(pieces):
            return self._broadcasts(flat, pieces)
        whole = flat[pieces[0].start:pieces[-1].end]
        work = _all_gather_into_tensor(whole, flat[pieces[c.shard_rank].as_slice()], group=c.shard_group,
                                       async_op=True)
        return Pending(c._count([work], gathered=whole.nbytes), keep_alive=[flat], stats=c.stats, comm=c, what=GATHER)

    def _broadcasts(self, flat: Tensor, pieces: Sequence[Range]) -> Pending:
        """One broadcast per rank that holds part of ``pieces``, into its piece of ``flat``."""
        c = self.comm
        works = [dist.broadcast(flat[p.as_slice()], src=c._shard_global[r], group=c.shard_group, async_op=True)
                 for r, p in enumerate(pieces) if p.size > 0]
        gathered = sum(p.size for p in pieces) * flat.element_size()
        return Pending(c._count(works, gathered=gathered), keep_alive=[flat], stats=c.stats, comm=c, what=GATHER)

    def reduce_scatter_parts(self, out: Tensor, bucket: Tensor, pieces: Sequence[Range],
                             held: InFlight) -> list[Callable[[], Pending]]:
        """This rank's piece of ``bucket``'s average into ``out``, as the collectives to issue in
        order; see ``Comm.reduce_scatter_parts``."""
        return [lambda: self.reduce_scatter(out, bucket, pieces, held)]

    def reduce_scatter(self, out: Tensor, bucket: Tensor, pieces: Sequence[Range], held: InFlight) -> Pending:
        """The one ``reduce_scatter_tensor`` of ``bucket`` into ``out``."""
        c = self.comm
        src = bucket if out.dtype == bucket.dtype else bucket.to(out.dtype)
        copied = src.nbytes if src is not bucket else 0
        held.nbytes += copied
        work = _reduce_scatter_tensor(out, src, op=dist.ReduceOp.AVG, group=c.shard_group, async_op=True)

        def landed() -> Pending | None:
            held.nbytes -= copied
            return c._cross(out, avg=True) if c.hybrid else None

        return Pending(c._count([work], reduced=src.nbytes), keep_alive=[src, out], stats=c.stats, then=landed,
                       comm=c, what=REDUCTION)


class RankOrderPath(NativePath):
    """A bucket's reduction as two all-to-alls that send every rank the other ranks' copies of its
    piece, then a sum in rank order in fp32 (fp64 for fp64 gradients) and a division: the same bits
    whatever the bucketing, 16-bit gradients summed in fp32; its gather as one broadcast per rank
    (see [Note: the bucket paths]). gloo's default."""

    name = "rank-order"
    whole_all_reduce = False  # stage 1: this reduce-scatter, then the gather of the pieces

    def all_reduce_parts(self, bucket: Tensor, pieces: Sequence[Range], sum_dtype: torch.dtype | None,
                         held: InFlight) -> list[Callable[[], Pending]]:
        return self._reduce_then_gather(bucket, pieces, sum_dtype, held)

    def gather(self, flat: Tensor, pieces: Sequence[Range]) -> Pending:
        return self._broadcasts(flat, pieces)

    def reduce_scatter_parts(self, out: Tensor, bucket: Tensor, pieces: Sequence[Range],
                             held: InFlight) -> list[Callable[[], Pending]]:
        """Two all-to-alls: the first sends each rank below this one its piece and receives this
        rank's piece from the ranks above, the second the other way; a rank's own piece stays in
        the bucket, so it receives ``world_size - 1`` pieces, not ``world_size`` (gloo's all-to-all
        takes no piece that skips its own rank: its input is one run). Once the second lands, the
        pieces are summed in rank order and averaged."""
        c = self.comm
        n, me, mine = c.shard_size, c.shard_rank, pieces[c.shard_rank]
        size = mine.size
        above = torch.empty((n - 1 - me) * size, dtype=bucket.dtype, device=bucket.device)  # from ranks above
        below = torch.empty(me * size, dtype=bucket.dtype, device=bucket.device)  # from ranks below

        def down() -> Pending:  # to the ranks below, from the ranks above
            held.nbytes += above.nbytes
            work = dist.all_to_all_single(above, bucket[:mine.start],
                                          output_split_sizes=[size if q > me else 0 for q in range(n)],
                                          input_split_sizes=[size if q < me else 0 for q in range(n)],
                                          group=c.shard_group, async_op=True)
            return Pending(c._count([work]), keep_alive=[bucket, above],
                           stats=c.stats, comm=c, what=REDUCTION)

        def up() -> Pending:  # to the ranks above, from the ranks below
            held.nbytes += below.nbytes
            work = dist.all_to_all_single(below, bucket[mine.end:],
                                          output_split_sizes=[size if q < me else 0 for q in range(n)],
                                          input_split_sizes=[size if q > me else 0 for q in range(n)],
                                          group=c.shard_group, async_op=True)
            return Pending(c._count([work], reduced=bucket.nbytes),  # the bucket's reduction, counted once
                           keep_alive=[bucket, below, out], stats=c.stats, then=finish, comm=c, what=REDUCTION)

        def finish() -> Pending | None:
            held.nbytes -= above.nbytes + below.nbytes
            if not size and not c.hybrid:
                return None  # hybrid: an empty piece still gets its (empty) follow-up, see _cross
            parts = [below[q * size:(q + 1) * size] if q < me else bucket[mine.as_slice()] if q == me
                     else above[(q - me - 1) * size:(q - me) * size] for q in range(n)]
            wide = torch.float64 if out.dtype == torch.float64 else torch.float32
            # fp32 (fp64) gradients are summed in ``out`` itself, the same additions in the same order,
            # unless ``out`` is this rank's own piece (stage 1) and that is still to be added
            if not c.hybrid and bucket.dtype == out.dtype == wide and \
                    (me < 2 or out.data_ptr() != parts[me].data_ptr()):
                acc, first = out, 2
                if n > 1:
                    torch.add(parts[0], parts[1], out=acc)
                else:
                    acc.copy_(parts[0])
            else:  # 16-bit gradients: widened first
                acc, first = parts[0].to(wide, copy=True), 1
            for q in range(first, n):  # rank order: the result does not depend on the bucketing
                acc.add_(parts[q])
            if not c.hybrid:
                acc.div_(n)
                if acc is not out:
                    out.copy_(acc)
                return None
            held.nbytes += acc.nbytes  # the fp32 partial sum, until the other replicas' are added

            def land() -> None:
                held.nbytes -= acc.nbytes
                out.copy_(acc.div_(n * c.cross.size()))

            return c._cross(acc, avg=False, then=land)

        return [down, up]


PATHS = {path.name: path for path in (NativePath, RankOrderPath)}


def bucket_path(backend: str) -> type[NativePath]:
    """The bucket path for ``backend``: ``SHARDOPT_COLLECTIVES`` (``native`` or ``rank-order``)
    when set, else ``native`` on NCCL and ``rank-order`` on gloo (see [Note: the bucket
    paths]). Local."""
    chosen = os.environ.get("SHARDOPT_COLLECTIVES", "").strip()
    if chosen and chosen not in PATHS:
        raise ValueError(f"SHARDOPT_COLLECTIVES={chosen!r}: use one of {sorted(PATHS)}, or unset it for the "
                         f"backend's default (native on NCCL, rank-order on gloo)")
    return PATHS[chosen or ("native" if backend == "nccl" else "rank-order")]
