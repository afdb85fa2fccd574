"""What each parameter's gradient is in the open round, and what goes into a bucket.

Told by the scheduler (``_rounds``, which owns the hooks and decides when buckets are reduced,
see its [Note: launch order]) that a gradient arrived, it takes the gradient into its bucket,
holds it (``no_sync``), folds or refuses a second one, and stages a bucket when asked. Where the
gradients live and which collective reduces a bucket is the stage's store (``_grad_store``:
stage 1 the whole flat gradient, stage 2 this rank's shard). It knows nothing of rounds. Several
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

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from shardopt.comm._collectives import Comm
from shardopt.core._compat import will_execute
from shardopt.core._flat import FlatParams, set_grad
from shardopt.reduce._grad_placeholder import GradPlaceholder
from shardopt.reduce._grad_store import FlatGrads, Launch, ShardGrads
from shardopt.reduce._held_bytes import HeldBytes

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

    def __init__(self, flat: FlatParams, comm: Comm, stage: int, accumulate_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None) -> None:
        self.flat, self.comm = flat, comm
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
        layout = flat.layout
        self._bucket_of = [0] * len(layout.params)
        for b in layout.buckets:
            for i in b.params:
                self._bucket_of[i] = b.index
        self._bucket_size = [len(b.params) for b in layout.buckets]
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
        self.store = (FlatGrads(flat, comm, self.reduce_dtype) if stage == 1 else
                      ShardGrads(flat, comm, self.reduce_dtype, self.accumulate_dtype))  # see _grad_store
        self.flat_grad = getattr(self.store, "flat_grad", None)
        self.grad_shard = getattr(self.store, "grad_shard", None)
        self.held = HeldBytes(self.store.nbytes, self._buffer_bytes)  # see _held_bytes
        self.store.on_alloc = self.held.buffers_grew
        self.accumulated = False  # the no_sync fp32 sum was allocated since the peaks were reset
        self.arrival: list[int] = []  # parameters in the order their gradients arrived in the first round
        self._arrived: set[int] = set()  # those of ``arrival``
        self.order: list[int] | None = None  # this buffer's buckets in the agreed launch order (set by _rounds)
        self.state = [ParamState.WAITING] * n  # per parameter, in the open round
        self._launched: set[int] = set()  # buckets launched in the open round
        # Each parameter's gradient accumulator (held, so autograd keeps using this one): which ones a
        # backward pass reaches.
        self._accumulators = [get_gradient_edge(p).node for p in flat.params]
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
        for i, acc in enumerate(self._accumulators):
            if not self._nested[i] and not will_execute(acc):
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

    def _put(self, index: int, grad: Tensor | None) -> None:
        """Hand ``grad`` (parameter ``index``'s whole gradient, or None) to the store."""
        used = self.store.put(index, grad)
        if used is not None:
            self.used[index] = used

    def observe_zeroing(self, *, at_step: bool = False) -> bool:
        """Restart from zero the gradient of every parameter whose placeholder was removed
        (``model.zero_grad()``, ``p.grad = None``) or zeroed since it was set; at a step, also
        follow stage 1's ``p.grad`` set to None or replaced. True if anything changed. In stage 2 a
        placeholder replaced by a tensor at a step cannot be reduced any more: its index goes to
        ``self.replaced`` for the step to report. Local."""
        changed = False
        if at_step:  # stage 1: p.grad set to None or replaced by another tensor than its view
            for i, used in self.store.changed_views(self._placed).items():
                changed = True
                if used is not None:
                    self.used[i] = used
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
                if g is not None and at_step and not self.store.keeps_views:
                    self.replaced.append(i)
            cleared.append(i)
        if not cleared:
            return changed
        if self.accum is not None:  # micro-batch gradients summed so far go too
            for i in cleared:
                self.flat.param_view(self.accum, i).zero_()
        self.store.clear(cleared, at_step)
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
        own = grad is None or self.store.is_storage(index, grad)  # no new tensor
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
            if grad is not None:
                self.store.add_late(index, grad)
            return
        self._refuse(index, param,
                     f"parameter {self.names[index]} got a second gradient in one backward "
                     "pass (it is used both inside and outside a torch.utils.checkpoint with use_reentrant=True, or in "
                     "two such checkpoints) after its bucket was reduced; use use_reentrant=False")

    def _refuse(self, index: int, param: Tensor, message: str) -> None:
        """A gradient that can no longer be reduced: drop it and report ``message`` at the next step
        on every rank (raising here, in one rank's hook, would leave the others waiting)."""
        self.problems.append(message + "; the step was not taken")
        if not self.store.keeps_views or type(param.grad) is GradPlaceholder:
            param.grad = None

    def reset_peaks(self) -> None:
        """Restart the high-water marks from what is held now. Local."""
        self.held.reset()
        self.accumulated = self.accum is not None
        self.store.shard_accumulated = self.store.accum_shard is not None

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
        if self.store.is_storage(index, grad):
            grad.zero_()  # the view was the accumulation target; its content now sits in accum
        # The placeholder keeps model.zero_grad() and p.grad.zero_() visible while the sum sits in accum.
        ph = self._placeholders[index]
        ph.zeroed, ph.pending, ph.accumulating = False, None, True
        self._placed[index] = set_grad(p, ph)
        if not self._placed[index]:
            p.grad = None

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
            if not set_grad(p, self.flat.param_view(self.accum, index).to(self.flat.dtype) if self.used[index] else None):
                p.grad = None
        grad = p.grad
        if type(grad) is GradPlaceholder:  # autograd added to it: the new part is pending, the rest in the shard
            grad, p.grad.pending = grad.pending, None
        self._put(index, grad)
        self.held.taken()  # the .grad is gone (it was counted while the staging buffer was allocated)

    def _buffer_bytes(self, comm: bool) -> int:
        """The store's buffers, the no_sync fp32 sum and (``comm``) the Comm's receive buffers held now, bytes."""
        held = self.store.buffer_bytes() + (self.comm.live_bytes if comm else 0)
        return held + (self.accum.numel() * self.accum.element_size() if self.accum is not None else 0)

    def launch(self, b: int) -> Launch:
        """Stage bucket ``b``: (the functions that issue its reduction, one collective each, to be
        called in order on every rank; what to run once the last landed)."""
        self._launched.add(b)
        for i in self.flat.layout.buckets[b].params:
            self._take(i)  # parameters without a gradient this round count as zero
        return self.store.launch(b)

    def landed(self, b: int) -> None:
        """Bucket ``b``'s reduction arrived."""
        self.store.landed(b)

    def end_round(self) -> None:
        """Every bucket of this round was reduced: reset for the next. Local."""
        self.store.end_round()
        self._launched = set()
        self.accum = None
        self.state = [ParamState.WAITING] * len(self.flat.params)  # any -> WAITING: the next round
        if not self.store.keeps_views:
            start = time.perf_counter()
            placed = self._placed
            for i, (p, ph) in enumerate(zip(self.flat.params, self._placeholders)):
                ph.zeroed = ph.accumulating = False
                if set_grad(p, ph):
                    placed[i] = True
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
        return self.store.local_grad()

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
        if not self.store.keeps_views:
            for i, (p, ph) in enumerate(zip(self.flat.params, self._placeholders)):
                if set_to_none or not self.used[i] or type(p.grad) is not GradPlaceholder:
                    if set_to_none or type(p.grad) is GradPlaceholder:
                        p.grad = None
                    continue
                ph.zeroed, ph.pending, ph.accumulating = False, None, False
                self._placed[i] = True  # a zero gradient that is still there
        self.store.zero()
        self.accum = None
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
        return self.store.nbytes
