"""Where one flat buffer's gradients live on this rank, and the collective that reduces a bucket
into them: one strategy per ZeRO stage.

- :class:`FlatGrads` (stage 1): the whole padded gradient buffer on every rank. Each parameter's
  ``.grad`` is a view of it, so autograd accumulates in place, and a bucket is all-reduced in place.
- :class:`ShardGrads` (stage 2): only this rank's shard of the averaged gradient. A bucket's
  gradients are copied into a short-lived staging buffer and reduce-scattered into the shard.

The reducer (``_reducer``) decides what goes in and when; a store only holds, stages and reduces.
It issues collectives through :mod:`shardopt.comm._collectives` and knows nothing of rounds.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from shardopt.comm._collectives import Comm, Pending
from shardopt.core._flat import FlatParams, set_grad

Launch = tuple[list[Callable[[], Pending]], Callable[[], None] | None]  # collectives to issue in order; then


class _Store:
    """What both stores share: the buffer, its ranks, how each bucket's reduction is cut."""

    keeps_views: bool  # p.grad is the store's own view between rounds (else a placeholder)
    accum_shard: Tensor | None = None  # see ShardGrads [Note: accumulating in the shard]
    shard_accumulated = False

    def __init__(self, flat: FlatParams, comm: Comm, reduce_dtype: torch.dtype | None) -> None:
        self.flat, self.comm, self.reduce_dtype = flat, comm, reduce_dtype
        self.pieces = [flat.layout.bucket_pieces(b.index) for b in flat.layout.buckets]  # per bucket, each rank's
        self.on_alloc: Callable[[], None] = lambda: None  # told when a buffer was allocated


class FlatGrads(_Store):
    """Stage 1: the whole gradient buffer; ``p.grad`` are views of it."""

    keeps_views = True

    def __init__(self, flat: FlatParams, comm: Comm, reduce_dtype: torch.dtype | None) -> None:
        super().__init__(flat, comm, reduce_dtype)
        self.flat_grad = torch.zeros_like(flat.data)  # 1D, grad dtype, the whole padded buffer
        for i, p in enumerate(flat.params):
            p.grad = flat.param_view(self.flat_grad, i)
        self._view_ptr = [p.grad.data_ptr() for p in flat.params]
        self._shard = flat.layout.shard_range(comm.shard_rank)

    @property
    def nbytes(self) -> int:
        return self.flat_grad.numel() * self.flat_grad.element_size()

    def is_storage(self, index: int, grad: Tensor | None) -> bool:
        """``grad`` is parameter ``index``'s own view of the buffer (autograd added to it in place)."""
        return grad is not None and grad.data_ptr() == self._view_ptr[index]

    def put(self, index: int, grad: Tensor | None) -> bool | None:
        """Make parameter ``index``'s view hold ``grad`` (None: no gradient) and point ``p.grad``
        back at it. Returns whether the parameter now has a gradient, or None if unchanged. A
        parameter converted or replaced after the optimizer was built (see _binding) must not stop
        a backward on one rank only: its gradient is dropped here and step() reports it on every rank."""
        view, used = self.flat.param_view(self.flat_grad, index), None
        if grad is None:
            view.zero_()
            used = False  # zeroed by p.grad = None and no gradient since
        elif not self.is_storage(index, grad):
            try:
                view.copy_(grad)  # .grad was reset to None or replaced: it holds the full sum
                used = True
            except RuntimeError:
                view.zero_()
        set_grad(self.flat.params[index], view)
        return used

    def changed_views(self, placed: Sequence[bool]) -> dict[int, bool | None]:
        """Before a step: follow ``p.grad`` set to None (that gradient is zero, and absent) or
        replaced by another tensor (that tensor is the gradient); by parameter, as ``put`` returns."""
        return {i: self.put(i, p.grad) for i, p in enumerate(self.flat.params)
                if not (placed[i] or self.is_storage(i, p.grad))}

    def add_late(self, index: int, grad: Tensor) -> None:
        """A second gradient in one round: autograd already added it to the view, in place."""

    def launch(self, b: int) -> Launch:
        view = self.flat_grad[self.flat.layout.buckets[b].global_range.as_slice()]
        return self.comm.all_reduce_parts(view, self.pieces[b], self.reduce_dtype), None

    def landed(self, b: int) -> None:
        pass

    def buffer_bytes(self) -> int:
        return 0

    def clear(self, cleared: Sequence[int], at_step: bool) -> None:
        """Gradients zeroed by hand: nothing to do here, a placeholder is out only while a 16-bit
        gradient is summed in fp32 and its view was emptied into that sum."""

    def end_round(self) -> None:
        pass

    def zero(self) -> None:
        self.flat_grad.zero_()
        for i, p in enumerate(self.flat.params):
            if not set_grad(p, self.flat.param_view(self.flat_grad, i)):
                p.grad = None

    def local_grad(self) -> Tensor:
        return self.flat_grad[self._shard.as_slice()]


class ShardGrads(_Store):
    """Stage 2: this rank's shard of the averaged gradient, and staging for buckets in flight.

    [Note: accumulating in the shard] Several backward passes between two steps without no_sync
    reduce every micro-batch. The averaged micro-batch gradients are then summed in an fp32 shard
    (``accumulate_dtype``, allocated at the second round: 4/N B/param; each average arrives in the
    gradient dtype) and rounded to the gradient dtype once, when the step reads them: no unsharded
    copy of the gradient exists at any time, for one reduction per micro-batch instead of one.
    """

    keeps_views = False

    def __init__(self, flat: FlatParams, comm: Comm, reduce_dtype: torch.dtype | None,
                 accumulate_dtype: torch.dtype | None) -> None:
        super().__init__(flat, comm, reduce_dtype)
        self.accumulate_dtype = accumulate_dtype
        layout = flat.layout
        self.grad_shard = torch.zeros(layout.shard_numel, dtype=flat.dtype, device=flat.device)  # 1D, grad dtype
        self.accum_shard = None  # 1D fp32: the sum of several rounds since zero_grad
        self._accum_dirty = False  # accum_shard holds a sum not yet rounded into grad_shard
        self.shard_accumulated = False  # accum_shard was allocated since the peaks were reset
        self._fresh = True  # no reduction landed in grad_shard since zero_grad
        self._piece_of = layout.local_ranges(comm.shard_rank)  # this rank's part of each parameter in grad_shard
        self._in_shard = layout.bucket_local_ranges(comm.shard_rank)  # per bucket, its part of grad_shard
        self._staging: dict[int, Tensor] = {}
        self._where = {}  # parameter -> (its bucket, where it sits in a bucket-sized buffer)
        for b in layout.buckets:
            for i in b.params:
                span = layout.params[i].global_range.relative_to(b.global_range.start)
                self._where[i] = (b.index, span.as_slice())

    @property
    def nbytes(self) -> int:
        return self.grad_shard.numel() * self.grad_shard.element_size()

    def is_storage(self, index: int, grad: Tensor | None) -> bool:
        return False

    def put(self, index: int, grad: Tensor | None) -> bool | None:
        """Copy parameter ``index``'s gradient into its bucket's staging buffer; ``p.grad`` goes."""
        if grad is not None:
            try:
                self._staged(index).copy_(grad.reshape(-1))
            except RuntimeError:
                pass  # converted after construction: reported at step() on every rank (see FlatGrads.put)
            p = self.flat.params[index]
            if p.grad is grad:
                p.grad = None
        return None

    def changed_views(self, placed: Sequence[bool]) -> dict[int, bool | None]:
        return {}

    def add_late(self, index: int, grad: Tensor) -> None:
        """A second gradient in one round, before its bucket was reduced: added to the staged one."""
        self._staged(index).add_(grad.reshape(-1))
        self.flat.params[index].grad = None

    def _staged(self, index: int) -> Tensor:
        b, where = self._where[index]
        return self._staging_for(b)[where]

    def _staging_for(self, b: int) -> Tensor:
        if b not in self._staging:
            size = self.flat.layout.buckets[b].global_range.size
            self._staging[b] = torch.zeros(size, dtype=self.flat.dtype, device=self.flat.device)
            self.on_alloc()
        return self._staging[b]

    def shard_part(self, b: int) -> Tensor:
        """Bucket ``b``'s part of this rank's gradient shard (a view; may be empty)."""
        return self.grad_shard[self._in_shard[b].as_slice()]

    def launch(self, b: int) -> Launch:
        staging = self._staging_for(b)
        dest = self.shard_part(b)
        if self._fresh and self.reduce_dtype is None:
            out, after = dest, None
        elif not self._fresh and self.accumulate_dtype is not None:  # see [Note: accumulating in the shard]
            if self.accum_shard is None:
                self.accum_shard = self.grad_shard.to(self.accumulate_dtype)
                self.shard_accumulated = True
                self.on_alloc()
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

    def buffer_bytes(self) -> int:
        """Staging and the fp32 sum of several rounds held now, bytes."""
        held = sum(t.numel() * t.element_size() for t in self._staging.values())
        return held + (self.accum_shard.numel() * self.accum_shard.element_size() if self.accum_shard is not None else 0)

    def clear(self, cleared: Sequence[int], at_step: bool) -> None:
        """Restart from zero the gradients of parameters ``cleared`` (zeroed by hand)."""
        if len(cleared) == len(self.flat.params):
            self.accum_shard, self._accum_dirty = None, False
            if at_step:
                self.grad_shard.zero_()
            else:
                self._fresh = True  # the next reduction overwrites the whole shard
            return
        for i in cleared:
            r = self._piece_of.get(i)
            if r is not None:
                self.grad_shard[r.as_slice()].zero_()
                if self.accum_shard is not None:
                    self.accum_shard[r.as_slice()].zero_()

    def end_round(self) -> None:
        assert not self._staging, "staging left behind after a round"
        self._fresh = False

    def zero(self) -> None:
        self._fresh = True  # the next round overwrites every element of grad_shard
        self.accum_shard, self._accum_dirty = None, False

    def local_grad(self) -> Tensor:
        if self._accum_dirty:  # rounded once from the fp32 sum of several rounds
            self.grad_shard.copy_(self.accum_shard)
            self._accum_dirty = False
        return self.grad_shard
