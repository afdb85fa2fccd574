"""Where one flat buffer's gradients live on this rank, and the collective that reduces a bucket
into them: one strategy per ZeRO stage.

- :class:`FlatGrads` (stage 1): the whole padded gradient buffer on every rank. Each parameter's
  ``.grad`` is a view of it, so autograd accumulates in place, and a bucket is all-reduced in place.
- :class:`ShardGrads` (stage 2): only this rank's shard of the averaged gradient. A bucket's
  gradients are copied into a short-lived staging buffer (``BucketRecord.staging``) and
  reduce-scattered into the shard.

The flat group (``_intake``) decides what goes in and when; a store only holds, stages and reduces.
It issues collectives through :mod:`shardopt.comm._collectives` and knows nothing of rounds.
"""
from __future__ import annotations

import enum
import operator
from typing import Sequence, cast

import torch
from torch import Tensor

from shardopt.comm._collectives import Comm, InFlight, Pending
from shardopt.core._flat import FlatParams, ShardView, copies_into, set_grad
from shardopt.core._records import BucketRecord, GradSlot, ParamRecord, column, grads
from shardopt.group._grad_placeholder import is_placeholder
from shardopt.group._left_grads import LeftGrads, LeftScale


def _flat(grad: Tensor) -> Tensor:
    """``grad`` as a 1-D tensor, as it lies in a bucket (a 1-D one itself: a reshape costs about as
    much as copying a small gradient)."""
    return grad if grad.dim() == 1 else grad.reshape(-1)


class _Store:
    """What both stores share: the buffer, its ranks, its buckets."""

    keeps_views: bool  # p.grad is the store's own view between rounds (else a placeholder)
    accum_shard: Tensor | None = None  # see ShardGrads [Note: accumulating in the shard]
    shard_accumulated = False

    def __init__(self, flat: FlatParams, comm: Comm, reduce_dtype: torch.dtype | None,
                 buckets: Sequence[BucketRecord]) -> None:
        self.flat, self.comm, self.reduce_dtype = flat, comm, reduce_dtype
        self.buckets = list(buckets)
        self.allocations = 0  # buffers allocated since construction: the flat group asks after each call that may allocate
        # What this store's reductions in flight hold beside its buckets (receive buffers, cast copies),
        # bytes: its own, not the other flat buffers' that share the Comm (see comm._bucket_paths.InFlight)
        self.in_flight = InFlight()


class FlatGrads(_Store):
    """Stage 1: the whole gradient buffer; ``p.grad`` are views of it."""

    keeps_views = True

    def __init__(self, flat: FlatParams, comm: Comm, reduce_dtype: torch.dtype | None,
                 buckets: Sequence[BucketRecord]) -> None:
        super().__init__(flat, comm, reduce_dtype, buckets)
        self.flat_grad = torch.zeros_like(flat.data)  # 1D, grad dtype, the whole padded buffer
        for b in self.buckets:
            b.view_grad(self.flat_grad[b.global_range.as_slice()])
            for r in b.params:
                # A gradient already there (a backward pass before the optimizer was built) stays
                # p.grad: the first step takes it as one assigned by hand, averaged over the ranks
                # (see _rounds [Note: gradients assigned by hand]), and a backward pass before it
                # adds to it, as in torch. Replacing it by the zeroed view would drop it.
                if r.param.grad is None:
                    r.param.grad = b.view_of(r)
        self._shard = ShardView(self.flat_grad, flat.layout.shard_runs(comm.shard_rank), flat.layout.shard_numel)

    @property
    def nbytes(self) -> int:
        return self.flat_grad.numel() * self.flat_grad.element_size()

    def is_storage(self, r: ParamRecord, grad: Tensor | None) -> bool:
        """``grad`` is parameter ``r``'s own view of the buffer (autograd added to it in place); an
        empty parameter's view has no storage (``data_ptr()`` 0), like any empty gradient."""
        return grad is not None and grad.data_ptr() == r.grad_ptr

    def put(self, r: ParamRecord, grad: Tensor | None) -> bool | None:
        """Make parameter ``r``'s view hold ``grad`` (None: no gradient) and point ``p.grad``
        back at it. Returns whether the parameter now has a gradient, or None if unchanged. A
        parameter converted or replaced after the optimizer was built (see group._binding) must
        not stop a backward on one rank only: its gradient is dropped here and step() reports it
        on every rank."""
        view, used = cast(Tensor, r.bucket.view_of(r)), None  # stage 1: every bucket has its view
        if grad is None:
            view.zero_()
            used = False  # zeroed by p.grad = None and no gradient since
        elif not self.is_storage(r, grad):
            # .grad was reset to None or replaced: it holds the full sum, unless the parameter's
            # shape changed (or it is a placeholder converted along with it, which holds no values)
            if copies_into(grad, view) and not is_placeholder(grad):
                view.copy_(grad)
                used = True
            else:
                view.zero_()
        if r.param.grad is not view:
            set_grad(r.param, view)
        return used

    def take_fresh(self, r: ParamRecord) -> int | None:
        """The usual case of a hook (``FlatGroup.take_fresh``): ``p.grad`` is parameter ``r``'s
        own view, to which autograd added in place; nothing to move, 0 bytes produced. None when
        ``p.grad`` is anything else. Local."""
        g = r.param.grad
        if g is None or g is not r.grad_view or not r.grad_ptr or g.data_ptr() != r.grad_ptr:
            return None
        return 0

    def changed_views(self, records: Sequence[ParamRecord]) -> list[ParamRecord]:
        """Before a step: the parameters whose ``p.grad`` was set to None or replaced by another
        tensor than their view (and no placeholder of the optimizer's is out). A question."""
        # The usual step first, in C passes: every p.grad is its own view, where it was made.
        now = grads(records)
        if all(map(operator.is_, now, column(records, "grad_view"))) and \
                list(map(Tensor.data_ptr, cast(list[Tensor], now))) == column(records, "grad_ptr"):
            return []
        return [r for r in records if r.slot is GradSlot.OWN and not self.is_storage(r, r.param.grad)]

    def add_late(self, r: ParamRecord, grad: Tensor) -> None:
        """A second gradient in one round: autograd already added it to the view, in place."""

    def launch(self, b: BucketRecord) -> Pending:
        return self.comm.all_reduce(cast(Tensor, b.grad_view), b.pieces, self.reduce_dtype,  # stage 1: a view
                                  self.in_flight)

    def landed(self, b: BucketRecord) -> None:
        pass

    def reduced(self, b: BucketRecord) -> None:
        """Reduced in place, in the flat gradient: nothing to write."""

    def buffer_bytes(self) -> int:
        """What this store's reductions in flight hold beside the flat gradient now, bytes."""
        return self.in_flight.nbytes

    def clear(self, cleared: Sequence[ParamRecord], at_step: bool) -> None:
        """Gradients zeroed by hand: nothing to do here, a placeholder is out only while a 16-bit
        gradient is summed in fp32 and its view was emptied into that sum."""

    def end_round(self) -> None:
        pass

    def zero(self) -> None:
        self.flat_grad.zero_()
        for b in self.buckets:
            for r in b.params:
                view = b.view_of(r)
                if r.param.grad is not view and not set_grad(r.param, view):
                    r.param.grad = None

    def round_sum(self) -> None:
        """Nothing to round: stage 1 sums in the gradient itself."""

    def left(self, accum: Tensor | None, made: LeftScale) -> LeftGrads:
        """What the placeholders out hold once the optimizer stops training (see _left_grads): in
        stage 1 only 16-bit gradients summed in ``accum`` under no_sync, whose views were emptied
        into that sum; ``made``: how they were made. Local."""
        return LeftGrads(self.comm, self.flat.layout, self.flat.dtype, None, accum, made)

    def local_grad(self) -> ShardView:
        return self._shard


class ShardSum(enum.Enum):
    """What ``ShardGrads.grad_shard`` holds between zero_grad and the step."""

    FRESH = "fresh"  # no reduction landed since zero_grad: the next one overwrites the whole shard
    HELD = "held"  # the averaged gradient of the rounds so far, in the gradient dtype
    SUMMED = "summed"  # several rounds: their fp32 sum in accum_shard is the gradient; grad_shard lags behind it
    ROUNDED = "rounded"  # ... and grad_shard holds it rounded (``round_sum``), until another round adds to it


_SUM_NEXT = {  # FRESH never becomes SUMMED: the fp32 sum starts at a second round
    ShardSum.FRESH: {ShardSum.FRESH, ShardSum.HELD},
    ShardSum.HELD: {ShardSum.FRESH, ShardSum.HELD, ShardSum.SUMMED},
    ShardSum.SUMMED: {ShardSum.FRESH, ShardSum.HELD, ShardSum.SUMMED, ShardSum.ROUNDED},
    ShardSum.ROUNDED: {ShardSum.FRESH, ShardSum.HELD, ShardSum.SUMMED},
}


class ShardGrads(_Store):
    """Stage 2: this rank's shard of the averaged gradient, and staging for buckets in flight.

    [Note: accumulating in the shard] Several backward passes between two steps without no_sync
    reduce every micro-batch. The averaged micro-batch gradients are then summed in an fp32 shard
    (``accumulate_dtype``, allocated at the second round: 4/N B/param; each average arrives in the
    gradient dtype) and rounded to the gradient dtype once, when the step starts (``round_sum``, from
    ``Rounds.before_step``): no unsharded copy of the gradient exists at any time, for one
    reduction per micro-batch instead of one.
    """

    keeps_views = False

    def __init__(self, flat: FlatParams, comm: Comm, reduce_dtype: torch.dtype | None,
                 accumulate_dtype: torch.dtype | None, buckets: Sequence[BucketRecord]) -> None:
        super().__init__(flat, comm, reduce_dtype, buckets)
        self.accumulate_dtype = accumulate_dtype
        self.grad_shard = torch.zeros(flat.layout.shard_numel, dtype=flat.dtype, device=flat.device)  # 1D, grad dtype
        self.accum_shard = None  # 1D fp32: the sum of several rounds since zero_grad (state SUMMED)
        self.shard_accumulated = False  # accum_shard was allocated since the peaks were reset
        self.sum = ShardSum.FRESH
        self._staging_bytes = 0  # the buckets' staging buffers held now, bytes

    def _to(self, state: ShardSum) -> None:
        """The one place ``sum`` changes after construction."""
        if state not in _SUM_NEXT[self.sum]:
            raise AssertionError(f"the gradient shard's sum cannot go from {self.sum} to {state}")
        self.sum = state

    @property
    def nbytes(self) -> int:
        return self.grad_shard.numel() * self.grad_shard.element_size()

    def is_storage(self, r: ParamRecord, grad: Tensor | None) -> bool:
        return False

    def put(self, r: ParamRecord, grad: Tensor | None) -> bool | None:
        """Copy parameter ``r``'s gradient into its bucket's staging buffer; ``p.grad`` goes.
        Returns True when it got one (also a gradient assigned by hand, which no hook announced),
        None when unchanged."""
        used = None
        if grad is not None:
            staged, flat = self._staged(r), _flat(grad)
            if copies_into(flat, staged):
                staged.copy_(flat)
                used = True
            # else converted after construction: reported at step() on every rank (see FlatGrads.put)
            if r.param.grad is grad:
                r.param.grad = None
        return used

    def take_fresh(self, r: ParamRecord) -> int | None:
        """The usual case of a hook (``FlatGroup.take_fresh``): ``p.grad`` is a dense tensor
        autograd just made and its bucket's staging exists: copy it in, ``p.grad`` goes. Returns its
        bytes; None, changing nothing, in any other case (the slow path decides). Local."""
        g = r.param.grad
        staging = r.bucket.staging
        if staging is None or type(g) is not Tensor or g.layout is not torch.strided:
            return None
        staged, flat = staging[r.at], _flat(g)
        if g.numel() != staged.numel() and not copies_into(flat, staged):
            return None  # converted after construction: the slow path drops it and step() reports it
        staged.copy_(flat)
        r.param.grad = None
        return g.nbytes

    def changed_views(self, records: Sequence[ParamRecord]) -> list[ParamRecord]:
        return []

    def add_late(self, r: ParamRecord, grad: Tensor) -> None:
        """A second gradient in one round, before its bucket was reduced: added to the staged one."""
        self._staged(r).add_(_flat(grad))
        r.param.grad = None

    def _staged(self, r: ParamRecord) -> Tensor:
        return self._staging_for(r.bucket)[r.at]

    def _staging_for(self, b: BucketRecord) -> Tensor:
        staging = b.staging
        if staging is None:
            staging = torch.zeros(b.global_range.size, dtype=self.flat.dtype, device=self.flat.device)
            b.stage(staging)
            self._staging_bytes += staging.numel() * staging.element_size()
            self.allocations += 1
        return staging

    def shard_part(self, b: BucketRecord) -> Tensor:
        """Bucket ``b``'s part of this rank's gradient shard (a view; may be empty)."""
        return self.grad_shard[b.local.as_slice()]

    def launch(self, b: BucketRecord) -> Pending:
        """Bucket ``b``'s reduce-scatter: straight into its part of the gradient shard when that
        part is overwritten in the gradient dtype (the first round since zero_grad), else into a
        landing buffer that :meth:`reduced` writes into the shard or the fp32 sum."""
        staging = self._staging_for(b)
        dest = self.shard_part(b)
        if self.sum is ShardSum.FRESH and self.reduce_dtype is None:
            out = dest
        else:
            if self.sum is not ShardSum.FRESH and self.accumulate_dtype is not None and self.accum_shard is None:
                self.accum_shard = self.grad_shard.to(self.accumulate_dtype)  # see [Note: accumulating in the shard]
                self.shard_accumulated = True
                self.allocations += 1
            out = torch.empty_like(dest, dtype=self.reduce_dtype or dest.dtype)
        b.land_in(None if out is dest else out)
        return self.comm.reduce_scatter(out, staging, b.pieces, self.in_flight)

    def reduced(self, b: BucketRecord) -> None:
        """Bucket ``b``'s reduction is complete (a cross-replica follow-up too): write what landed
        into this rank's gradient shard, replacing it in the first round since zero_grad, else
        adding to it (or to the fp32 sum of several rounds)."""
        out = b.landing
        if out is None:
            return  # landed in the shard itself
        b.land_in(None)
        local = b.local.as_slice()
        if self.sum is ShardSum.FRESH:
            self.grad_shard[local].copy_(out)
        elif self.accum_shard is not None:
            self.accum_shard[local].add_(out)
        else:
            self.grad_shard[local].add_(out)

    def landed(self, b: BucketRecord) -> None:
        """Bucket ``b``'s reduction arrived: its staging goes."""
        if b.staging is not None:
            self._staging_bytes -= b.staging.numel() * b.staging.element_size()
            b.stage(None)

    def buffer_bytes(self) -> int:
        """Staging, what this store's reductions in flight hold beside it and the fp32 sum of several
        rounds, held now, bytes."""
        summed = self.accum_shard.numel() * self.accum_shard.element_size() if self.accum_shard is not None else 0
        return self._staging_bytes + self.in_flight.nbytes + summed

    def clear(self, cleared: Sequence[ParamRecord], at_step: bool) -> None:
        """Restart from zero the gradients of parameters ``cleared`` (zeroed by hand)."""
        if len(cleared) == len(self.flat.params):
            self.accum_shard = None
            if at_step:
                self.grad_shard.zero_()
                if self.sum is not ShardSum.FRESH:
                    self._to(ShardSum.HELD)  # the sum went with the zeroing: the zeroed shard is the gradient
            else:
                self._to(ShardSum.FRESH)  # the next reduction overwrites the whole shard
            return
        for r in cleared:
            if r.local is not None:
                self.grad_shard[r.local.as_slice()].zero_()
                if self.accum_shard is not None:
                    self.accum_shard[r.local.as_slice()].zero_()

    def end_round(self) -> None:
        """Every bucket of the round landed: the shard holds the gradient the step will read."""
        if self._staging_bytes:
            raise AssertionError(f"{self._staging_bytes} bytes of staging left behind after a round")
        self._to(ShardSum.SUMMED if self.accum_shard is not None else ShardSum.HELD)

    def round_sum(self) -> None:
        """Round the fp32 sum of several rounds into ``grad_shard`` (once, before the step reads it). Local."""
        if self.sum is ShardSum.SUMMED:
            self.grad_shard.copy_(cast(Tensor, self.accum_shard))  # SUMMED: the sum is held
            self._to(ShardSum.ROUNDED)

    def zero(self) -> None:
        self._to(ShardSum.FRESH)  # the next round overwrites every element of grad_shard
        self.accum_shard = None

    def left(self, accum: Tensor | None, made: LeftScale) -> LeftGrads:
        """What the placeholders hold once the optimizer stops training (see _left_grads): the
        averaged gradient's shard (the fp32 sum of several rounds where it is the gradient; none
        after zero_grad until a round lands), and ``accum``, the fp32 sums under no_sync; ``made``:
        how they were made. Local."""
        shard = None if self.sum is ShardSum.FRESH else self.accum_shard if self.sum is ShardSum.SUMMED else self.grad_shard
        return LeftGrads(self.comm, self.flat.layout, self.flat.dtype, shard, accum, made)

    def local_grad(self) -> Tensor:
        """The gradient shard; after several rounds not yet rounded (``round_sum``), a rounded copy
        of their fp32 sum (a question: changes nothing)."""
        if self.sum is ShardSum.SUMMED:
            return cast(Tensor, self.accum_shard).to(self.grad_shard.dtype)
        return self.grad_shard
