"""The weight all-gathers that step() started and nobody has waited for yet.

step() starts one all-gather per bucket as soon as that bucket's part of the shard is updated (see
``ShardedBuffer.update``). Without ``overlap_param_gather`` it waits for all of them before it
returns; with it, the next forward waits bucket by bucket (see ``_gather_wait``). Either way each
gather is waited for exactly once, here.
"""
from __future__ import annotations

from typing import Callable, Iterator, cast

from shardopt.comm._collectives import Pending
from shardopt.core._records import BucketRecord, ParamRecord
from shardopt.core._ranges import GATHER_WAIT, bucket_range


class WeightGathers:
    """The gathers in flight of one optimizer: each bucket record holds its own (``gather``); this
    keeps the order they were started in. Local: the collectives were issued by step() on every
    rank; waiting is each rank's own."""

    def __init__(self, on_landed: Callable[[BucketRecord], None], record_of: dict[int, ParamRecord]) -> None:
        self._on_landed = on_landed  # told each waited gather's bucket
        self._started: list[BucketRecord] = []  # buckets whose gather is in flight, in the order started
        self.record_of = record_of  # id(param) -> its record, for every trained parameter (the optimizer's one index)

    def started(self, bucket: BucketRecord, pending: Pending) -> None:
        """The gather of ``bucket`` was issued (a bucket still in flight keeps its place, with the new handle)."""
        if bucket.gathering(pending) is None:
            self._started.append(bucket)

    def wait(self, bucket: BucketRecord) -> bool:
        """Wait for the gather of ``bucket`` if it is in flight; True if it was."""
        pending = bucket.gathering(None)
        if pending is None:
            return False
        self._started.remove(bucket)
        with bucket_range(GATHER_WAIT, bucket):  # see core._ranges [Note: profiler ranges]
            pending.wait()
            self._on_landed(bucket)
        return True

    def finish(self) -> None:
        """Wait for every gather in flight, in the order they were started."""
        for bucket in list(self._started):
            self.wait(bucket)

    def wait_quietly(self) -> None:
        """Wait for every gather without telling anyone (an optimizer being collected)."""
        for bucket in self._started:
            cast(Pending, bucket.gathering(None)).wait()  # a started bucket holds its gather
        self._started.clear()

    def handles(self) -> list[Pending]:
        """The handles in flight (for tests that check they were waited for)."""
        return [cast(Pending, b.gather) for b in self._started]  # each started bucket holds its Pending

    def __iter__(self) -> Iterator[BucketRecord]:
        return iter(list(self._started))

    def __bool__(self) -> bool:
        return bool(self._started)
