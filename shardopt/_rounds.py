"""Backward passes as rounds of bucket reductions, over every flat buffer of one optimizer.

Owns the order in which bucket collectives are issued, the rounds' bookkeeping (which round is
open, which backward pass it belongs to, whether it ended), and the small tag that starts each
round. The reducers (one per flat buffer) own the gradients and issue a bucket's collective
when asked; this module decides when.

[Note: launch order]
Collectives must be issued in the same order on every rank, and buckets should be reduced in the
order their gradients become ready, which the layout cannot know (param groups interleave layers).
The first backward pass is a *learning round*: rank 0 announces each bucket as it completes there
(a one-element broadcast, then that bucket's reduction) and every rank reduces the buckets in the
announced order, each as soon as it is announced and complete on that rank (a rank polls the
announcement from its hooks without blocking). The first backward thus holds no more gradient than
later ones while the ranks run at a similar pace, and its announcements are the order every later
round follows, without any announcement: from then on a bucket is launched from the hook that
completes it, as soon as every bucket before it in that order has been launched. From the second
round on, a parameter that this backward pass will not reach on this rank
(``torch._C._will_engine_execute_node`` of its gradient accumulator, asked when the round opens)
counts as ready at once, so a parameter unused on one rank (a branch, an expert) holds back
nothing there. In the learning round the same question is asked only on a rank other than 0 whose
graph visibly differs from rank 0's: the announced bucket lacks gradients there while a later
one is complete. A parameter the outer pass does not show may still get its gradient from a pass
nested in it (a reentrant checkpoint); such a gradient is kept and its bucket reduced once more
at the end of the round (see ``_late_grads`` [Note: a gradient after its bucket]). A parameter
unused on rank 0 alone holds its own bucket on the other ranks until the learning round ends.
A bucket that rank 0 never completed in the learning round is placed, for later
rounds, where the other ranks completed it, unless some rank saw a nested pass (then rank 0
could not count it ready, and it stays last). Not once a backward pass ran nested in another (``torch.utils.checkpoint`` with
``use_reentrant=True``): the outer pass does not show the parameters of the inner one. A bucket still missing a gradient is launched when backward ends, by a callback
queued on the autograd engine, which then waits for every reduction of that backward (in the
learning round, rank 0 announces such buckets then, in index order). Each backward pass is thus one *round*
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
with ``use_reentrant=True``) that starts while the outer pass's round is open joins that round;
one whose hooks come first opens a round of its own, which ends with it: correct, but each such
segment then reduces every bucket once more (``use_reentrant=False`` avoids it). A parameter that
gets a second gradient in one round (used inside and outside such a checkpoint) counts once; see
``_reducer`` for that second gradient.
"""
from __future__ import annotations

import enum
import weakref
from typing import Callable, Sequence

import torch

from shardopt._agreement import call_header, check_calls
from shardopt._collectives import Comm, Pending
from shardopt._step_message import StepMessage

MAX_INFLIGHT = 2  # bucket reductions in flight before the oldest is waited on (follow-ups not counted)


class RoundState(enum.Enum):
    """Where this rank's round of bucket reductions is. ``Rounds._to`` makes every transition."""

    IDLE = "idle"  # no round open: between backward passes, or inside one under no_sync
    OPEN = "open"  # a backward pass is reducing; its end-of-backward callback is queued on the engine
    LOST = "lost"  # that backward pass raised: the engine dropped the callback without running it
    FLUSHING = "flushing"  # launching the buckets left and waiting for every reduction of the round
    BROKEN = "broken"  # the ranks fell apart: every later call raises ``Rounds.why_broken``


_NEXT = {  # the transitions a round may make, each with its reason at the place that makes it
    RoundState.IDLE: {RoundState.OPEN},
    RoundState.OPEN: {RoundState.FLUSHING, RoundState.LOST},
    RoundState.LOST: {RoundState.FLUSHING},
    RoundState.FLUSHING: {RoundState.IDLE},
    RoundState.BROKEN: set(),
}


class _EndOfBackward:
    """Queued on the autograd engine when a round opens; runs when that backward pass ends.

    Only the engine holds it: when the engine drops it without running it (the backward pass
    raised), its finalizer marks the round it opened LOST."""

    def __init__(self, rounds: "Rounds", opened: int) -> None:
        self._rounds, self._opened, self._ran = weakref.ref(rounds), opened, [False]
        weakref.finalize(self, _dropped, self._rounds, opened, self._ran)

    def __call__(self) -> None:
        self._ran[0] = True
        rounds = self._rounds()
        if rounds is not None and rounds.opened == self._opened and rounds.state is RoundState.OPEN:
            rounds.finish_round()  # OPEN -> FLUSHING -> IDLE: the backward pass ended


def _dropped(ref: "weakref.ref[Rounds]", opened: int, ran: list[bool]) -> None:
    rounds = ref()
    if rounds is not None and not ran[0] and rounds.opened == opened and rounds.state is RoundState.OPEN:
        rounds._to(RoundState.LOST)  # OPEN -> LOST: the backward pass raised; settle() finishes the round


class Rounds:
    """The rounds of bucket reductions of one optimizer's reducers, over ``comm``'s ranks.

    Each round's tag is a ``StepMessage`` with only its call header, the shape of the all-reduce
    that clip_grad_norm_ and step start with (see _agreement [Note: ranks in different calls])."""

    def __init__(self, reducers: Sequence, comm: Comm) -> None:
        self.reducers, self.comm = list(reducers), comm
        self._device = self.reducers[0].flat.device
        self.buckets = [(k, b) for k, r in enumerate(self.reducers) for b in range(r.num_buckets)]
        self._index = {kb: i for i, kb in enumerate(self.buckets)}
        self._size = [self.reducers[k].bucket_size(b) for k, b in self.buckets]
        self._hooks = []
        for k, r in enumerate(self.reducers):
            r.on_held = self.note_held
            # eager also inside a compiled function that runs backward (dynamo would trace the rounds' bookkeeping)
            self._hooks += [p.register_post_accumulate_grad_hook(torch.compiler.disable(self._make_hook(k, i)))
                            for i, p in enumerate(r.flat.params)]
        self.order: list[int] | None = None  # agreed launch order (indices into self.buckets), learned in round 1
        self.require_sync = True  # False under no_sync
        self.sync_backward = True  # require_sync when the backward seen last started
        self.state = RoundState.IDLE
        self.opened = 0  # rounds opened since construction (tells a stale end-of-backward callback apart)
        self.lost_round = False  # a round of this rank was LOST since the last step: what the next tags say
        self.why_broken = ""  # once BROKEN: why the ranks can no longer train together
        self.rounds = 0  # rounds completed since zero_grad
        self.total_rounds = 0  # rounds completed since construction
        self._task: int | None = None  # autograd graph task of the backward pass seen last
        self._round_task: int | None = None  # the graph task that opened the round (or began the no_sync pass)
        self.nested = False  # the hook running now is in a backward pass nested in that one
        self.nesting_seen = False  # some backward pass ran nested in another (reentrant checkpointing)
        self.held_peak = 0  # high-water mark of the reducers' held_bytes() at one moment, summed, bytes
        self._reset()

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._pos = 0  # next position in self.order to launch
        # Learning round: buckets announced so far (rank 0's completion order), the announcement
        # in flight (ranks but 0), buckets complete on rank 0 and not yet announced.
        self._announced: list[int] = []
        self._absent_on_0: set[int] = set()  # announced at the end: never complete on rank 0
        self._done_at: dict[int, int] = {}  # bucket -> how many buckets were complete here before it
        self._announcing: list[tuple[Pending, torch.Tensor]] = []  # rank 0's broadcasts in flight
        self._listening: tuple[Pending, torch.Tensor] | None = None  # ranks but 0: the next announcement
        self._next: int | None = None  # ranks but 0: announced, not yet complete here
        self._held: set[int] = set()  # ranks but 0: complete here, not yet announced
        self._inflight: list[tuple[Pending, Callable[[], None] | None, int | None]] = []  # oldest first; bucket on its last
        self._follow_ups = 0  # of those, cross-replica all-reduces started when a reduction landed (hybrid)
        self._tag_pending: Pending | None = None
        self._tag_lost = False
        self._tag_sum: torch.Tensor | None = None

    # -- entry points ---------------------------------------------------------------------
    def _make_hook(self, k: int, index: int) -> Callable[[torch.Tensor], None]:
        reducer, at = self.reducers[k], self._index

        def hook(param: torch.Tensor) -> None:  # parameter ``index`` of reducer ``k`` got its gradient
            sync = self.on_hook()
            if reducer.arrive(index, param, sync=sync, nested=self.nested, learning=self.order is None):
                self._count(at[(k, reducer.bucket_of(index))])

        return hook

    def release(self) -> None:
        """Stop taking gradients: remove the hooks from the parameters. Local."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def on_hook(self) -> bool:
        """From every gradient hook, before the reducer looks at the gradient: opens a round at the
        first hook of a backward pass. True when this backward pass reduces (not under no_sync)."""
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task = task
            if self.state is not RoundState.OPEN:  # not nested in the open round
                self.settle()
                self._round_task = task
                for r in self.reducers:
                    r.begin_backward()
                self.sync_backward = self.require_sync
                if self.sync_backward:
                    self._open()
            self.nested = task != self._round_task
            self.nesting_seen |= self.nested
        return self.sync_backward

    def settle(self) -> None:
        """Before anything that must follow a complete round: raise if the ranks fell apart, and
        finish a round whose backward pass raised (see [Note: a round that did not end]). Every
        rank that has such a round must call it; it issues nothing otherwise."""
        if self.state is RoundState.BROKEN:
            raise RuntimeError(self.why_broken)
        if self.state is RoundState.LOST:
            self.lost_round = True
            self.finish_round()

    def _to(self, state: RoundState) -> None:
        """The one place a round changes state; BROKEN is reached from anywhere (``fail``)."""
        assert state is RoundState.BROKEN or state in _NEXT[self.state], (self.state, state)
        self.state = state

    def fail(self, why: str) -> None:
        """The ranks can no longer train together (a check of the tags or a collective failed):
        every later call raises ``why``. The first reason is kept. Local."""
        if self.state is not RoundState.BROKEN:
            self.why_broken = why
            self._to(RoundState.BROKEN)  # any -> BROKEN

    def before_step(self) -> None:
        """At clip_grad_norm_ and step: settle, then run a round if none ran since zero_grad
        (gradients assigned by hand). Every rank."""
        self.settle()
        if self.rounds == 0:
            self._open(queue=False)
            # A rank alone here (it dropped averaged gradients with opt.zero_grad()) meets the others'
            # step with this tag: raise before issuing bucket collectives that no rank would match.
            self._wait_tag()
            self.finish_round()

    def zero_grad(self) -> None:
        """Forget the rounds since the last zero_grad; settles first. Local unless a round was lost."""
        self.settle()
        self.rounds = 0

    def stepped(self) -> None:
        self.lost_round = False

    def _held_now(self) -> int:
        return sum(r.held_bytes(comm=False) for r in self.reducers) + self.comm.live_bytes  # one Comm for all

    def note_held(self) -> None:
        """Track the most gradient and buffer bytes held at one moment over every flat buffer."""
        self.held_peak = max(self.held_peak, self._held_now())

    def reset_held(self) -> None:
        self.held_peak = self._held_now()

    # -- a round --------------------------------------------------------------------------
    def _open(self, queue: bool = True) -> None:
        """IDLE -> OPEN: the first hook of a backward pass (``queue``: its end runs finish_round), or
        clip_grad_norm_/step with gradients assigned by hand (finished at once)."""
        self._to(RoundState.OPEN)
        self.opened += 1
        if queue:
            torch.autograd.Variable._execution_engine.queue_callback(_EndOfBackward(self, self.opened))
        if self.comm.world_size > 1:
            self._tag_lost = self.lost_round  # what this tag says, for its check
            self._tag_sum = StepMessage.tag(call_header("backward", self._tag_lost)).pack(self._device)
            self._tag_pending = self.comm.all_reduce_sum(self._tag_sum)
            if self.order is None and self.comm.rank != 0:
                self._listen()
        if queue and self.order is not None and not self.nesting_seen:
            # Inside a backward pass: parameters it will not reach hold nothing back.
            for k, r in enumerate(self.reducers):
                for b in r.unreached():
                    self._count(self._index[(k, b)])

    def _count(self, i: int) -> None:
        """One more parameter of bucket ``i`` is in; launch (or announce) what is ready."""
        self._ready[i] += 1
        if self.order is None and self._ready[i] == self._size[i]:
            self._done_at[i] = len(self._done_at)
        if self.order is not None:
            self._launch_ready()
        elif self._ready[i] == self._size[i] and self.comm.rank == 0:
            self._announce(i)
        elif self.comm.rank != 0:
            if self._ready[i] == self._size[i]:
                self._held.add(i)
            self._follow(block=False)

    # -- the learning round -----------------------------------------------------------------
    def _announce(self, i: int, absent: bool = False) -> None:
        """Rank 0: bucket ``i`` is next (``absent``: it never completed here); tell the others, then
        reduce it."""
        self._announced.append(i)
        if absent:
            self._absent_on_0.add(i)
        if self.comm.world_size > 1:
            t = torch.tensor([i + len(self.buckets) * absent], dtype=torch.int64).to(self._device)
            self._announcing.append((self.comm.broadcast(t, src=0), t))
        self._launch(i)

    def _listen(self) -> None:
        """Ranks but 0: post the receive of the next announcement, unless all were made."""
        self._listening = None
        if len(self._announced) < len(self.buckets):
            t = torch.zeros(1, dtype=torch.int64, device=self._device)
            self._listening = (self.comm.broadcast(t, src=0), t)

    def _follow(self, block: bool) -> None:
        """Ranks but 0: reduce the announced buckets that are complete here, in the announced
        order; with ``block`` (backward has ended) every bucket, waiting for each announcement.
        A rank ahead of rank 0 waits for the next announcement rather than hold a complete bucket
        (the same bound as later rounds, where it waits for the reductions in flight)."""
        while True:
            if self._next is None:
                if self._listening is None:
                    return  # every bucket was announced
                pending, t = self._listening
                if not block and not self._held and not pending.arrived():
                    return
                pending.wait()
                value = int(t.item())
                self._next = value % len(self.buckets)
                if value >= len(self.buckets):
                    self._absent_on_0.add(self._next)
                self._announced.append(self._next)
            i = self._next
            if not block and self._ready[i] < self._size[i]:
                if not (self._held and self._unshown(i)):
                    return
            self._next = None
            self._held.discard(i)
            self._launch(i)
            self._listen()

    def _unshown(self, i: int) -> bool:
        """Ranks but 0, learning round: bucket ``i`` is announced and lacks gradients here while a
        later one is complete, so this rank's graph differs from rank 0's. True (and ``i`` counted
        complete) when this backward pass shows none of the missing parameters; a gradient that a
        nested pass still gives one of them is reduced once more when the round ends."""
        k, b = self.buckets[i]
        if not self.reducers[k].count_unshown(b, self.nested):
            return False
        self._ready[i] = self._size[i]
        return True

    def _finish_learning(self) -> None:
        if self.comm.rank == 0:
            done = set(self._announced)
            for i in range(len(self.buckets)):
                if i not in done:
                    self._announce(i, absent=True)  # a parameter without a gradient on rank 0
        else:
            self._follow(block=True)
        for pending, _ in self._announcing:
            pending.wait()
        self.order, late = self._learned_order()
        for i in late:  # every rank, in index order: the gradients that came after their bucket
            k, b = self.buckets[i]
            self._issue(k, *self.reducers[k].late.make_up(b), None)
        for k, r in enumerate(self.reducers):
            r.order = [b for kk, b in (self.buckets[i] for i in self.order) if kk == k]

    def _learned_order(self) -> tuple[list[int], list[int]]:
        """(The launch order of later rounds, the buckets some rank got a gradient for after it had
        reduced them without it), from one small all-reduce at the end of the learning round.

        The order is the announced one, except that a bucket rank 0 never completed (announced at
        the end) goes where it completed on the other ranks. Placed at the end, it would hold its
        gradients on those ranks until backward ends, in every round."""
        if self.comm.world_size == 1:
            return list(self._announced), []
        n = len(self.buckets)
        at = torch.full((2 * n + 1,), float(n + 1), dtype=torch.float64)
        at[n] = 0.0 if self.nesting_seen else 1.0  # MIN: 0 when any rank saw a nested backward pass
        for i in self._late_buckets():
            at[n + 1 + i] = 0.0  # MIN: 0 when any rank has a late gradient in bucket i
        if self.comm.rank == 0:
            for pos, i in enumerate(b for b in self._announced if b not in self._absent_on_0):
                at[i] = pos  # its place in rank 0's order
        else:  # between the buckets of rank 0's order that completed before and after it here
            done = sorted(self._done_at, key=self._done_at.__getitem__)
            before = 0
            for seq, i in enumerate(done):
                if i in self._absent_on_0:
                    at[i] = before - 1 + (seq + 1) / (n + 1)
                else:
                    before += 1
        at = at.to(self._device)
        self.comm.all_reduce_min(at).wait()
        place = at.cpu().tolist()
        late = [i for i in range(n) if place[n + 1 + i] == 0.0]
        if place[n] == 0.0 or not self._absent_on_0:  # later rounds cannot count it ready on rank 0
            return list(self._announced), late  # (see [Note: launch order])
        return sorted(self._announced, key=lambda i: (place[i], i)), late

    def _late_buckets(self) -> list[int]:
        return [self._index[(k, b)] for k, r in enumerate(self.reducers) for b in r.late.buckets()]

    def _launch_ready(self) -> None:
        order, ready, size = self.order, self._ready, self._size
        while self._pos < len(order) and ready[order[self._pos]] >= size[order[self._pos]]:
            self._launch(order[self._pos])
            self._pos += 1

    def _launch(self, i: int) -> None:
        k, b = self.buckets[i]
        self._issue(k, *self.reducers[k].launch(b), i)

    def _issue(self, k: int, parts: list[Callable[[], Pending]], after: Callable[[], None] | None,
               i: int | None) -> None:
        """Issue one bucket's collectives (reducer ``k``); ``i``: the bucket whose staging goes when
        the last lands."""
        for j, issue in enumerate(parts):  # one collective each (gloo cuts a bucket one rank owns most of)
            last = j == len(parts) - 1
            self._inflight.append((issue(), after if last else None, i if last else None))
            self.reducers[k].note_buffers()
            # at most MAX_INFLIGHT reductions on the network, besides their cross-replica follow-ups
            while len(self._inflight) - self._follow_ups > MAX_INFLIGHT:
                self._complete_oldest()

    def _wait_tag(self) -> None:
        if self._tag_pending is None:
            return
        pending, self._tag_pending = self._tag_pending, None
        pending.wait()
        try:
            check_calls(StepMessage.reduced(self._tag_sum).call, "backward", self._tag_lost, self.comm.world_size, maxed=False)
        except RuntimeError as e:
            self.fail(str(e))
            raise

    def _complete_oldest(self) -> None:
        """Wait for the oldest collective in flight. A reduction that starts a follow-up (the
        cross-replica all-reduce of hybrid sharding) frees its staging now; the follow-up goes to
        the back of the queue and carries what runs once the bucket's gradient is complete."""
        self._wait_tag()
        pending, after, i = self._inflight.pop(0)
        if pending.overlap:
            self._follow_ups -= 1
        follow = pending.wait_landed()
        if i is not None:  # the bucket's last collective: its staging was read
            k, b = self.buckets[i]
            self.reducers[k].landed(b)
        if follow is not None:
            self._inflight.append((follow, after, None))
            self._follow_ups += 1
            return
        if after is not None:
            after()

    def finish_round(self) -> None:
        """Launch every bucket not yet launched in this round, in order, and wait for all; runs
        at the end of each backward pass. Every rank."""
        self._to(RoundState.FLUSHING)  # OPEN or LOST -> FLUSHING: the pass ended, or settle() found it lost
        try:
            if self.order is None:
                self._finish_learning()
            else:
                for i in self.order[self._pos:]:
                    self._launch(i)
            while self._inflight:
                self._complete_oldest()
            self._wait_tag()
        except BaseException as e:
            self.fail(f"a round of gradient reductions failed on this rank: {e}")
            raise
        self._to(RoundState.IDLE)  # FLUSHING -> IDLE: every bucket of the round landed
        self.rounds += 1
        self.total_rounds += 1
        self._reset()
        for r in self.reducers:
            r.end_round()
