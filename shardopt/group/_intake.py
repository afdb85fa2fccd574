"""What each parameter's gradient is in the open round, and what goes into a bucket.

Told by the scheduler (``_rounds``, which owns the hooks and decides when buckets are reduced,
see its [Note: launch order]) that a gradient arrived, it takes the gradient into its bucket,
holds it (``no_sync``), folds or refuses a second one, and stages a bucket when asked. Where the
gradients live and which collective reduces a bucket is the stage's store (``_grad_store``:
stage 1 the whole flat gradient, stage 2 this rank's shard). It knows nothing of rounds. Several
rounds between two steps accumulate correctly: stage 1 averages the accumulated buffer again (the
part averaged before is equal on every rank, so averaging it again is exact), stage 2 adds each
round's averaged shard into the gradient shard.

[Note: what the flat group knows about each parameter's gradient]
Torch semantics decide whether a parameter is updated and whether a backward adds to or replaces
the gradient: ``ParamRecord.used`` says that the parameter got a gradient on this rank since its
gradient was last zeroed (by ``opt.zero_grad()``, ``model.zero_grad()``, ``p.grad = None`` or
``p.grad.zero_()``); the optimizer skips a parameter that no rank has a gradient for, as
``torch.optim.AdamW`` skips ``p.grad is None``. Zeroing through the model is seen from ``p.grad``:
in stage 1 ``p.grad`` is a view of the flat gradient, in stage 2 a placeholder (see
``_grad_placeholder`` [Note: the stage-2 gradient placeholder]); when one is gone or zeroed, that
parameter's gradient (stage 2: its part of the shard) restarts from zero. Every rank sets
``p.grad`` of *every* parameter after a round, so a zeroing is seen alike on every rank.

"""
from __future__ import annotations

import enum
import operator
import time
from itertools import compress, repeat
from typing import cast

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from shardopt.comm._collectives import Comm, Pending
from shardopt.core._dtensor import leave_grad, move_grad
from shardopt.core._compat import will_execute_each
from shardopt.core._flat import FlatParams, ShardView, set_grad
from shardopt.core._records import (BucketRecord, BucketState, GradSlot, Holds, ParamRecord, ParamState, Reach, column,
                                    flagged, grads)
from shardopt.group._grad_placeholder import GradPlaceholder, is_placeholder, pending_of, take_pending
from shardopt.group._grad_store import FlatGrads, ShardGrads
from shardopt.group._held_bytes import HeldBytes, HeldTotal
from shardopt.group._left_grads import LeftScale, tag_left

__all__ = ["Backward", "GradIntake", "ParamState"]


class Backward(enum.Enum):
    """How the backward pass that runs now was started: which loss scale its gradients carry is
    decided from these at the step (see step._usage_checks [Note: the loss scale a gradient carries])."""

    PLAIN = "plain"  # outside opt.backward: loss.backward(), t.backward(g) (a pipeline stage's received gradient)
    SCALED = "scaled"  # opt.backward(loss), or opt.backward(t, gradient=g) without model_parallel_group= axes: multiplied by the loss scale
    CARRIED = "carried"  # opt.backward(t, gradient=g) beside model_parallel_group= axes: not multiplied; g carries the scale of the stage it came from


class GradIntake:
    """The backward half of a flat group (``_flat_group.FlatGroup``): takes the gradients of one
    :class:`FlatParams` buffer into its buckets and reduces them over ``comm``'s ranks."""

    flat_grad: Tensor | None  # stage 1: 1D, grad dtype, the whole padded buffer; params' .grad view it
    grad_shard: Tensor | None  # stage 2: 1D, grad dtype, this rank's shard of the averaged gradient

    accum: Tensor | None  # 1D fp32, whole buffer: gradients accumulated under no_sync (16-bit params only)

    # what the flat group that this is the backward half of sets before ``_init_intake``
    flat: FlatParams
    comm: Comm
    records: list[ParamRecord]  # one per parameter, in buffer order
    buckets: list[BucketRecord]  # one per bucket, in layout order

    def _init_intake(self, stage: int, accumulate_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                     held_total: HeldTotal) -> None:
        flat = self.flat
        self.dtensor_records = [r for r in self.records if r.dtensor is not None]  # see core._dtensor
        # On the native path reductions sum in the gradient dtype unless reduce_dtype (e.g. fp32) asks for
        # more precision, from a cast copy of the bucket; the rank-order path always sums in fp32 (see
        # comm._bucket_paths [Note: the bucket paths]). The result is rounded once, after averaging.
        self.reduce_dtype = reduce_dtype if reduce_dtype not in (None, flat.dtype) else None
        # [Note: accumulation dtype] autograd accumulates .grad in the parameter's dtype; summing
        # many bf16 micro-batch gradients in bf16 loses their low bits. Under no_sync each new
        # gradient is moved into an fp32 buffer instead (allocated only while accumulating), and
        # rounded to the gradient dtype once, when the last micro-batch is reduced.
        self.accumulate_dtype = accumulate_dtype if accumulate_dtype not in (None, flat.dtype) else None
        self.accum = None
        # Backward passes since the last step, by how they were started (see Backward).
        self.scaled_backwards = self.carried_backwards = self.unscaled_backwards = 0
        self.check_seconds = 0.0  # time spent tracking zeroing (placeholders, apply_zeroing) since the step, seconds
        self.zeroings = 0  # times gradients were found zeroed or replaced since construction (apply_zeroing, follow_views)
        for r in self.records:
            # p.grad holds it: stage 2 after a round, either stage while a 16-bit gradient is summed
            # in the fp32 accumulation buffer under no_sync.
            # Its gradient accumulator (held, so autograd keeps using this one): which ones a backward pass reaches.
            r.attach(GradPlaceholder(r.param), get_gradient_edge(r.leaf).node)
        self.store = (FlatGrads(flat, self.comm, self.reduce_dtype, self.buckets) if stage == 1 else
                      ShardGrads(flat, self.comm, self.reduce_dtype, self.accumulate_dtype, self.buckets))  # see _grad_store
        self.flat_grad = getattr(self.store, "flat_grad", None)
        self.grad_shard = getattr(self.store, "grad_shard", None)
        self.held = HeldBytes(self.store.nbytes, self, held_total)  # see _held_bytes
        self.accumulated = False  # the no_sync fp32 sum was allocated since the peaks were reset
        self._arrivals = 0  # gradients that arrived in the first round so far
        self.problems: list[str] = []  # gradients that could not be reduced: reported at the next step
        self.released = False  # its optimizer no longer trains the parameters (``release``)

    # -- what _rounds asks of a flat group ----------------------------------------------------
    def unreached(self, reached: ParamRecord | None = None) -> list[ParamRecord]:
        """When a round opens inside a backward pass: the parameters that pass will not reach, which
        the round counts as ready at once (``mark_absent``). ``reached``: the parameter whose hook
        opened the round, reached whatever the engine says (a backward from the parameter itself,
        ``p.backward(g)``, makes its accumulator the graph's root, which the engine does not list
        among the nodes it will run). A question. Local."""
        skipped = compress(self.records, map(operator.not_, will_execute_each(column(self.records, "accumulator"))))
        return [r for r in skipped if r.reach is Reach.DIRECT and r is not reached]

    def mark_absent(self, r: ParamRecord) -> None:
        """WAITING -> ABSENT: the round opened, the pass will not reach ``r``. Local."""
        r.to(ParamState.ABSENT)

    def note_forward_use(self) -> None:
        """Before the first round, once the records hold their forward uses: the parameters used
        only in forwards without gradients (see _rounds [Note: launch order]) are never counted
        ahead. Local."""
        for r in self.records:
            if r.gradless:
                r.nest()

    def holds_unreduced(self) -> bool:
        """Some ``p.grad`` holds a gradient that no round took (assigned by hand, or accumulated
        under no_sync) since the last round. A question. Local."""
        return self.accum is not None or any(r.holds() is Holds.TENSOR for r in self.records)

    def begin_hand_round(self) -> None:
        """clip_grad_norm_ or step runs a round of its own (see _rounds [Note: gradients assigned by
        hand]): follow what was zeroed or replaced since the last round, as a backward pass does at
        its start (a tensor in place of a placeholder is that parameter's whole gradient). With no
        backward pass since the last step (nor gradients an earlier optimizer left, counted by
        ``inherit``), the gradients carry no loss scale: counted as an unscaled backward pass. Local."""
        if self.scaled_backwards == 0 and self.carried_backwards == 0 and self.unscaled_backwards == 0:
            self.unscaled_backwards += 1
        start = time.perf_counter()
        self.apply_zeroing()
        self.check_seconds += time.perf_counter() - start

    def begin_backward(self, how: Backward) -> None:
        """A backward pass starts: note how it was started (``how``) and follow what was zeroed
        since the last. Local."""
        if how is Backward.SCALED:
            self.scaled_backwards += 1
        elif how is Backward.CARRIED:
            self.carried_backwards += 1
        else:
            self.unscaled_backwards += 1
        start = time.perf_counter()
        self.apply_zeroing()
        self.check_seconds += time.perf_counter() - start

    def _put(self, r: ParamRecord, grad: Tensor | None) -> None:
        """Hand ``grad`` (parameter ``r``'s whole gradient, or None) to the store."""
        allocated = self.store.allocations
        used = self.store.put(r, grad)
        self._note_allocations(allocated)
        if used is not None:
            r.got_gradient(used)

    def follow_views(self) -> bool:
        """Before a step, stage 1: make the gradient of each parameter whose ``p.grad`` was set to
        None (zero, and absent) or replaced by another tensor (that tensor is the gradient) what
        ``p.grad`` says, and point ``p.grad`` back at its view. True if any was. Local."""
        changed = self.store.changed_views(self.records)
        for r in changed:
            self._put(r, r.param.grad)
        self.zeroings += bool(changed)
        return bool(changed)

    def _untouched(self) -> bool:
        """Nothing zeroed or replaced since the placeholders were placed (the usual case). A question."""
        # Each pass runs in C (map, attrgetter, operator.is_): this runs at every backward pass and step.
        own = list(map(operator.is_, column(self.records, "slot"), repeat(GradSlot.OWN)))
        if all(own):
            return True
        if any(own):
            return False
        placeholders = column(self.records, "placeholder")
        return all(map(operator.is_, grads(self.records), placeholders)) and not any(column(placeholders, "zeroed"))

    def apply_zeroing(self, *, at_step: bool = False) -> bool:
        """Restart from zero the gradient of every parameter whose placeholder was removed
        (``model.zero_grad()``, ``p.grad = None``) or zeroed since it was placed. True if any was.
        In stage 2 a placeholder replaced by a tensor at a step cannot be reduced any more: its
        record is marked ``replaced`` for the step to report. Local."""
        if self._untouched():
            return False
        cleared = []
        for r in self.records:
            if r.slot is GradSlot.OWN:
                continue  # no placeholder out: no gradient since zeroing, or autograd is accumulating one
            g = r.param.grad
            if g is r.placeholder:
                ph = cast(GradPlaceholder, g)  # every record has one (see __init__)
                if not ph.zeroed:
                    continue
                ph.zeroed = False  # zero_(): a zero gradient that still counts as present
            else:  # removed (model.zero_grad()) or replaced by hand: the new value replaces the old
                r.place(GradSlot.OWN)
                r.got_gradient(g is not None)
                if g is not None and at_step and not self.store.keeps_views:
                    r.mark_replaced(True)
            cleared.append(r)
        if not cleared:
            return False
        if self.accum is not None:  # micro-batch gradients summed so far go too
            for r in cleared:
                self.flat.param_view(self.accum, r.index).zero_()
        self.store.clear(cleared, at_step)
        self.zeroings += 1
        return True

    def take_fresh(self, r: ParamRecord) -> bool:
        """The usual case of :meth:`take`, from a hook of a backward pass that reduces, not nested,
        after the first round: parameter ``r`` is waiting for its first gradient of the round, which
        autograd just produced (stage 2: a new tensor, taken into a staging buffer that exists
        already; stage 1: added in place to its view), nothing is accumulated or kept under
        ``no_sync``, and it is no DTensor's. Then the same as ``take``, in a few steps: True.
        Otherwise False, and nothing changed: call ``take``. Local."""
        if r.state is not ParamState.WAITING or r.kept_bytes or r.dtensor is not None or self.accum is not None:
            return False
        nbytes = self.store.take_fresh(r)
        if nbytes is None:
            return False
        r.got_gradient()
        r.to(ParamState.TAKEN)  # WAITING -> TAKEN: its gradient is in its bucket
        self.held.spike(nbytes)  # see _held_bytes [Note: a gradient taken at once]
        return True

    def take(self, r: ParamRecord, *, sync: bool, nested: bool, first: bool) -> bool:
        """Parameter ``r``'s gradient was accumulated into ``p.grad`` (from the scheduler's hook):
        take it into its bucket, or hold it (``no_sync``), or fold or refuse a second one.
        ``nested``: in a backward pass nested in the round's; ``first``: in the first round. True
        when its bucket has one more parameter in for this round. Local."""
        param = r.param
        if nested:
            r.nest()
        state = r.state
        if state is ParamState.ABSENT:  # ABSENT -> TAKEN or WAITING: refused below, as if never counted
            r.nest()  # never counted ahead again
            r.to(ParamState.WAITING if r.bucket.state is BucketState.WAITING else ParamState.TAKEN)
            if param.dtype != self.flat.dtype or param.device != self.flat.device:
                return False  # converted after construction (a new accumulator): reported at step() on every rank
            self._refuse(r, f"parameter {r.name} got its gradient in a backward "
                            "pass nested in another (torch.utils.checkpoint with use_reentrant=True) that the outer pass "
                            "did not show, after its bucket was reduced without it; use use_reentrant=False, or turn "
                            "checkpointing on before the first backward pass")
            return False
        r.got_gradient()
        grad = pending_of(param.grad)
        own = grad is None or self.store.is_storage(r, grad)  # no new tensor
        if not own and self.store.keeps_views:  # stage 1: p.grad was set to None or replaced since its view held it
            self.zeroings += 1
        self.held.produced(r, 0 if own or grad is None else grad.numel() * grad.element_size(),
                           keep=not sync and self.accumulate_dtype is None)
        if not sync:
            if self.accumulate_dtype is not None:
                self._accumulate(r)
            return False
        if first and r.arrived(self._arrivals):
            self._arrivals += 1
        if state is ParamState.TAKEN:  # a second gradient in one round: used inside and outside a reentrant checkpoint
            self._late(r)
            return False
        self._into_bucket(r)
        return True

    def _late(self, r: ParamRecord) -> None:
        """Parameter ``r`` got a second gradient in this round (autograd accumulated it twice, in an
        outer and a nested backward pass). Folded into its bucket if that is not reduced yet;
        otherwise it cannot be reduced any more: raise rather than drop it. Local."""
        if r.bucket.state is BucketState.WAITING:
            grad = take_pending(r.param.grad)
            if grad is not None:
                allocated = self.store.allocations
                self.store.add_late(r, grad)
                self._note_allocations(allocated)
            return
        self._refuse(r, f"parameter {r.name} got a second gradient in one backward "
                        "pass (it is used both inside and outside a torch.utils.checkpoint with use_reentrant=True, or "
                        "in two such checkpoints) after its bucket was reduced; use use_reentrant=False")

    def _refuse(self, r: ParamRecord, message: str) -> None:
        """A gradient that can no longer be reduced: drop it and report ``message`` at the next step
        on every rank (raising here, in one rank's hook, would leave the others waiting)."""
        self.problems.append(message + "; the step was not taken")
        if not self.store.keeps_views or is_placeholder(r.param.grad):
            r.param.grad = None

    def forget_problems(self) -> None:
        """The step reported ``problems`` on every rank: clear them. Local."""
        self.problems = []

    def reset_peaks(self) -> None:
        """Restart the high-water marks from what is held now. Local."""
        self.held.reset()
        self.accumulated = self.accum is not None
        self.store.shard_accumulated = self.store.accum_shard is not None

    def _accumulate(self, r: ParamRecord) -> None:
        self.held.taken()
        grad = take_pending(r.param.grad)  # autograd added to a gradient held in the shard: keep it there
        if grad is None:
            return
        if self.accum is None:
            self.accum = torch.zeros(self.flat.layout.numel, dtype=self.accumulate_dtype, device=self.flat.device)
            self.accumulated = True
            self.held.buffers_changed()
        self.flat.param_view(self.accum, r.index).add_(grad)
        if self.store.is_storage(r, grad):
            grad.zero_()  # the view was the accumulation target; its content now sits in accum
        # The placeholder keeps model.zero_grad() and p.grad.zero_() visible while the sum sits in accum.
        ph = cast(GradPlaceholder, r.placeholder)  # every record has one (see __init__)
        ph.zeroed, ph.pending = False, None
        if set_grad(r.param, ph):
            r.place(GradSlot.ACCUMULATING)
        else:
            r.place(GradSlot.OWN)
            r.param.grad = None

    def _into_bucket(self, r: ParamRecord) -> None:
        """Move parameter ``r``'s accumulated ``.grad`` into the buffer being reduced."""
        if r.state is ParamState.TAKEN:
            return
        if r.state is ParamState.WAITING:
            r.to(ParamState.TAKEN)  # WAITING -> TAKEN: its gradient (or zero) goes into the bucket
        self.held.unkeep(r)
        p = r.param
        if p.grad is not None and p.grad.is_sparse:
            raise TypeError(f"parameter #{r.index} of shape {tuple(p.shape)} got a sparse gradient; shardopt "
                            "needs dense gradients (e.g. nn.Embedding(sparse=False))")
        if self.accum is not None:  # fold this round's gradient into the fp32 sum of earlier micro-batches
            self._accumulate(r)
            r.place(GradSlot.OWN)
            if not set_grad(p, self.flat.param_view(self.accum, r.index).to(self.flat.dtype) if r.used else None):
                p.grad = None
        self._put(r, take_pending(p.grad))  # autograd added to a placeholder: the new part; the rest is in the shard
        self.held.taken()  # the .grad is gone (it was counted while the staging buffer was allocated)

    def buffer_bytes(self) -> int:
        """The store's buffers (its reductions' receive buffers included) and the no_sync fp32 sum held now, bytes."""
        held = self.store.buffer_bytes()
        return held + (self.accum.numel() * self.accum.element_size() if self.accum is not None else 0)

    def launch(self, b: BucketRecord) -> Pending:
        """Stage bucket ``b`` and issue its reduction: its one handle. Every rank, in the same order."""
        b.to(BucketState.LAUNCHED)
        taken = ParamState.TAKEN
        for r in b.params:
            if r.state is not taken:
                self._into_bucket(r)  # parameters without a gradient this round count as zero
        allocated = self.store.allocations
        launch = self.store.launch(b)
        self._note_allocations(allocated)
        return launch

    def _note_allocations(self, before: int) -> None:
        """The store allocated a buffer since it counted ``before`` allocations: a moment whose bytes
        the high-water marks must see (the ``.grad`` being taken still counts as held)."""
        if self.store.allocations != before:
            self.held.buffers_changed()

    def landed(self, b: BucketRecord) -> None:
        """Bucket ``b``'s reduction arrived: its staging was read."""
        b.to(BucketState.LANDED)
        self.store.landed(b)

    def reduced(self, b: BucketRecord) -> None:
        """Bucket ``b``'s gradient is complete (after a cross-replica follow-up, if any): into the shard."""
        self.store.reduced(b)

    def end_round(self) -> None:
        """Every bucket of this round was reduced: reset for the next. Local."""
        self.store.end_round()
        self.accum = None
        for b in self.buckets:
            b.to(BucketState.WAITING)  # LANDED -> WAITING: the next round, none ready
        waiting = ParamState.WAITING
        if self.store.keeps_views:
            for r in self.records:
                r.to(waiting)  # any -> WAITING: the next round
            return
        start = time.perf_counter()
        for r in self.records:  # one pass: this runs over every parameter at every backward pass
            r.to(waiting)
            ph = cast(GradPlaceholder, r.placeholder)  # every record has one (see __init__)
            if ph.zeroed:
                ph.zeroed = False
            if set_grad(r.param, ph):
                r.place(GradSlot.PLACEHOLDER)
        self.check_seconds += time.perf_counter() - start

    def arrival(self) -> list[ParamRecord]:
        """The parameters whose gradients arrived in the first round, in that order. A question."""
        return sorted((r for r in self.records if r.arrival is not None), key=lambda r: cast(int, r.arrival))

    def launch_order(self) -> list[BucketRecord] | None:
        """This buffer's buckets in the launch order the ranks agreed on; None before the first round. A question."""
        if not self.buckets or self.buckets[0].launch is None:
            return None
        return sorted(self.buckets, key=lambda b: cast(int, b.launch))  # agreed for every bucket at once

    @property
    def forward_order(self) -> list[BucketRecord]:
        """Buckets in the order the forward pass is expected to use them (reverse of gradient readiness). A question."""
        return (self.launch_order() or self.buckets)[::-1]

    # -- what the optimizer sees ---------------------------------------------------------
    def round_sum(self) -> None:
        """Before clip_grad_norm_ and step read the gradient: round the fp32 sum of several rounds
        into the gradient shard, once (see _grad_store [Note: accumulating in the shard]). Local."""
        self.store.round_sum()

    def local_grad(self) -> Tensor | ShardView:
        """This rank's shard of the averaged gradient (grad dtype, shard_numel elements; stage 1: its
        pieces of the flat gradient, see core._flat.ShardView), once
        ``_rounds`` ran a round since ``zero_grad``. A question. Local."""
        return self.store.local_grad()

    def take_dtensor_grads(self) -> None:
        """Move the ``.grad`` of each DTensor parameter into its stand-in (a gradient no hook moved:
        assigned by hand), in place of what the stand-in held, as a plain parameter's ``p.grad = g``
        replaces its gradient: the round or the step then takes it as one assigned by hand. See
        core._dtensor [Note: DTensor parameters]. A parameter swapped for another tensor since (its
        gradient accumulator is not the one held: ``model.to(...)``, which took the hooks away) keeps
        its ``.grad``: the step reports it on every rank (see group._binding). Local."""
        for r in self.dtensor_records:
            dt = r.dtensor
            if dt is not None and dt.grad is not None and get_gradient_edge(dt).node is r.accumulator:
                move_grad(dt, r.param, replace=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget all gradients (also any accumulated under ``no_sync``). With ``set_to_none`` the
        parameters then have no gradient (a step leaves them alone), else a zero one (a step still
        applies weight decay and momentum to those that had one), as with torch. Local."""
        for r in self.dtensor_records:
            if r.dtensor is not None:
                r.dtensor.grad = None  # its gradient lives in the stand-in's (see core._dtensor)
        self.held.forget(self.records)
        for r in flagged(self.records, "replaced"):
            r.mark_replaced(False)
        if set_to_none:  # (one pass each: this runs over every parameter at every step)
            for r in self.records:
                r.zeroed()
            if not self.store.keeps_views:
                for p in column(self.records, "param"):
                    p.grad = None
        else:
            for r in self.records:
                r.place(GradSlot.OWN)
                g = r.param.grad
                if g is not None and not is_placeholder(g):
                    if not self.store.is_storage(r, g):
                        # A gradient no round took yet (there when the optimizer was built, or assigned
                        # by hand): a zero one stays, though stage 1's view replaces the tensor below.
                        r.got_gradient()
                    g.zero_()  # a real .grad (16-bit accumulation aside) is zeroed in place
            if not self.store.keeps_views:
                for r in self.records:
                    p = r.param
                    if not r.used or not is_placeholder(p.grad):
                        continue
                    ph = cast(GradPlaceholder, r.placeholder)  # every record has one (see __init__)
                    ph.zeroed, ph.pending = False, None
                    r.place(GradSlot.PLACEHOLDER)  # a zero gradient that is still there
        self.store.zero()
        self.accum = None
        self.stepped()

    def release(self, scale: float, stepped_at: float) -> None:
        """This optimizer no longer trains the parameters (closed, superseded by a new one, or
        collected): leave ``p.grad`` as torch would hold it, for a new optimizer to step on (see
        _left_grads [Note: gradients left to the next optimizer]). A placeholder in ``p.grad`` is
        handed what holds the values it stands for. Stage 1: a parameter's view of the flat gradient
        stays ``p.grad`` where it holds a gradient (the parameter had one on this rank since its last
        zeroing, or the view is not zero: another rank's, averaged), else it stood for None and
        ``p.grad`` becomes None, so that a new optimizer does not take zeros for a gradient. A
        gradient an earlier optimizer left, still there untaken, stays with ``take_left``'s tag. Either
        says how the gradients were made (_left_grads [Note: the loss scale of left gradients]):
        ``scale``, the loss scale ``opt.backward`` applies now; ``stepped_at``, the one the last step
        divided out. Local; the first call acts."""
        if self.released:
            return
        self.released = True
        made = LeftScale.of(self.scaled_backwards, self.carried_backwards, self.unscaled_backwards, scale, stepped_at)
        left = None
        for r in self.records:
            g = r.param.grad
            if is_placeholder(g):
                left = left or self.store.left(self.accum, made)
                cast(GradPlaceholder, g).leave(left, r.index, r.used)
            elif self.store.keeps_views and not r.used and r.holds() is Holds.VIEW and not bool(cast(Tensor, g).any()):
                r.param.grad = None
            elif self.store.keeps_views and r.holds() is Holds.VIEW:
                tag_left(cast(Tensor, g), made)
        for r in self.dtensor_records:  # where torch holds a DTensor parameter's gradient (see core._dtensor)
            if r.dtensor is not None:
                leave_grad(r.dtensor, r.param)

    def inherit(self, made: LeftScale) -> None:
        """Gradients an earlier optimizer left in ``p.grad``, brought to this optimizer's loss scale
        at its construction, count as the backward passes that made them (see _left_grads [Note:
        the loss scale of left gradients]): ``made`` says how. Local."""
        self.scaled_backwards += made.scaled
        self.carried_backwards += made.carried
        self.unscaled_backwards += made.unscaled

    def stepped(self) -> None:
        """Forget how the backward passes since the last step were scaled and the time spent looking
        for zeroed gradients (read ``check_seconds`` first). Local."""
        self.scaled_backwards = self.carried_backwards = self.unscaled_backwards = 0
        self.check_seconds = 0.0

    @property
    def grad_bytes(self) -> int:
        return self.store.nbytes
