"""The weight all-gathers that step() started and nobody has waited for yet.

step() starts one all-gather per bucket as soon as that bucket's part of the shard is updated (see
``ShardedBuffer.update``). Without ``overlap_param_gather`` it waits for all of them before it
returns; with it, the next forward waits bucket by bucket (see ``_gather_wait``). Either way each
gather is waited for exactly once, here.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch

from shardopt.comm._collectives import Pending

Key = tuple[int, int]  # (flat buffer, bucket)


class WeightGathers:
    """The gathers in flight of one optimizer, by (buffer, bucket). Local: the collectives were
    issued by step() on every rank; waiting is each rank's own."""

    def __init__(self, bucket_params: Sequence[Callable[[int], list[torch.nn.Parameter]]],
                 on_landed: Callable[[Key, list[torch.nn.Parameter]], None], key_of: dict[int, Key]) -> None:
        self._bucket_params = list(bucket_params)  # per buffer: bucket -> its parameters
        self._on_landed = on_landed  # told each waited gather's key and parameters
        self._pending: dict[Key, Pending] = {}
        self.key_of = key_of  # id(param) -> its key, for every trained parameter

    def started(self, key: Key, pending: Pending) -> None:
        """The gather of ``key`` was issued."""
        self._pending[key] = pending

    def wait(self, key: Key) -> bool:
        """Wait for the gather of ``key`` if it is in flight; True if it was."""
        pending = self._pending.pop(key, None)
        if pending is None:
            return False
        pending.wait()
        self._on_landed(key, self._bucket_params[key[0]](key[1]))
        return True

    def finish(self) -> None:
        """Wait for every gather in flight, in the order they were started."""
        for key in list(self._pending):
            self.wait(key)

    def wait_quietly(self) -> None:
        """Wait for every gather without telling anyone (an optimizer being collected)."""
        for pending in self._pending.values():
            pending.wait()
        self._pending.clear()

    def handles(self) -> list[Pending]:
        """The handles in flight (for tests that check they were waited for)."""
        return list(self._pending.values())

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._pending))

    def __bool__(self) -> bool:
        return bool(self._pending)
