"""The weight all-gathers that step() started and nobody has waited for yet.

step() starts one all-gather per bucket as soon as that bucket's part of the shard is updated (see
``ShardedBuffer.update``). Without ``overlap_param_gather`` it waits for all of them before it
returns; with it, the next forward, or the first torch call that reads or writes a weight still in
flight, waits bucket by bucket (see ``_gather_wait``). Either way each gather is waited for exactly
once, here, under a lock: a thread that asks for a bucket another thread is waiting for returns
once it has landed.

[Note: storage torch will not show]
``touching`` and ``touching_storage`` look at a tensor's memory. A tensor without storage (sparse,
MKL-DNN, a ``torch.vmap`` batched tensor, a ``torch.func`` wrapper) is told by
``torch._C._has_storage`` and waits for every bucket in flight. Some tensors have storage whose
address torch refuses to hand out, and torch has no question to ask first, so the refusal is
caught: a FunctionalTensor or FakeTensor while tracing, an output of a CUDA graph that a later
replay overwrote, and, for ``untyped_storage()``, a wrapper subclass (DTensor, the stage-2
gradient placeholder: a storage of some bytes without data). They wait for every bucket too.
"""
from __future__ import annotations

import threading
from typing import Callable, Iterator, Sequence, cast

import torch
from torch import Tensor

from shardopt.comm._collectives import Pending
from shardopt.core._records import BucketRecord, ParamRecord
from shardopt.core._ranges import GATHER_WAIT, bucket_range


class WeightGathers:
    """The gathers in flight of one optimizer: each bucket record holds its own (``gather``); this
    keeps the order they were started in. Local: the collectives were issued by step() on every
    rank; waiting is each rank's own, from any thread."""

    def __init__(self, on_landed: Callable[[BucketRecord, bool], None], record_of: dict[int, ParamRecord],
                 flats: Sequence[Tensor]) -> None:
        self._on_landed = on_landed  # told each waited gather's bucket, and whether it arrived (False: the wait raised)
        # Buckets whose gather is in flight, in the order started: replaced, never changed in place, so
        # a thread may go through it while another waits (a bucket leaves it once its gather landed).
        self._started: tuple[BucketRecord, ...] = ()
        self.record_of = record_of  # id(param) -> its record, for every trained parameter (the optimizer's one index)
        # Each flat buffer's bytes (first, one past the last) and element size, by buffer index: the
        # memory the gathers write, for touching(). A flat buffer is allocated once and never moves.
        self._memory = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size(), f.element_size()) for f in flats]
        self.dtypes = frozenset(f.dtype for f in flats)  # the weights' dtypes (see _gather_wait [Note: compiled models])
        self._lock = threading.RLock()  # held while a gather is waited for (RLock: a landing may look again)

    def started(self, bucket: BucketRecord, pending: Pending) -> None:
        """The gather of ``bucket`` was issued (a bucket still in flight keeps its place, with the new handle)."""
        with self._lock:
            if bucket.gathering(pending) is None:
                self._started += (bucket,)

    def wait(self, bucket: BucketRecord) -> bool:
        """Wait for the gather of ``bucket`` if it is in flight; True if it was. The bucket counts as
        in flight until its gather has landed: another thread asking for it meanwhile waits here.
        The landing is shardopt's own work (its profiler range, ``on_landed``): it runs with torch
        functions off, so that no torch function mode sees it, the read guard of comm._gather_wait
        included, whose look at every call would otherwise be paid for each of them."""
        with self._lock, torch._C.DisableTorchFunction():
            pending = bucket.gather
            if pending is None:
                return False
            arrived = False
            try:
                with bucket_range(GATHER_WAIT, bucket):  # see core._ranges [Note: profiler ranges]
                    pending.wait()
                arrived = True
            finally:  # waited once, also when the wait raised
                bucket.gathering(None)
                # the first, as a rule (the forward waits in the order step() started them): O(1) to find
                at = next((i for i, b in enumerate(self._started) if b is bucket), len(self._started))
                self._started = self._started[:at] + self._started[at + 1:]
                self._on_landed(bucket, arrived)
            return True

    def finish(self) -> None:
        """Wait for every gather in flight, in the order they were started."""
        for bucket in self._started:
            self.wait(bucket)

    def wait_quietly(self) -> None:
        """Wait for every gather without telling anyone (an optimizer being collected)."""
        with self._lock:
            for bucket in self._started:
                cast(Pending, bucket.gathering(None)).wait()  # a started bucket holds its gather
            self._started = ()

    def touching(self, t: Tensor) -> list[BucketRecord]:
        """The buckets in flight whose memory ``t`` may read or write: the bucket of a trained
        parameter, or those a view of a flat buffer overlaps (``p.data``, ``p.detach()``, a slice,
        ``flat[a:b]``); every bucket in flight for a tensor without a data pointer (a wrapper
        subclass: it may hold one). A question. Local."""
        r = self.record_of.get(id(t))
        if r is not None:
            return [r.bucket] if r.bucket.gather is not None else []
        if not torch._C._has_storage(t):  # no storage of its own to look at (sparse, MKL-DNN, vmap's, torch.func's)
            return list(self._started)
        try:
            first = t.data_ptr()
        except (RuntimeError, NotImplementedError):  # see [Note: storage torch will not show]
            return list(self._started)
        for i, (lo, hi, size) in enumerate(self._memory):
            if lo <= first < hi and t.numel():  # a view of flat buffer i (no view starts before its storage)
                end = first + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
                return self._between(i, lo, size, first, end)
        return []

    def touching_storage(self, t: Tensor) -> list[BucketRecord]:
        """The buckets in flight in the whole storage of ``t`` (what ``t.untyped_storage()`` hands
        out: for a weight, its whole flat buffer); as ``touching`` for a tensor without one. A
        question. Local."""
        if not torch._C._has_storage(t):  # as in touching
            return list(self._started)
        try:
            storage = t.untyped_storage()
            first = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # see [Note: storage torch will not show]
            return list(self._started)
        for i, (lo, hi, size) in enumerate(self._memory):
            if lo <= first < hi:  # flat buffer i's storage (a flat buffer is an allocation of its own)
                return self._between(i, lo, size, first, first + storage.nbytes())
        return []

    def _between(self, i: int, lo: int, size: int, first: int, end: int) -> list[BucketRecord]:
        """The buckets in flight of flat buffer ``i`` (its first byte ``lo``, its element size
        ``size``) with memory in the bytes [first, end)."""
        return [b for b in self._started if b.buffer == i
                and first < lo + b.global_range.end * size and lo + b.global_range.start * size < end]

    def handles(self) -> list[Pending]:
        """The handles in flight (for tests that check they were waited for)."""
        return [cast(Pending, b.gather) for b in self._started]  # each started bucket holds its Pending

    def __iter__(self) -> Iterator[BucketRecord]:
        return iter(self._started)

    def __bool__(self) -> bool:
        return bool(self._started)
