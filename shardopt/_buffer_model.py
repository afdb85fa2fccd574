"""The one model of communication buffers, used by ``memory_report().predicted`` and by
``shardopt.estimate``: staging and receive buffers replayed bucket by bucket as ``_reducer`` and
``_rounds`` allocate and free them (see ``shardopt.estimate`` [Note: buffers estimate]).
"""
from __future__ import annotations

from typing import Sequence

from shardopt._layout import FlatLayout
from shardopt._rounds import MAX_INFLIGHT


def replay_buffers(layout: FlatLayout, rank: int, arrival: Sequence[int] | None, *, stage: int, gloo: bool,
                   psize: int) -> tuple[int, int]:
    """(peak bytes of communication buffers on ``rank`` over one backward pass whose gradients
    arrive in ``arrival`` order (buffer indices; None: buffer order; missing ones: at the end),
    the most bytes one bucket adds). ``psize``: bytes per gradient element."""
    numels = [b.global_range.size for b in layout.buckets]
    pieces = [layout.bucket_shard_ranges(b.index)[rank].size for b in layout.buckets]
    members = [b.params for b in layout.buckets]
    return _replay(numels, pieces, members, arrival, stage=stage, world_size=layout.world_size, psize=psize, gloo=gloo)


class _Buffers:
    """Staging and receive buffers on one rank, allocated and freed as ``GradReducer`` does."""

    def __init__(self, numels: Sequence[int], pieces: Sequence[int], *, stage: int, world_size: int, psize: int,
                 gloo: bool) -> None:
        self.staging_bytes = [n * psize if stage == 2 else 0 for n in numels]
        self.recv_bytes = [world_size * m * psize if gloo else 0 for m in pieces]  # pieces[b]: this rank's elements
        self.staging: dict[int, int] = {}
        self.inflight: list[int] = []
        self.live = self.peak = 0

    def _note(self) -> None:
        self.peak = max(self.peak, sum(self.staging.values()) + self.live)

    def fill(self, b: int) -> None:
        """A gradient of bucket ``b`` arrives: its staging buffer exists from now on (stage 2)."""
        if self.staging_bytes[b] and b not in self.staging:
            self.staging[b] = self.staging_bytes[b]
            self._note()

    def launch(self, b: int) -> None:
        self.fill(b)
        self.live += self.recv_bytes[b]
        self.inflight.append(b)
        self._note()
        while len(self.inflight) > MAX_INFLIGHT:
            self.complete()

    def complete(self) -> None:
        done = self.inflight.pop(0)
        self.live -= self.recv_bytes[done]
        self.staging.pop(done, None)


def _replay(numels: Sequence[int], pieces: Sequence[int], members: Sequence[Sequence[int]],
            arrival: Sequence[int] | None, **kw: int | bool) -> tuple[int, int]:
    """Peak bytes of communication buffers on one rank over a backward pass whose gradients arrive
    in ``arrival`` order (buffer indices; None: buffer order), each bucket launched once it is
    complete and every bucket that completed before it has been launched (the first pass follows
    rank 0's completions, later passes the order they learned), and the most one bucket holds."""
    buf = _Buffers(numels, pieces, **kw)
    bucket_of = {i: b for b, m in enumerate(members) for i in m}
    waiting = [len(m) for m in members]
    for i in dict.fromkeys(arrival if arrival is not None else sorted(bucket_of)):  # a repeat counts once
        b = bucket_of[i]
        buf.fill(b)
        waiting[b] -= 1
        if waiting[b] == 0:
            buf.launch(b)
    for b in range(len(numels)):  # buckets without parameters launch at the end
        if waiting[b] > 0 or not members[b]:
            buf.launch(b)
    while buf.inflight:
        buf.complete()
    slack = max((s + r for s, r in zip(buf.staging_bytes, buf.recv_bytes)), default=0)
    return buf.peak, slack
