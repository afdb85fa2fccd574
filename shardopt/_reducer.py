"""Gradient storage and its reduction over ranks, bucket by bucket, while backward runs.

Owns: where gradients live (stage 1: a full flat gradient buffer whose slices are the
parameters' ``.grad``; stage 2: only this rank's shard plus short-lived bucket staging), the
post-accumulate-grad hooks that fill buckets, and the order in which bucket collectives are
launched. It knows the layout and calls :mod:`shardopt._collectives`; it does no optimizer math.

When buckets are reduced, and in which order, is decided by ``_rounds`` (see ``_rounds``
[Note: launch order]); this module stages a bucket and issues its collective when asked. Several
rounds between two steps accumulate correctly: stage 1 averages the accumulated buffer again (the
part averaged before is equal on every rank, so averaging it again is exact), stage 2 adds each
round's averaged shard into the gradient shard.

[Note: what the reducer knows about each parameter's gradient]
Torch semantics decide whether a parameter is updated and whether a backward adds to or replaces
the gradient: ``used[i]`` says that parameter ``i`` got a gradient on this rank since its
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
from typing import Callable

import torch
from torch import Tensor

from shardopt._collectives import Comm, Pending
from shardopt._flat import FlatParams
from shardopt._grad_placeholder import GradPlaceholder
from shardopt._held_bytes import HeldBytes
from shardopt._layout import Range

class ParamState(enum.Enum):
    """Where one parameter's gradient is in the open round; ``end_round`` sets every one WAITING."""

    WAITING = "waiting"  # nothing taken in this round yet
    TAKEN = "taken"  # its gradient (or zero) is in its bucket; another one in this round is a second gradient
    ABSENT = "absent"  # this backward pass will not reach it: counted in at once; a gradient for it is refused


class GradReducer:
    """Reduces the gradients of one :class:`FlatParams` buffer over ``comm``'s ranks."""

    flat_grad: Tensor | None  # stage 1: 1D, grad dtype, the whole padded buffer; params' .grad view it
    grad_shard: Tensor | None  # stage 2: 1D, grad dtype, this rank's shard of the averaged gradient

    accum: Tensor | None  # 1D fp32, whole buffer: gradients accumulated under no_sync (16-bit params only)
    accum_shard: Tensor | None  # stage 2, 1D fp32, this rank's shard: the sum of several rounds since zero_grad

    def __init__(self, flat: FlatParams, comm: Comm, stage: int, accumulate_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None) -> None:
        self.flat, self.comm, self.stage = flat, comm, stage
        # Reductions sum in the gradient dtype unless reduce_dtype (e.g. fp32) asks for more precision:
        # the wire still carries the gradient dtype; the local sum runs in reduce_dtype and is rounded
        # once, after averaging (see _collectives [Note: deterministic reduction]).
        self.reduce_dtype = reduce_dtype if reduce_dtype not in (None, flat.dtype) else None
        # [Note: accumulation dtype] autograd accumulates .grad in the parameter's dtype; summing
        # many bf16 micro-batch gradients in bf16 loses their low bits. Under no_sync each new
        # gradient is moved into an fp32 buffer instead (allocated only while accumulating), and
        # rounded to the gradient dtype once, when the last micro-batch is reduced.
        self.accumulate_dtype = accumulate_dtype if accumulate_dtype not in (None, flat.dtype) else None
        self.accum = None
        # [Note: accumulating in the shard] Several backward passes between two steps without
        # no_sync reduce every micro-batch. In stage 2 the averaged micro-batch gradients are then
        # summed in an fp32 shard (accumulate_dtype, allocated at the second round: 4/N B/param)
        # (each average arrives in the gradient dtype; the sum is kept in fp32) and rounded to the
        # gradient dtype once, when the step reads them: no unsharded copy of
        # the gradient exists at any time, for one reduction per micro-batch instead of one.
        self.accum_shard = None
        self._accum_dirty = False  # accum_shard holds a sum not yet rounded into grad_shard
        self.shard_accumulated = False  # accum_shard was allocated since the peaks were reset
        layout = flat.layout
        self.shard = layout.shard_range(comm.shard_rank)
        self._bucket_of = [0] * len(layout.params)
        for b in layout.buckets:
            for i in b.params:
                self._bucket_of[i] = b.index
        self._bucket_size = [len(b.params) for b in layout.buckets]
        # Per bucket: each rank's piece relative to the bucket start (what its collectives cut), and
        # this rank's piece relative to the shard start.
        self.pieces = [
            [r.relative_to(b.global_range.start) if r.size else Range(0, 0) for r in layout.bucket_shard_ranges(b.index)]
            for b in layout.buckets
        ]
        local = [layout.bucket_shard_ranges(b.index)[comm.shard_rank] for b in layout.buckets]
        self._in_shard = [r.relative_to(self.shard.start) if r.size else Range(0, 0) for r in local]
        self.flat_grad = self.grad_shard = None
        n = len(flat.params)
        # Per parameter: got a gradient on this rank since last zeroed (see [Note: what the reducer knows ...]).
        self.used = [False] * n
        # Backward passes since the last step that ran inside opt.backward (scaled) or not.
        self.scaled_backwards = self.unscaled_backwards = 0
        self.backward_scaled = False  # set by the optimizer while opt.backward runs
        self.check_seconds = 0.0  # time spent tracking zeroing (placeholders, observe_zeroing), seconds
        # p.grad holds its placeholder: stage 2 after a round, either stage while a 16-bit gradient
        # is summed in the fp32 accumulation buffer under no_sync.
        self._placeholders = [GradPlaceholder(p) for p in flat.params]
        self._placed = [False] * n
        self.replaced: list[int] = []  # stage 2: p.grad replaced by a tensor after backward (see observe_zeroing)
        if stage == 1:
            self.flat_grad = torch.zeros_like(flat.data)
            for i, p in enumerate(flat.params):
                p.grad = flat.param_view(self.flat_grad, i)
            self._view_ptr = [p.grad.data_ptr() for p in flat.params]
        else:
            self.grad_shard = torch.zeros(layout.shard_numel, dtype=flat.dtype, device=flat.device)
            self._piece_of = layout.local_ranges(comm.shard_rank)  # this rank's part of each parameter in grad_shard
        self.held = HeldBytes(self.grad_bytes, self._buffer_bytes)  # see _held_bytes
        self.accumulated = False  # the no_sync fp32 sum was allocated since the peaks were reset
        self.arrival: list[int] = []  # parameters in the order their gradients arrived in the first round
        self._arrived: set[int] = set()  # those of ``arrival``
        self._staging: dict[int, Tensor] = {}
        self._fresh = True  # stage 2: no reduction landed in grad_shard since zero_grad
        self.order: list[int] | None = None  # this buffer's buckets in the agreed launch order (set by _rounds)
        self.state = [ParamState.WAITING] * n  # per parameter, in the open round
        self._launched: set[int] = set()  # buckets launched in the open round
        with torch.enable_grad():  # each parameter's gradient accumulator: which ones a backward pass reaches
            self._accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in flat.params]
        self._nested = [False] * n  # got a gradient in a nested backward pass (reentrant checkpoint) once
        self._gradless = [False] * n  # used only in forwards without gradients (see note_forward_use)
        self.problems: list[str] = []  # gradients that could not be reduced: reported at the next step
        self.names = [f"#{i}" for i in range(n)]  # how messages call each parameter (set by the optimizer)

    # -- what _rounds asks of a reducer ----------------------------------------------------
    @property
    def num_buckets(self) -> int:
        return len(self._bucket_size)

    def bucket_size(self, b: int) -> int:
        """Parameters in bucket ``b``."""
        return self._bucket_size[b]

    def unreached(self) -> list[int]:
        """When a round opens inside a backward pass: the bucket of each parameter that pass will
        not reach (one entry per parameter), which the round counts as ready at once. Local."""
        out = []
        will_run = torch._C._will_engine_execute_node
        for i, acc in enumerate(self._accumulators):
            if not self._nested[i] and not will_run(acc):
                self.state[i] = ParamState.ABSENT  # WAITING -> ABSENT: the round opened, the pass will not reach it
                out.append(self._bucket_of[i])
        return out

    def may_nest(self, b: int) -> bool:
        """Some parameter of bucket ``b`` was used only inside reentrant checkpoints: its gradients
        may come from several nested backward passes, so the bucket waits for the end of the outer
        one. Local."""
        return any(self._gradless[i] for i in self.flat.layout.buckets[b].params)

    def note_forward_use(self, gradless: list[bool]) -> None:
        """Before the first round: the parameters used only in forwards without gradients (see
        _rounds [Note: launch order]); they are never counted ahead either. Local."""
        self._gradless = list(gradless)
        self._nested = [n or g for n, g in zip(self._nested, gradless)]

    def begin_backward(self) -> None:
        """A backward pass starts: note how it was scaled and what was zeroed since the last. Local."""
        if self.backward_scaled:
            self.scaled_backwards += 1
        else:
            self.unscaled_backwards += 1
        start = time.perf_counter()
        self.observe_zeroing()
        self.check_seconds += time.perf_counter() - start

    def _observe_views(self) -> bool:
        """Stage 1, before a step: ``p.grad`` set to None makes that gradient zero (and absent);
        ``p.grad`` replaced by another tensor makes that tensor the gradient. True if any. Local."""
        changed = False
        placed, ptrs = self._placed, self._view_ptr
        for i, p in enumerate(self.flat.params):
            g = p.grad
            if not (placed[i] or (g is not None and g.data_ptr() == ptrs[i])):
                self._into_view(i, g)
                changed = True
        return changed

    def _into_view(self, index: int, grad: Tensor | None) -> None:
        """Stage 1: make parameter ``index``'s view of the flat gradient hold ``grad`` (None: no
        gradient) and point ``p.grad`` back at it. A parameter converted or replaced after the
        optimizer was built (see _binding) must not stop a backward on one rank only: its gradient
        is dropped here and step() reports the parameter on every rank."""
        view = self.flat.param_view(self.flat_grad, index)
        if grad is None:
            view.zero_()
            self.used[index] = False  # zeroed by p.grad = None and no gradient since
        elif grad.data_ptr() != self._view_ptr[index]:
            try:
                view.copy_(grad)  # .grad was reset to None or replaced: it holds the full sum
                self.used[index] = True
            except RuntimeError:
                view.zero_()
        try:
            self.flat.params[index].grad = view
        except RuntimeError:
            pass

    def observe_zeroing(self, *, at_step: bool = False) -> bool:
        """Restart from zero the gradient of every parameter whose placeholder was removed
        (``model.zero_grad()``, ``p.grad = None``) or zeroed since it was set; at a step, also
        follow stage 1's ``p.grad`` set to None or replaced. True if anything changed. In stage 2 a
        placeholder replaced by a tensor at a step cannot be reduced any more: its index goes to
        ``self.replaced`` for the step to report. Local."""
        changed = self._observe_views() if self.stage == 1 and at_step else False
        placed, used, phs = self._placed, self.used, self._placeholders
        if not any(placed) or (all(placed) and all(map(operator.is_, [p.grad for p in self.flat.params], phs))
                               and not any(ph.zeroed for ph in phs)):
            return changed  # the usual case: nothing zeroed since the placeholders were set
        cleared = []
        for i, (p, ph) in enumerate(zip(self.flat.params, self._placeholders)):
            if not placed[i]:
                continue  # no placeholder out: no gradient since zeroing, or autograd is accumulating one
            g = p.grad
            if g is ph:
                if not ph.zeroed:
                    continue
                ph.zeroed = False  # zero_(): a zero gradient that still counts as present
            else:  # removed (model.zero_grad()) or replaced by hand: the new value replaces the old
                placed[i] = False
                used[i] = g is not None
                if g is not None and at_step and self.stage == 2:
                    self.replaced.append(i)
            cleared.append(i)
        if not cleared:
            return changed
        if self.accum is not None:  # micro-batch gradients summed so far go too
            for i in cleared:
                self.flat.param_view(self.accum, i).zero_()
        if self.stage == 1:  # placed only while accumulating: the views were emptied into accum
            return True
        if len(cleared) == len(self.flat.params):
            self.accum_shard, self._accum_dirty = None, False
            if at_step:
                self.grad_shard.zero_()
            else:
                self._fresh = True  # the next reduction overwrites the whole shard
            return True
        for i in cleared:
            r = self._piece_of.get(i)
            if r is not None:
                self.grad_shard[r.as_slice()].zero_()
                if self.accum_shard is not None:
                    self.accum_shard[r.as_slice()].zero_()
        return True

    def arrive(self, index: int, param: Tensor, *, sync: bool, nested: bool, first: bool) -> bool:
        """Parameter ``index``'s gradient was accumulated into ``param.grad`` (from the scheduler's
        hook): take it into its bucket, or hold it (``no_sync``), or fold or refuse a second one.
        ``nested``: in a backward pass nested in the round's; ``first``: in the first round. True
        when its bucket has one more parameter in for this round. Local."""
        if nested:
            self._nested[index] = True
        state = self.state[index]
        if state is ParamState.ABSENT:  # ABSENT -> TAKEN or WAITING: refused below, as if never counted
            self._nested[index] = True  # never counted ahead again
            self.state[index] = ParamState.TAKEN if self._bucket_of[index] in self._launched else ParamState.WAITING
            if param.dtype != self.flat.dtype or param.device != self.flat.device:
                return False  # converted after construction (a new accumulator): reported at step() on every rank
            self._refuse(index, param,
                         f"parameter {self.names[index]} got its gradient in a backward "
                         "pass nested in another (torch.utils.checkpoint with use_reentrant=True) that the outer pass "
                         "did not show, after its bucket was reduced without it; use use_reentrant=False, or turn "
                         "checkpointing on before the first backward pass")
            return False
        self.used[index] = True
        grad = param.grad.pending if type(param.grad) is GradPlaceholder else param.grad
        own = grad is None or (self.stage == 1 and grad.data_ptr() == self._view_ptr[index])  # no new tensor
        self.held.produced(index, 0 if own else grad.numel() * grad.element_size(),
                           keep=not sync and self.accumulate_dtype is None)
        if not sync:
            if self.accumulate_dtype is not None:
                self._accumulate(index)
            return False
        if first and index not in self._arrived:
            self._arrived.add(index)
            self.arrival.append(index)
        if state is ParamState.TAKEN:  # a second gradient in one round: used inside and outside a reentrant checkpoint
            self._late(index, param)
            return False
        self._take(index)
        return True

    def _late(self, index: int, param: Tensor) -> None:
        """Parameter ``index`` got a second gradient in this round (autograd accumulated it twice, in
        an outer and a nested backward pass). Folded into its bucket if that is not reduced yet;
        otherwise it cannot be reduced any more: raise rather than drop it. Local."""
        b = self._bucket_of[index]
        if b not in self._launched:
            grad = param.grad
            if type(grad) is GradPlaceholder:
                grad, param.grad.pending = grad.pending, None
            if self.stage == 2 and grad is not None:
                self._staged(index).add_(grad.reshape(-1))
                param.grad = None
            return  # stage 1: autograd added it to the parameter's view of the flat gradient in place
        self._refuse(index, param,
                     f"parameter {self.names[index]} got a second gradient in one backward "
                     "pass (it is used both inside and outside a torch.utils.checkpoint with use_reentrant=True, or in "
                     "two such checkpoints) after its bucket was reduced; use use_reentrant=False")

    def _refuse(self, index: int, param: Tensor, message: str) -> None:
        """A gradient that can no longer be reduced: drop it and report ``message`` at the next step
        on every rank (raising here, in one rank's hook, would leave the others waiting)."""
        self.problems.append(message + "; the step was not taken")
        if self.stage == 2 or type(param.grad) is GradPlaceholder:
            param.grad = None

    def reset_peaks(self) -> None:
        """Restart the high-water marks from what is held now. Local."""
        self.held.reset()
        self.accumulated = self.accum is not None
        self.shard_accumulated = self.accum_shard is not None

    def _accumulate(self, index: int) -> None:
        self.held.taken()
        p = self.flat.params[index]
        grad = p.grad
        if type(grad) is GradPlaceholder:  # autograd added to a gradient held in the shard: keep it there
            grad, p.grad.pending = grad.pending, None
        if grad is None:
            return
        if self.accum is None:
            self.accum = torch.zeros(self.flat.layout.numel, dtype=self.accumulate_dtype, device=self.flat.device)
            self.accumulated = True
            self.held.buffers_grew()
        self.flat.param_view(self.accum, index).add_(grad)
        if self.stage == 1 and grad.data_ptr() == self._view_ptr[index]:
            grad.zero_()  # the view was the accumulation target; its content now sits in accum
        # The placeholder keeps model.zero_grad() and p.grad.zero_() visible while the sum sits in accum.
        ph = self._placeholders[index]
        ph.zeroed, ph.pending, ph.accumulating = False, None, True
        try:
            p.grad = ph
            self._placed[index] = True
        except RuntimeError:
            p.grad = None  # converted after construction: reported by the binding check

    def _take(self, index: int) -> None:
        """Move parameter ``index``'s accumulated ``.grad`` into the buffer being reduced."""
        state = self.state[index]
        if state is ParamState.TAKEN:
            return
        if state is ParamState.WAITING:
            self.state[index] = ParamState.TAKEN  # WAITING -> TAKEN: its gradient (or zero) goes into the bucket
        self.held.unkeep(index)
        p = self.flat.params[index]
        if p.grad is not None and p.grad.is_sparse:
            raise TypeError(f"parameter #{index} of shape {tuple(p.shape)} got a sparse gradient; ShardedAdamW "
                            "needs dense gradients (e.g. nn.Embedding(sparse=False))")
        if self.accum is not None:  # fold this round's gradient into the fp32 sum of earlier micro-batches
            self._accumulate(index)
            self._placed[index] = False
            try:
                p.grad = self.flat.param_view(self.accum, index).to(self.flat.dtype) if self.used[index] else None
            except RuntimeError:
                p.grad = None  # converted after construction: reported by the binding check
        grad = p.grad
        if type(grad) is GradPlaceholder:  # autograd added to it: the new part is pending, the rest in the shard
            grad, p.grad.pending = grad.pending, None
        if self.stage == 1:
            self._into_view(index, grad)
        elif grad is not None:
            try:
                self._staged(index).copy_(grad.reshape(-1))
            except RuntimeError:
                pass  # converted after construction: reported at step() on every rank (see _into_view)
            if p.grad is grad:
                p.grad = None
        self.held.taken()  # the .grad is gone (it was counted while the staging buffer was allocated)

    def _staged(self, index: int) -> Tensor:
        """Stage 2: parameter ``index``'s part of its bucket's staging buffer."""
        return self._staging_for(self._bucket_of[index])[self.in_bucket(index)]

    def shard_part(self, b: int) -> Tensor:
        """Stage 2: bucket ``b``'s part of this rank's gradient shard (a view; may be empty)."""
        return self.grad_shard[self._in_shard[b].as_slice()]

    def in_bucket(self, index: int) -> slice:
        """Where parameter ``index`` sits in a bucket-sized buffer of its bucket."""
        span = self.flat.layout.params[index].global_range
        start = span.start - self.flat.layout.buckets[self._bucket_of[index]].global_range.start
        return slice(start, start + span.size)

    def _staging_for(self, b: int) -> Tensor:
        if b not in self._staging:
            size = self.flat.layout.buckets[b].global_range.size
            self._staging[b] = torch.zeros(size, dtype=self.flat.dtype, device=self.flat.device)
            self.held.buffers_grew()
        return self._staging[b]

    def _buffer_bytes(self, comm: bool) -> int:
        """Staging, the fp32 sums and (``comm``) the Comm's receive buffers held now, bytes."""
        held = sum(t.numel() * t.element_size() for t in self._staging.values())
        held += self.comm.live_bytes if comm else 0
        held += self.accum_shard.numel() * self.accum_shard.element_size() if self.accum_shard is not None else 0
        return held + (self.accum.numel() * self.accum.element_size() if self.accum is not None else 0)

    def launch(self, b: int) -> tuple[list[Callable[[], Pending]], Callable[[], None] | None]:
        """Stage bucket ``b``: (the functions that issue its reduction, one collective each, to be
        called in order on every rank; what to run once the last landed)."""
        self._launched.add(b)
        for i in self.flat.layout.buckets[b].params:
            self._take(i)  # parameters without a gradient this round count as zero
        bucket = self.flat.layout.buckets[b].global_range
        if self.stage == 1:
            view = self.flat_grad[bucket.as_slice()]
            return self.comm.all_reduce_parts(view, self.pieces[b], self.reduce_dtype), None
        return self._launch_reduce_scatter(b)

    def _launch_reduce_scatter(self, b: int) -> tuple[list[Callable[[], Pending]], Callable[[], None] | None]:
        staging = self._staging_for(b)
        dest = self.shard_part(b)
        if self._fresh and self.reduce_dtype is None:
            out, after = dest, None
        elif not self._fresh and self.accumulate_dtype is not None:  # see [Note: accumulating in the shard]
            if self.accum_shard is None:
                self.accum_shard = self.grad_shard.to(self.accumulate_dtype)
                self.shard_accumulated = True
                self.held.buffers_grew()
            total = self.accum_shard[self._in_shard[b].as_slice()]
            out = torch.empty_like(dest, dtype=self.reduce_dtype or dest.dtype)

            def after() -> None:
                total.add_(out)
                self._accum_dirty = True
        else:
            out = torch.empty_like(dest, dtype=self.reduce_dtype or dest.dtype)
            after = (lambda: dest.copy_(out)) if self._fresh else (lambda: dest.add_(out))
        return self.comm.reduce_scatter_parts(out, staging, self.pieces[b]), after

    def landed(self, b: int) -> None:
        """Bucket ``b``'s reduction arrived: its staging goes."""
        self._staging.pop(b, None)

    def end_round(self) -> None:
        """Every bucket of this round was reduced: reset for the next. Local."""
        assert not self._staging, "staging left behind after a round"
        self._launched = set()
        self.accum = None
        self._fresh = False
        self.state = [ParamState.WAITING] * len(self.flat.params)  # any -> WAITING: the next round
        if self.stage == 2:
            start = time.perf_counter()
            placed = self._placed
            for i, (p, ph) in enumerate(zip(self.flat.params, self._placeholders)):
                ph.zeroed = ph.accumulating = False
                try:
                    p.grad = ph
                    placed[i] = True
                except RuntimeError:
                    pass  # converted after construction: reported by the binding check
            self.check_seconds += time.perf_counter() - start

    def bucket_of(self, index: int) -> int:
        """The bucket holding parameter ``index``."""
        return self._bucket_of[index]

    @property
    def forward_order(self) -> list[int]:
        """Buckets in the order the forward pass is expected to use them (reverse of gradient readiness)."""
        order = self.order if self.order is not None else list(range(len(self._bucket_size)))
        return order[::-1]

    # -- what the optimizer sees ---------------------------------------------------------
    def local_grad(self) -> Tensor:
        """This rank's shard of the averaged gradient (1D, grad dtype, shard_numel elements), once
        ``_rounds`` ran a round since ``zero_grad``. Local."""
        if self.stage == 1:
            return self.flat_grad[self.shard.as_slice()]
        if self._accum_dirty:  # rounded once from the fp32 sum of several rounds
            self.grad_shard.copy_(self.accum_shard)
            self._accum_dirty = False
        return self.grad_shard

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget all gradients (also any accumulated under ``no_sync``). With ``set_to_none`` the
        parameters then have no gradient (a step leaves them alone), else a zero one (a step still
        applies weight decay and momentum to those that had one), as with torch. Local."""
        self._placed = [False] * len(self._placed)
        self.held.forget()
        self.replaced = []
        if not set_to_none:
            for p in self.flat.params:  # a real .grad (16-bit accumulation aside) is zeroed in place
                if p.grad is not None and type(p.grad) is not GradPlaceholder:
                    p.grad.zero_()
        if self.stage == 1:
            self.flat_grad.zero_()
            for i, p in enumerate(self.flat.params):
                try:
                    p.grad = self.flat.param_view(self.flat_grad, i)
                except RuntimeError:
                    p.grad = None  # converted after construction: reported by the binding check
        else:
            for i, (p, ph) in enumerate(zip(self.flat.params, self._placeholders)):
                if set_to_none or not self.used[i] or type(p.grad) is not GradPlaceholder:
                    if set_to_none or type(p.grad) is GradPlaceholder:
                        p.grad = None
                    continue
                ph.zeroed, ph.pending, ph.accumulating = False, None, False
                self._placed[i] = True  # a zero gradient that is still there
            self._fresh = True  # the next round overwrites every element of grad_shard
        self.accum = None
        self.accum_shard, self._accum_dirty = None, False
        if set_to_none:
            self.used = [False] * len(self.used)
        self.stepped()

    def stepped(self) -> float:
        """Forget how the backward passes since the last step were scaled; returns and resets the
        time spent looking for zeroed gradients since then, seconds. Local."""
        self.scaled_backwards = self.unscaled_backwards = 0
        seconds, self.check_seconds = self.check_seconds, 0.0
        return seconds

    @property
    def grad_bytes(self) -> int:
        t = self.flat_grad if self.stage == 1 else self.grad_shard
        return t.numel() * t.element_size()
