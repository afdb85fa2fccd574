"""The first backward's gradients that come after their bucket was reduced without them.

Owned by one ``GradReducer``: the gradients that came anyway for parameters counted as reduced
without one (``ParamState.UNSHOWN``), and the one extra reduction of their buckets. ``_rounds``
decides when (``GradReducer.count_unshown`` while following rank 0's announcements, ``make_up``
at the end of the learning round, for the buckets one all-reduce names).

[Note: a gradient after its bucket]
In the learning round a rank may reduce a bucket without parameters that the backward pass does
not show (``count_unshown``). A reentrant checkpoint can still give one of them a gradient, in a
pass nested in that one. That gradient is kept (``keep``; such a parameter's ``.grad`` is set to
None after the launch and after each such gradient, so that each arrives as a tensor of its own,
since another nested pass may add one more; stage 1 points ``.grad`` back at its view when the
round ends). At the end of the round one all-reduce tells every rank which buckets got such
gradients anywhere, and ``make_up`` reduces each of those once more: stage 2 with only the late
gradients in a bucket-sized buffer (zeros elsewhere, and on ranks without any), added to the
shard; stage 1 by adding them to the averaged bucket, equal on every rank, and averaging it
again, without a buffer. Either way: the sum of every rank's gradient, rounded once more in the
gradient dtype. From the second round on the question is asked only when this rank has seen no
nested pass, and a gradient after its bucket is an error (``GradReducer._refuse``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from shardopt._collectives import Pending


class LateGradients:
    """The late gradients of one reducer's flat buffer in the learning round."""

    def __init__(self, reducer: Any) -> None:
        self._r = reducer  # the GradReducer it belongs to (only its public attributes are read)
        self._grads: dict[int, Tensor] = {}  # the gradients that came for them, until make_up
        self._buffers: dict[int, Tensor] = {}  # stage 2: make_up buffers in flight, by bucket

    def keep(self, index: int, grad: Tensor | None) -> None:
        """Parameter ``index`` got ``grad`` after its bucket was reduced without it. Local."""
        if grad is not None:
            prev = self._grads.get(index)
            self._grads[index] = grad if prev is None else prev + grad

    def buckets(self) -> list[int]:
        """Buckets holding a kept gradient. Local."""
        return sorted({self._r.bucket_of(i) for i in self._grads})

    @property
    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._grads.values()) if self._grads else 0

    @property
    def buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values()) if self._buffers else 0

    def make_up(self, b: int) -> tuple[list[Callable[[], Pending]], Callable[[], None] | None]:
        """Bucket ``b`` once more, with only the kept gradients: (the functions that issue the
        reduction, what adds it to the gradient once it landed). Every rank, for the same buckets
        in the same order."""
        r = self._r
        bucket = r.flat.layout.buckets[b]
        late = [(i, self._grads.pop(i)) for i in bucket.params if i in self._grads]
        if r.stage == 1:
            for i, g in late:
                r.flat.param_view(r.flat_grad, i).add_(g)
            return r.comm.all_reduce_parts(r.flat_grad[bucket.global_range.as_slice()], r.pieces[b],
                                           r.reduce_dtype), None
        buf = torch.zeros(bucket.global_range.size, dtype=r.flat.dtype, device=r.flat.device)
        for i, g in late:
            buf[r.in_bucket(i)].copy_(g.reshape(-1))
        self._buffers[b] = buf
        r.note_buffers()
        dest = r.shard_part(b)
        out = torch.empty_like(dest, dtype=r.reduce_dtype or dest.dtype)
        parts = r.comm.reduce_scatter_parts(out, buf, r.pieces[b])

        def after() -> None:
            dest.add_(out)
            self._buffers.pop(b, None)
        return parts, after

    def end_round(self, unshown: list[int]) -> None:
        """The round ended: stage 1 points ``.grad`` of the ``unshown`` parameters (counted without
        a gradient) back at their view, which holds the reduced value. Local."""
        assert not self._grads, "late gradients left behind after a round"
        r = self._r
        if r.stage == 1:
            for i in unshown:
                try:
                    r.flat.params[i].grad = r.flat.param_view(r.flat_grad, i)
                except RuntimeError:
                    pass  # converted after construction: reported by the binding check
