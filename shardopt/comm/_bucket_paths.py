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
  two collectives per bucket, issued together in one handle (``RankOrderReduction``, whose landing
  is ``sum_in_rank_order``); both count against ``_rounds.MAX_INFLIGHT``.

Either way a bucket's reduction is one handle (a ``BucketReduction``), waited once; what runs as
it lands is a named step of that object: the sum, the cross-replica follow-up of hybrid sharding,
stage 1's gather of the averaged pieces.

``SHARDOPT_COLLECTIVES=native`` (or ``rank-order``) chooses either on any backend; the tests run
the native path on gloo too (``tests/test_collectives.py``), so the calls a GPU run makes are calls
CPU tests make. With two ranks the two paths give the same bits for fp32 and bf16 gradients (one
sum of two numbers, halved). Pieces that are not a bucket's (a checkpoint's gather of one
parameter, cut wherever the bucket's pieces fall) are gathered by one broadcast per rank that
holds part of them, on either path.
"""
from __future__ import annotations

import abc
import os
from typing import Any, Callable, Protocol, Sequence, cast

import torch
import torch.distributed as dist
from torch import Tensor

from shardopt.comm._pending import CommStats, Pending, Waiter
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
    shard_global: list[int]
    hybrid: bool
    cross: Any  # how pieces cross the replicas (_replicas): its size() is the replicas a sum is divided by
    stats: CommStats

    def count(self, works: list, *, reduced: int = 0, gathered: int = 0, crossed: int = 0) -> list: ...

    def cross_replicas(self, t: Tensor, avg: bool, then: Callable[[], Pending | None] | None = None) -> Pending: ...


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

    def all_reduce(self, bucket: Tensor, pieces: Sequence[Range], sum_dtype: torch.dtype | None,
                   held: InFlight) -> Pending:
        """``bucket`` averaged in place: one all-reduce (``ReduceOp.AVG``), unless ``sum_dtype`` is
        not the bucket's or the sharding is hybrid; see ``Comm.all_reduce``."""
        c = self.comm
        if sum_dtype not in (None, bucket.dtype) or c.hybrid:
            return self._reduce_then_gather(bucket, pieces, sum_dtype, held)
        work = dist.all_reduce(bucket, op=dist.ReduceOp.AVG, group=c.shard_group, async_op=True)
        return Pending(c.count([work], reduced=bucket.nbytes), keep_alive=[bucket], stats=c.stats, comm=c,
                       what=REDUCTION)

    def _reduce_then_gather(self, bucket: Tensor, pieces: Sequence[Range], sum_dtype: torch.dtype | None,
                            held: InFlight) -> Pending:
        """``bucket`` averaged in place as its reduce-scatter (summed in ``sum_dtype``), whose last
        step, once the average landed, is the gather of the averaged pieces
        (``BucketReduction.gather_averaged``)."""
        own = bucket[pieces[self.comm.shard_rank].as_slice()]
        out = own if sum_dtype in (None, bucket.dtype) else torch.empty_like(own, dtype=sum_dtype)
        return self._reduction(out, pieces, held, own=own).issue(bucket)

    def _reduction(self, out: Tensor, pieces: Sequence[Range], held: InFlight,
                   own: Tensor | None = None) -> BucketReduction:
        return NativeReduction(self, out, pieces, held, own)

    def gather(self, flat: Tensor, pieces: Sequence[Range]) -> Pending:
        """Every rank's piece into ``flat``, in place: equal pieces (a bucket's) by one in-place
        ``all_gather_into_tensor``, others by broadcasts; see ``Comm.all_gather_inplace``."""
        c = self.comm
        if not equal_pieces(pieces):
            return self._broadcasts(flat, pieces)
        whole = flat[pieces[0].start:pieces[-1].end]
        work = _all_gather_into_tensor(whole, flat[pieces[c.shard_rank].as_slice()], group=c.shard_group,
                                       async_op=True)
        return Pending(c.count([work], gathered=whole.nbytes), keep_alive=[flat], stats=c.stats, comm=c, what=GATHER)

    def _broadcasts(self, flat: Tensor, pieces: Sequence[Range]) -> Pending:
        """One broadcast per rank that holds part of ``pieces``, into its piece of ``flat``."""
        c = self.comm
        works = [dist.broadcast(flat[p.as_slice()], src=c.shard_global[r], group=c.shard_group, async_op=True)
                 for r, p in enumerate(pieces) if p.size > 0]
        gathered = sum(p.size for p in pieces) * flat.element_size()
        return Pending(c.count(works, gathered=gathered), keep_alive=[flat], stats=c.stats, comm=c, what=GATHER)

    def reduce_scatter(self, out: Tensor, bucket: Tensor, pieces: Sequence[Range], held: InFlight) -> Pending:
        """This rank's piece of ``bucket``'s average into ``out``: one handle; see ``Comm.reduce_scatter``."""
        return self._reduction(out, pieces, held).issue(bucket)


class RankOrderPath(NativePath):
    """A bucket's reduction as two all-to-alls that send every rank the other ranks' copies of its
    piece, then a sum in rank order in fp32 (fp64 for fp64 gradients) and a division: the same bits
    whatever the bucketing, 16-bit gradients summed in fp32; its gather as one broadcast per rank
    (see [Note: the bucket paths]). gloo's default."""

    name = "rank-order"
    whole_all_reduce = False  # stage 1: this reduce-scatter, then the gather of the pieces

    def all_reduce(self, bucket: Tensor, pieces: Sequence[Range], sum_dtype: torch.dtype | None,
                   held: InFlight) -> Pending:
        return self._reduce_then_gather(bucket, pieces, sum_dtype, held)

    def _reduction(self, out: Tensor, pieces: Sequence[Range], held: InFlight,
                   own: Tensor | None = None) -> BucketReduction:
        return RankOrderReduction(self, out, pieces, held, own)

    def gather(self, flat: Tensor, pieces: Sequence[Range]) -> Pending:
        return self._broadcasts(flat, pieces)


class BucketReduction(abc.ABC):
    """One bucket's reduction in flight, from its issue to the last step of its landing: what its
    collectives hold (``held`` counts it, bytes) and the named steps that run as they land.
    ``issue`` returns its one handle, waited once; the handle's landing runs a step of this
    object's, which with hybrid sharding returns the cross-replica all-reduce, a follow-up its
    issuer waits on later (``Comm.cross_replicas``; see comm._collectives [Note: hybrid sharding]).
    The average is complete in ``out`` once the last of these landed; stage 1 (``own``: this
    rank's piece of the bucket) then copies it there and gathers the bucket's pieces
    (``gather_averaged``), inside that landing. A step that ends the use of a buffer lets it go, so
    that a follow-up, which keeps this object, keeps only what it needs."""

    def __init__(self, path: NativePath, out: Tensor, pieces: Sequence[Range], held: InFlight,
                 own: Tensor | None) -> None:
        self.path, self.comm = path, path.comm
        self.out = out  # 1D, this rank's piece of the average: the caller's (stage 2), or ``own`` or a wider copy of it
        self.pieces = pieces  # shard rank r's range relative to the start of the bucket
        self.held = held  # the caller's bytes in flight (see InFlight)
        self.own = own  # stage 1: 1D view of this rank's piece of the bucket (the flat gradient), gathered once averaged
        self.whole: Tensor | None = None  # stage 1: the bucket, a view of the flat gradient (set by ``issue``)

    @abc.abstractmethod
    def issue(self, bucket: Tensor) -> Pending:
        """Issue the collectives of ``bucket``'s reduction; their one handle. Every rank, in the same order."""

    def gather_averaged(self) -> Pending | None:
        """The average is complete in ``out``. Stage 1: copy it into this rank's piece of the bucket
        and gather the pieces (issued here, waited by the landing that called this); else nothing."""
        if self.own is None:
            return None
        if self.out is not self.own:
            self.own.copy_(self.out)
        return self.path.gather(cast(Tensor, self.whole), self.pieces)


class NativeReduction(BucketReduction):
    """A bucket's one ``reduce_scatter_tensor`` (``ReduceOp.AVG``) into ``out``, from a cast copy of
    the bucket when ``out``'s dtype is not the bucket's (see NativePath)."""

    def issue(self, bucket: Tensor) -> Pending:
        c = self.comm
        self.whole = bucket if self.own is not None else None
        src = bucket if self.out.dtype == bucket.dtype else bucket.to(self.out.dtype)  # kept alive by the handle only
        self.copied = src.nbytes if src is not bucket else 0  # bytes of the cast copy, held until it landed
        self.held.nbytes += self.copied
        work = _reduce_scatter_tensor(self.out, src, op=dist.ReduceOp.AVG, group=c.shard_group, async_op=True)
        return Pending(c.count([work], reduced=src.nbytes), keep_alive=[src, self.out], stats=c.stats,
                       then=self.landed, comm=c, what=REDUCTION)

    def landed(self) -> Pending | None:
        """The reduce-scatter landed: the cast copy goes; hybrid: the average across the replicas, in place."""
        self.held.nbytes -= self.copied
        if self.comm.hybrid:
            return self.comm.cross_replicas(self.out, avg=True, then=self.gather_averaged)
        return self.gather_averaged()


class RankOrderReduction(BucketReduction):
    """A bucket's two all-to-alls, issued together in one handle: the first sends each rank below
    this one its piece and receives this rank's piece from the ranks above (into ``above``), the
    second the other way (into ``below``); a rank's own piece stays in the bucket, so it receives
    ``world_size - 1`` pieces, not ``world_size`` (gloo's all-to-all takes no piece that skips its
    own rank: its input is one run). Once both landed, ``sum_in_rank_order``."""

    def issue(self, bucket: Tensor) -> Pending:
        c = self.comm
        n, me, mine = c.shard_size, c.shard_rank, self.pieces[c.shard_rank]
        size = mine.size
        self.whole = bucket if self.own is not None else None
        self.bucket = bucket  # 1D, grad dtype: the staged bucket (stage 2) or the flat gradient's (stage 1)
        self.above = torch.empty((n - 1 - me) * size, dtype=bucket.dtype, device=bucket.device)  # 1D, from ranks above
        self.below = torch.empty(me * size, dtype=bucket.dtype, device=bucket.device)  # 1D, from ranks below
        self.held.nbytes += self.above.nbytes + self.below.nbytes
        down = dist.all_to_all_single(self.above, bucket[:mine.start],  # to the ranks below, from the ranks above
                                      output_split_sizes=[size if q > me else 0 for q in range(n)],
                                      input_split_sizes=[size if q < me else 0 for q in range(n)],
                                      group=c.shard_group, async_op=True)
        up = dist.all_to_all_single(self.below, bucket[mine.end:],  # to the ranks above, from the ranks below
                                    output_split_sizes=[size if q < me else 0 for q in range(n)],
                                    input_split_sizes=[size if q > me else 0 for q in range(n)],
                                    group=c.shard_group, async_op=True)
        return Pending(c.count([down, up], reduced=bucket.nbytes),  # the bucket's reduction, counted once
                       keep_alive=[bucket, self.above, self.below, self.out], stats=c.stats,
                       then=self.sum_in_rank_order, comm=c, what=REDUCTION)

    def sum_in_rank_order(self) -> Pending | None:
        """Both all-to-alls landed: this rank's piece of every rank's copy summed in rank order, in
        fp32 (fp64 for fp64 gradients), and divided by the ranks (with hybrid sharding by every
        replica's ranks, once the other replicas' partial sums are added: ``crossed``)."""
        c, out = self.comm, self.out
        n, me, size = c.shard_size, c.shard_rank, self.pieces[c.shard_rank].size
        above, below, bucket = self.above, self.below, self.bucket
        del self.above, self.below, self.bucket  # they go with the handle, not with a follow-up that keeps this
        self.held.nbytes -= above.nbytes + below.nbytes
        if not size and not c.hybrid:
            return self.gather_averaged()  # hybrid: an empty piece still gets its (empty) follow-up, see cross_replicas
        parts = [below[q * size:(q + 1) * size] if q < me else bucket[self.pieces[me].as_slice()] if q == me
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
            return self.gather_averaged()
        self.partial = acc  # 1D fp32 (fp64): the partial sum of this shard group, until the other replicas' are added
        self.held.nbytes += acc.nbytes
        return c.cross_replicas(acc, avg=False, then=self.crossed)

    def crossed(self) -> Pending | None:
        """The cross-replica all-reduce of the partial sums landed: their average into ``out``."""
        acc = self.partial
        self.held.nbytes -= acc.nbytes
        self.out.copy_(acc.div_(self.comm.shard_size * self.comm.cross.size()))
        return self.gather_averaged()


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
