"""The launch order's guess: where each parameter is first used in the forward passes that come
before the first backward (see ``_rounds`` [Note: launch order]).

Owns a global module forward pre-hook, removed when the first round opens, that notes for each
trainable parameter, in its record, the position of its first use and whether its module ran its forward with
gradients disabled (as a reentrant checkpoint runs it). Local; no communication.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Sequence

import torch

from shardopt.core._ownership import owned_hook
from shardopt.core._records import BucketRecord, ParamRecord


class ForwardOrder:
    """First uses of the parameters of one optimizer, written into their records."""

    def __init__(self, record_of: dict[int, ParamRecord]) -> None:
        self._record_of = record_of  # id(param) -> its record: the optimizer's one index by parameter
        self._uses = 0
        ref = weakref.ref(self)  # the global hook must not keep the optimizer's state alive

        def hook(module: torch.nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():
                return  # traced into a compiled forward: no guess (the buffers' own order is used)
            order = ref()
            if order is not None:
                order.note(module)

        self._handle: Any = owned_hook(torch.nn.modules.module.register_module_forward_pre_hook(hook), ref)

    def note(self, module: torch.nn.Module) -> None:
        """``module`` is about to run its forward. Local."""
        grad = torch.is_grad_enabled()
        for p in module.parameters(recurse=False):
            r = self._record_of.get(id(p))
            if r is None:
                continue
            if r.used_in_forward(self._uses, grad):
                self._uses += 1

    def stop(self) -> None:
        """Remove the hook (idempotent). Local."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @staticmethod
    def bucket_order(buckets: Sequence[BucketRecord]) -> list[BucketRecord]:
        """``buckets`` (of every flat buffer) in the order backward is expected to complete them: a
        bucket is complete when its earliest-used parameter gets its gradient, and gradients come in
        the reverse of first use. Buckets with no parameter seen, or one seen only without gradients
        (``may_nest``: it may wait for the end of backward), come last, in buffer and index order.
        A question, once the records hold their first uses and ``gradless``. Local."""
        def key(b: BucketRecord) -> tuple[float, int, int]:
            if b.may_nest:
                return (math.inf, b.buffer, b.index)
            uses = [r.first_use for r in b.params if r.first_use is not None]
            return (-min(uses) if uses else math.inf, b.buffer, b.index)
        return sorted(buckets, key=key)
