"""Backward passes as rounds of bucket reductions, over every flat buffer of one optimizer.

Owns the order in which bucket collectives are issued, the rounds' bookkeeping (which round is
open, which backward pass it belongs to, whether it ended), and the small tag that starts each
round. The reducers (one per flat buffer) own the gradients and issue a bucket's collective
when asked; this module decides when.

[Note: launch order]
Collectives must be issued in the same order on every rank, and buckets should be reduced in the
order their gradients become ready, which the layout cannot know (param groups interleave layers).
The first backward pass is a *learning round*: hooks only record in which order buckets complete,
gradients stay in ``p.grad``, and at the end of backward every bucket is staged and reduced in
bucket order. Rank 0's observed order is then broadcast once and every rank adopts it. From then
on a bucket is launched from the hook that completes it, as soon as every bucket before it in
that order has been launched; a bucket holding a parameter that got no gradient is launched
when backward ends, by a callback queued on the autograd engine,
which then waits for every reduction of that backward. Each backward pass is thus one *round*
in which every bucket is reduced exactly once, in the agreed order, on every rank. Several rounds
between two steps accumulate correctly (see ``_reducer``).

The order spans every flat buffer (one per dtype): with two buffers and rank-dependent routing
(an expert or a branch used on one rank only), per-buffer orders would interleave differently
on each rank and pair one buffer's reduction with the other's.

[Note: a round that did not end]
A backward pass that raises (and is caught) never runs the engine's callback: its round stops
after some of its buckets were issued, while the other ranks issued all of them and wait for the
rest. The callback object's finalizer tells the two apart: it is collected without having run.
The next call that meets such a round (the next backward, ``zero_grad``, ``clip_grad_norm_``,
``step``) issues the rest of that round, so that every rank has issued the same collectives,
and remembers that this rank lost a round. Every round then starts with a *tag*: an all-reduce
of the same shape as the one ``clip_grad_norm_`` and ``step`` start with, carrying which call
this rank is in and whether it lost a round since the last step (see ``_agreement``
[Note: ranks in different calls]). A rank that skipped its step after a lost round meets the
others' step with its next round's tag; a rank that lost a round among several meets the others'
tags: either way every rank sees the difference and raises, within the round, and the optimizer
refuses every later call with the same message. A backward that raised on every rank alike is
no error: the ranks still agree. A backward pass nested in another (``torch.utils.checkpoint``
with ``use_reentrant=True``) runs while the open round's callback is alive: it joins that round.
"""
from __future__ import annotations

import weakref
from typing import Callable, Sequence

import torch

from shardopt._agreement import HEADER_AT, HEADER_LEN, call_header, check_calls
from shardopt._collectives import Comm, Pending

MAX_INFLIGHT = 2  # bucket reductions in flight before the oldest is waited on


class _EndOfBackward:
    """Queued on the autograd engine when a round opens; runs when that backward pass ends.

    Only the engine holds it: once the engine drops it (after running it, or because the
    backward pass raised), its finalizer marks ``state["alive"]`` False."""

    def __init__(self, rounds: "Rounds") -> None:
        self._rounds = weakref.ref(rounds)
        self.state = {"alive": True, "ran": False}
        weakref.finalize(self, self.state.__setitem__, "alive", False)

    def __call__(self) -> None:
        self.state["ran"] = True
        rounds = self._rounds()
        if rounds is not None and rounds.callback is self.state:
            rounds.finish_round()


class Rounds:
    """The rounds of bucket reductions of one optimizer's reducers, over ``comm``'s ranks.

    ``stats_numel``: elements of the all-reduce that clip_grad_norm_ and step start with; each
    round's tag has that shape (see _agreement [Note: ranks in different calls])."""

    def __init__(self, reducers: Sequence, comm: Comm, stats_numel: int) -> None:
        self.reducers, self.comm = list(reducers), comm
        self._stats_numel = stats_numel
        self.buckets = [(k, b) for k, r in enumerate(self.reducers) for b in range(r.num_buckets)]
        self._index = {kb: i for i, kb in enumerate(self.buckets)}
        self._size = [self.reducers[k].bucket_size(b) for k, b in self.buckets]
        for k, r in enumerate(self.reducers):
            r.attach(self, k)
        self.order: list[int] | None = None  # agreed launch order (indices into self.buckets), learned in round 1
        self.require_sync = True  # False under no_sync
        self.sync_backward = True  # require_sync when the backward seen last started
        self.callback: dict | None = None  # state of the open round's _EndOfBackward; None: no round open
        self.lost_round = False  # a round of this rank's stopped before its end since the last step
        self.broken: str | None = None  # why the ranks can no longer train together
        self.rounds = 0  # rounds completed since zero_grad
        self._task: int | None = None  # autograd graph task of the backward pass seen last
        self._reset()

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._pos = 0  # next position in self.order to launch
        self._completed: list[int] = []  # learning round: buckets in the order they completed
        self._inflight: list[tuple[Pending, Callable[[], None] | None, int]] = []  # oldest first
        self._tag_pending: Pending | None = None
        self._tag_lost = False
        self._tag_sum: torch.Tensor | None = None

    # -- entry points ---------------------------------------------------------------------
    def on_hook(self) -> bool:
        """From every gradient hook, before the reducer looks at the gradient: opens a round at the
        first hook of a backward pass. True when this backward pass reduces (not under no_sync)."""
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task = task
            if not (self.callback is not None and self.callback["alive"]):  # not nested in the open round
                self.settle()
                for r in self.reducers:
                    r.begin_backward()
                self.sync_backward = self.require_sync
                if self.sync_backward:
                    self._open()
        return self.sync_backward

    def settle(self) -> None:
        """Before anything that must follow a complete round: raise if the ranks fell apart, and
        finish a round whose backward pass raised (see [Note: a round that did not end]). Every
        rank that has such a round must call it; it issues nothing otherwise."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        cb = self.callback
        if cb is not None and not cb["alive"] and not cb["ran"]:
            self.lost_round = True
            self.finish_round()

    def before_step(self) -> None:
        """At clip_grad_norm_ and step: settle, then run a round if none ran since zero_grad
        (gradients assigned by hand). Every rank."""
        self.settle()
        if self.rounds == 0:
            self._open(queue=False)
            self.finish_round()

    def zero_grad(self) -> None:
        """Forget the rounds since the last zero_grad; settles first. Local unless a round was lost."""
        self.settle()
        self.rounds = 0

    def stepped(self) -> None:
        self.lost_round = False

    # -- a round --------------------------------------------------------------------------
    def _open(self, queue: bool = True) -> None:
        self.callback = None
        if queue:
            end = _EndOfBackward(self)
            self.callback = end.state
            torch.autograd.Variable._execution_engine.queue_callback(end)
        if self.comm.world_size > 1:
            tag = torch.zeros(self._stats_numel, dtype=torch.float32)
            self._tag_lost = self.lost_round  # what this tag says, for its check
            tag[HEADER_AT:HEADER_AT + HEADER_LEN] = torch.tensor(call_header("backward", self._tag_lost))
            self._tag_sum = tag.to(self.reducers[0].flat.device)
            self._tag_pending = self.comm.all_reduce_sum(self._tag_sum)

    def bucket_filled(self, k: int, b: int) -> None:
        """One more parameter of bucket ``b`` of reducer ``k`` got its gradient in this round."""
        i = self._index[(k, b)]
        self._ready[i] += 1
        if self.order is None:
            if self._ready[i] == self._size[i]:
                self._completed.append(i)
            return
        self._launch_ready()

    def _launch_ready(self) -> None:
        order, ready, size = self.order, self._ready, self._size
        while self._pos < len(order) and ready[order[self._pos]] >= size[order[self._pos]]:
            self._launch(order[self._pos])
            self._pos += 1

    @property
    def learning(self) -> bool:
        """The next round is the learning round: no order agreed yet."""
        return self.order is None

    def _launch(self, i: int) -> None:
        k, b = self.buckets[i]
        pending, after = self.reducers[k].launch(b)
        self._inflight.append((pending, after, i))
        self.reducers[k].note_buffers()
        while len(self._inflight) > MAX_INFLIGHT:  # bounds staging: at most MAX_INFLIGHT buckets on the network
            self._complete_oldest()

    def _wait_tag(self) -> None:
        if self._tag_pending is None:
            return
        pending, self._tag_pending = self._tag_pending, None
        pending.wait()
        try:
            header = self._tag_sum[HEADER_AT:HEADER_AT + HEADER_LEN].tolist()
            check_calls(header, "backward", self._tag_lost, self.comm.world_size, maxed=False)
        except RuntimeError as e:
            self.broken = str(e)
            raise

    def _complete_oldest(self) -> None:
        self._wait_tag()
        pending, after, i = self._inflight.pop(0)
        pending.wait()
        if after is not None:
            after()
        k, b = self.buckets[i]
        self.reducers[k].landed(b)

    def finish_round(self) -> None:
        """Launch every bucket not yet launched in this round, in order, and wait for all; runs
        at the end of each backward pass. Every rank."""
        try:
            order = self.order if self.order is not None else list(range(len(self.buckets)))
            for i in order[self._pos:]:
                self._launch(i)
            while self._inflight:
                self._complete_oldest()
            self._wait_tag()
            if self.order is None:
                self.order = self._agree_on_order(self._completed)
        except BaseException as e:
            self.broken = self.broken or f"a round of gradient reductions failed on this rank: {e}"
            raise
        self.callback = None
        self.rounds += 1
        self._reset()
        for r in self.reducers:
            r.end_round()

    def _agree_on_order(self, completed: list[int]) -> list[int]:
        """Rank 0's completion order (then the never-completed buckets), adopted by every rank."""
        done = set(completed)
        rest = [i for i in range(len(self.buckets)) if i not in done]
        order = torch.tensor(completed + rest, dtype=torch.int64, device=self.reducers[0].flat.device)
        self.comm.broadcast(order, src=0).wait()
        agreed = [int(i) for i in order.tolist()]
        for k, r in enumerate(self.reducers):
            r.order = [b for kk, b in (self.buckets[i] for i in agreed) if kk == k]
        return agreed
