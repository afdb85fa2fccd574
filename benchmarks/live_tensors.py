"""Bytes of every tensor reachable from Python, counted without asking any library: the walk the
memory benchmark and ``tests/test_peak_memory.py`` sample from gradient hooks on CPU."""
from __future__ import annotations

import gc
import sys
import weakref
from typing import Iterable

import torch


def _count(objects: Iterable[object], graph: bool, seen: set[int], only_gc: int = 0) -> int:
    """``only_gc``: the reference count of a tensor that nothing in Python refers to (only the
    list being walked); with ``graph=False`` such tensors are left out."""
    total = 0
    for o in objects:
        try:
            if not isinstance(o, torch.Tensor):
                continue
        except ReferenceError:  # a weakref.proxy whose object is gone
            continue
        if not graph and (o.grad_fn is not None or sys.getrefcount(o) <= only_gc):
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
    return total


def live_bytes(graph: bool = True) -> int:
    """Bytes of every distinct storage reachable from Python: tensors and their ``.grad``.

    ``graph=False`` leaves out tensors that autograd produced (a ``grad_fn``: activations and the
    outputs saved for backward) and tensors that only C++ still holds (an input saved for backward,
    the buffers of a finished collective that the backend has not released yet), unless a tensor
    counted shares their storage: what remains is weights, gradients, optimizer state and the
    communication buffers of collectives in flight."""
    return _count(gc.get_objects(), graph, set(), _unreferenced_count())


def _unreferenced_count() -> int:
    """The reference count ``_count`` sees for a tensor that only the walked sequence holds:
    measured on a probe walked the same way (its list's reference, the loop variable, the call)."""
    seen: list[int] = []
    for o in [torch.empty(1)]:
        seen.append(sys.getrefcount(o))
    return seen[0]


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
        seen: set[int] = set()
        old = (r() for r in self._old)
        only_gc = _unreferenced_count()
        alive = [t for t in old if t is not None]
        del old
        return _count(alive, self.graph, seen, only_gc) + _count(gc.get_objects(), self.graph, seen, only_gc)
