"""Flat parameter buffers: one 1-D tensor per (dtype, device) whose slices back the model's parameters.

After :class:`FlatParams` is built, every parameter's ``.data`` is a view into ``FlatParams.data``,
so writing the flat buffer (e.g. the all-gather after an update) changes the model with no copy.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from shardopt.core._dtensor import rewrap
from shardopt.core._layout import FlatLayout, Range


class FlatParams:
    """Parameters of one dtype and device packed into one padded flat buffer."""

    data: Tensor  # 1D, param dtype, layout.numel elements; every param's .data is a view into it

    def __init__(self, params: Sequence[torch.nn.Parameter], layout: FlatLayout,
                 dtensors: Sequence[Tensor | None] | None = None) -> None:
        """``dtensors``: the DTensor parameter each of ``params`` stands in for (or None), rebuilt
        over the same view (see core._dtensor [Note: DTensor parameters])."""
        if len(params) != len(layout.params):
            raise AssertionError(f"a flat buffer of {len(params)} parameters laid out for {len(layout.params)}")
        self.params = list(params)
        self.layout = layout
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.data = torch.zeros(layout.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p, span in zip(self.params, layout.params):
                view = self.data[span.global_range.as_slice()].view(span.shape)
                view.copy_(p.detach())
                p.data = view
        for dt, p in zip(dtensors or [], self.params):
            if dt is not None:
                rewrap(dt, p.data)

    def param_view(self, flat: Tensor, index: int) -> Tensor:
        """Parameter ``index``'s slice of any flat tensor laid out like this buffer, shaped."""
        span = self.layout.params[index]
        return flat[span.global_range.as_slice()].view(span.shape)

    def slice(self, r: Range) -> Tensor:
        """A 1-D view of the buffer over global range ``r``."""
        return self.data[r.as_slice()]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def set_grad(param: Tensor, grad: Tensor | None) -> bool:
    """``param.grad = grad``; False where torch refuses it because the parameter was converted or
    replaced after the optimizer was built (another dtype or device): dropped here so that a
    backward on one rank is not stopped, and reported by the binding check at step() on every rank."""
    try:
        param.grad = grad
        return True
    except RuntimeError:
        return False
