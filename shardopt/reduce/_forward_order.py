"""The launch order's guess: where each parameter is first used in the forward passes that come
before the first backward (see ``_rounds`` [Note: launch order]).

Owns a global module forward pre-hook, removed when the first round opens, that notes for each
trainable parameter the position of its first use and whether its module ran its forward with
gradients disabled (as a reentrant checkpoint runs it). Local; no communication.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Sequence

import torch

from shardopt.core._ownership import owned_hook


class ForwardOrder:
    """First uses of the parameters of one optimizer's flat buffers (one list per buffer)."""

    def __init__(self, params: Sequence[Sequence[torch.nn.Parameter]]) -> None:
        self._where = {id(p): (k, i) for k, ps in enumerate(params) for i, p in enumerate(ps)}
        self.first_use: list[list[int | None]] = [[None] * len(ps) for ps in params]  # per buffer and parameter
        self._without: list[list[bool]] = [[False] * len(ps) for ps in params]  # a forward ran without gradients
        self._with: list[list[bool]] = [[False] * len(ps) for ps in params]  # ... and with them
        self._uses = 0
        ref = weakref.ref(self)  # the global hook must not keep the optimizer's state alive

        def hook(module: torch.nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():
                return  # traced into a compiled forward: no guess (the buffers' own order is used)
            order = ref()
            if order is not None:
                order.note(module)

        self._handle: Any = torch.nn.modules.module.register_module_forward_pre_hook(owned_hook(hook, ref))

    def note(self, module: torch.nn.Module) -> None:
        """``module`` is about to run its forward. Local."""
        grad = torch.is_grad_enabled()
        for p in module.parameters(recurse=False):
            where = self._where.get(id(p))
            if where is None:
                continue
            k, i = where
            if self.first_use[k][i] is None:
                self.first_use[k][i] = self._uses
                self._uses += 1
            (self._with if grad else self._without)[k][i] = True

    def stop(self) -> None:
        """Remove the hook (idempotent). Local."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @property
    def gradless(self) -> list[list[bool]]:
        """Per buffer and parameter: used only in forwards that ran with gradients disabled, as
        inside a reentrant checkpoint, so its gradient may come from a nested backward pass."""
        return [[o and not w for o, w in zip(without, with_)] for without, with_ in zip(self._without, self._with)]

    def bucket_order(self, buckets: Sequence[Sequence[Sequence[int]]]) -> list[tuple[int, int]]:
        """(buffer, bucket) pairs in the order backward is expected to complete them, given each
        buffer's buckets as lists of parameter indices: a bucket is complete when its earliest-used
        parameter gets its gradient, and gradients come in the reverse of first use. Buckets with
        no parameter seen, or one seen only without gradients (which may wait for the end of
        backward), come last, in buffer and index order. Local."""
        gradless = self.gradless

        def key(kb: tuple[int, int]) -> tuple[float, int, int]:
            k, b = kb
            if any(gradless[k][i] for i in buckets[k][b]):
                return (math.inf, k, b)
            uses = [self.first_use[k][i] for i in buckets[k][b] if self.first_use[k][i] is not None]
            return (-min(uses) if uses else math.inf, k, b)
        return sorted(((k, b) for k, bs in enumerate(buckets) for b in range(len(bs))), key=key)
