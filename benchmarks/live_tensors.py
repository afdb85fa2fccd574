"""Bytes of every tensor reachable from Python, counted without asking any library: the walk the
memory benchmark and ``tests/test_peak_memory.py`` sample from gradient hooks on CPU."""
from __future__ import annotations

import gc
import weakref
from typing import Iterable

import torch


def _count(objects: Iterable[object], graph: bool, seen: set[int], by_dtype: dict | None = None) -> int:
    total = 0
    for o in objects:
        try:
            if not isinstance(o, torch.Tensor):
                continue
        except ReferenceError:  # a weakref.proxy whose object is gone
            continue
        if not graph and o.grad_fn is not None:
            continue
        for t in (o, o.grad if o.is_leaf else None):
            if t is None or t.device.type == "meta":
                continue
            try:
                s = t.untyped_storage()
                ptr, nbytes = s.data_ptr(), s.nbytes()
            except RuntimeError:  # no data of its own (a wrapper subclass: DTensor, a gradient placeholder)
                continue
            if nbytes and ptr not in seen:
                seen.add(ptr)
                total += nbytes
                if by_dtype is not None:
                    by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + nbytes
    return total


def live_bytes(graph: bool = True) -> int:
    """Bytes of every distinct storage reachable from Python: tensors and their ``.grad``.

    ``graph=False`` leaves out tensors that autograd produced (a ``grad_fn``: activations and the
    outputs saved for backward) unless a tensor counted shares their storage: what remains is
    weights, gradients, optimizer state and communication buffers. A tensor that only C++ still
    holds is counted too (its Python object lives as long as its storage): an input saved for
    backward, or the buffers of a finished gloo collective, which gloo's worker thread releases a
    moment after the collective completes."""
    return _count(gc.get_objects(), graph, set())


class LiveTensors:
    """The same count as :func:`live_bytes`, made cheap enough to sample often: the objects alive
    when it starts are frozen out of the collector (``gc.freeze``) and their tensors remembered by
    weak reference, so each count walks only those tensors plus the objects created since.
    Use as a context manager; it unfreezes on exit."""

    def __init__(self, graph: bool = True) -> None:
        self.graph = graph
        self._old: list[weakref.ref] = []

    def __enter__(self) -> "LiveTensors":
        gc.collect()
        for o in gc.get_objects():
            try:
                if isinstance(o, torch.Tensor):
                    self._old.append(weakref.ref(o))
            except (ReferenceError, TypeError):
                continue
        gc.freeze()
        return self

    def __exit__(self, *exc: object) -> None:
        gc.unfreeze()
        self._old = []

    def bytes(self) -> int:
        """Bytes of every distinct storage reachable from Python now (see :func:`live_bytes`)."""
        return self._walk(None)

    def bytes_by_dtype(self) -> dict[torch.dtype, int]:
        """The same count split by the dtype of the tensor each storage was first seen through."""
        by: dict[torch.dtype, int] = {}
        self._walk(by)
        return by

    def _walk(self, by_dtype: dict | None) -> int:
        seen: set[int] = set()
        old = (r() for r in self._old)
        alive = [t for t in old if t is not None]
        return _count(alive, self.graph, seen, by_dtype) + _count(gc.get_objects(), self.graph, seen, by_dtype)


def storage_bytes(tensors: Iterable[object]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped; a DTensor counts its local
    tensor, this rank's piece): a model's state on this rank, counted once however many views."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local") and hasattr(t, "placements"):  # a DTensor: this rank's piece
            t = t.to_local()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
