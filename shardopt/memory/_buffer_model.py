"""The one model of communication buffers, used by ``memory_report().predicted`` and by
``shardopt.estimate``: staging buffers and cast copies replayed bucket by bucket as ``group._intake``
and ``group._rounds`` allocate and free them (see ``shardopt.estimate`` [Note: buffers estimate]).
A model of its own, from a layout alone (the estimate has no optimizer): its per-bucket tables
are the simulation's, not the optimizer's state, which lives in ``core._records``. The callers
pass the scheduler's ``max_inflight`` (``group._rounds.MAX_INFLIGHT``).
"""
from __future__ import annotations

from typing import Sequence

from shardopt.core._layout import FlatLayout


def replay_buffers(layout: FlatLayout, rank: int, arrival: Sequence[int] | None, *, stage: int, psize: int,
                   max_inflight: int, rank_order: bool, reduce_size: int = 0,
                   hybrid: bool = False) -> tuple[int, int]:
    """(peak bytes of communication buffers on shard rank ``rank`` over one backward pass whose
    gradients arrive in ``arrival`` order (buffer indices; None: buffer order; missing ones: at the
    end), the most bytes one bucket adds). ``psize``: bytes per gradient element; ``rank_order``:
    the comm's bucket path (see ``_bucket_paths`` [Note: the bucket paths]): a reduction is one
    handle of two all-to-alls, issued together, that receive the copies of this rank's piece from
    the ranks above and below it, held until the handle lands, and with ``hybrid`` its fp32
    partial sum until the cross-replica all-reduce lands; else (native) one collective that reads
    a cast copy of the bucket when ``reduce_size`` (bytes per element of ``reduce_dtype`` where it
    is not the gradient's) is not 0, the cross-replica all-reduce in place. ``max_inflight``
    counts collectives: a rank-order handle counts two."""
    numels = [b.global_range.size for b in layout.buckets]
    held: list[int]  # per bucket: the bytes its launch adds, held until its handle lands
    follows: list[int | None]  # per bucket: bytes its follow-up holds; None: no follow-up
    if rank_order:
        acc = max(psize, 4)  # the sum runs in fp32 (fp64 for fp64 gradients)
        held = [(layout.world_size - 1) * b.piece_numel * psize for b in layout.buckets]  # every other rank's copy
        follows = [acc * b.piece_numel if hybrid else None for b in layout.buckets]
    else:
        held = [n * reduce_size for n in numels]
        follows = [0 if hybrid else None for _ in numels]
    members = [b.params for b in layout.buckets]
    return _replay(numels, held, follows, members, arrival, stage=stage, psize=psize, max_inflight=max_inflight,
                   collectives=2 if rank_order else 1)


class _Buffers:
    """Staging and receive buffers on one rank, allocated and freed as a flat group (``GradIntake``) and
    ``Rounds`` do: one handle per bucket, the oldest waited while more than ``max_inflight``
    collectives of bucket handles are in flight (follow-ups not counted)."""

    def __init__(self, numels: Sequence[int], receives: Sequence[int], follows: Sequence[int | None], *,
                 stage: int, psize: int, max_inflight: int, collectives: int) -> None:
        self.max_inflight = max_inflight  # collectives in flight before the oldest handle is waited on
        self.collectives = collectives  # of one bucket's handle
        self.staging_bytes = [n * psize if stage == 2 else 0 for n in numels]
        self.recv_bytes = list(receives)  # per bucket: bytes its launch adds
        self.follows = follows
        self.staging: dict[int, int] = {}
        # oldest first: (bucket, bytes held, its collectives counted against max_inflight (0: a follow-up),
        # bytes of its follow-up or None)
        self.inflight: list[tuple[int, int, int, int | None]] = []
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
        self.inflight.append((b, self.recv_bytes[b], self.collectives, self.follows[b]))
        self._note()
        while sum(n for _, _, n, _ in self.inflight) > self.max_inflight:
            self.complete()

    def complete(self) -> None:
        b, nbytes, collectives, follow = self.inflight.pop(0)
        self.live -= nbytes
        if collectives:  # the bucket's own handle: its staging was read
            self.staging.pop(b, None)
        if follow is not None:  # the cross-replica all-reduce, to the back of the queue (see _rounds)
            self.live += follow
            self.inflight.append((b, follow, 0, None))


def _replay(numels: Sequence[int], receives: Sequence[int], follows: Sequence[int | None],
            members: Sequence[Sequence[int]], arrival: Sequence[int] | None, **kw: int) -> tuple[int, int]:
    """Peak bytes of communication buffers on one rank over a backward pass whose gradients arrive
    in ``arrival`` order (buffer indices; None: buffer order), each bucket launched once it is
    complete and every bucket that completed before it has been launched (the agreed order is a
    guess of this arrival order), and the most one bucket holds."""
    buf = _Buffers(numels, receives, follows, **kw)
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
    slack = max((s + r + (f or 0) for s, r, f in zip(buf.staging_bytes, buf.recv_bytes, follows)), default=0)
    return buf.peak, slack
