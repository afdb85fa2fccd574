"""Bytes of every tensor reachable from Python, counted without asking any library: the walk the
memory benchmark and ``tests/test_peak_memory.py`` sample from gradient hooks on CPU."""
from __future__ import annotations

import gc

import torch


def live_bytes() -> int:
    """Bytes of every distinct storage reachable from Python: tensors and their ``.grad``."""
    seen, total = set(), 0
    for o in gc.get_objects():
        if not isinstance(o, torch.Tensor):
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
