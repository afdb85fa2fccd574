"""Backward passes as rounds of bucket reductions, over every flat buffer of one optimizer.

Owns the order in which bucket collectives are issued, the rounds' bookkeeping (which round is
open, which backward pass it belongs to, whether it ended), and the small tag that starts each
round. The flat groups (one per flat buffer) own the gradients and issue a bucket's collective
when asked; this module decides when.

[Note: launch order]
Collectives must be issued in the same order on every rank, and buckets should be reduced in the
order their gradients become ready, which the layout cannot know (param groups interleave layers).
The order is fixed before the first backward pass: until the first round opens, a global forward
pre-hook notes where each parameter is first used (``ForwardOrder``), and gradients become ready
roughly in the reverse of that order, so a bucket is expected complete when its earliest-used
parameter gets its gradient. When the first round opens, every rank takes rank 0's guess (one
small broadcast, after the round's tag). A wrong guess costs memory (a complete bucket waits for
the ones before it in the order), never correctness: every round launches the buckets in the
agreed order, each from the hook that completes it once every bucket before it was launched, and
the rest when backward ends, by a callback queued on the autograd engine, which then waits for
every reduction of that backward. Each backward pass is thus one *round* in which every bucket is
reduced exactly once, in the agreed order, on every rank. Several rounds between two steps
accumulate correctly (see ``_intake``).

A parameter that this backward pass will not reach on this rank (``torch._C._will_engine_execute_
node`` of its gradient accumulator, asked when the round opens) counts as ready at once, so a
parameter unused on one rank (a branch, an expert) holds back nothing there. Not a parameter that
may get its gradient from a backward pass nested in this one (``torch.utils.checkpoint`` with
``use_reentrant=True``, whose outer pass does not show the inner one's parameters): one whose
module ran its forward with gradients disabled before the first backward (a reentrant checkpoint
runs its forward so), or that once got a gradient in a nested pass, and none at all once some
pass ran nested in another. Those wait for their gradient or for the end of the outer pass, the
plain slow path. A parameter counted ready that gets a gradient anyway is refused at the step on
every rank (the flat group keeps it for the step).

[Note: gradients assigned by hand]
Code that computes gradients itself (``torch.autograd.grad``, a closed form, a test) assigns
``p.grad = g`` and calls ``step()`` with no backward pass, so no hook runs and no round opens.
``clip_grad_norm_`` and ``step`` then run a round of their own (``before_step``): when no round
ran since ``zero_grad``, or when none ran since the last step and some ``p.grad`` holds a tensor
that no round took (``FlatGroup.holds_unreduced``: assigned by hand, or accumulated under
``no_sync``). That round takes every such ``p.grad`` as its parameter's gradient (in stage 2 a
tensor put in place of the placeholder replaces what the shard held, as assigning ``p.grad``
replaces torch's gradient) and reduces it like any other: averaged over the ranks. Such
gradients carry no loss scale. Whether a rank runs that round is its own decision: a rank that
runs it while another goes straight to its step meets that step with the round's tag, and both
raise (see comm._messages [Note: ranks in different calls]); assign gradients by hand on every rank
alike.

The order spans every flat buffer (one per dtype): with two buffers and rank-dependent routing
(an expert or a branch used on one rank only), per-buffer orders would interleave differently
on each rank and pair one buffer's reduction with the other's.

[Note: the usual hook]
Most hooks of a backward pass find the same situation: the round this pass opened is open, the
pass reduces (not under ``no_sync``) and is not nested in another, it is not the first round (whose
hooks note the order gradients arrive in), and the parameter waits for its first gradient of the
round, which autograd just produced (``FlatGroup.take_fresh``). ``on_hook`` notes the pass's
graph task as ``steady_task`` when that holds for the round (any change of the round's state
clears it); a hook in that task asks the flat group to take the gradient the short way, which checks
what is the parameter's own, and counts it. Anything else (the pass's first hook, a nested or
no_sync pass, a second gradient, a placeholder, a DTensor, a bucket whose staging is not allocated
yet) takes the full path, ``on_hook`` and ``arrive``. The short way does what the full path does in
that case: with it a backward pass costs per parameter what DDP's C++ hooks cost
(``benchmarks/results/per_param.md``: 0.90-1.00x DDP's cost per tensor, from 1.06-1.23x).

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
``_intake`` for that second gradient.
"""
from __future__ import annotations

import contextlib
import enum
import weakref
from typing import Any, Callable, Iterator, Sequence, cast

import torch
from torch.distributed.algorithms.join import Join, Joinable

from shardopt.comm._collectives import Comm, Pending
from shardopt.comm._replicas import ManagedReplicas
from shardopt.comm._messages import StepMessage, call_header, check_calls, digests_agree, joined_ranks, steps_code
from shardopt.core._compat import graph_task_id, queue_at_end_of_backward
from shardopt.core._dtensor import move_grad
from shardopt.group._forward_order import ForwardOrder
from shardopt.group._intake import Backward, GradIntake
from shardopt.core._ownership import owned_hook
from shardopt.core import _ranges
from shardopt.core._records import BucketRecord, ParamRecord

MAX_INFLIGHT = 2  # collectives of bucket reductions in flight before the oldest is waited on (follow-ups not counted)


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

    def __init__(self, rounds: Rounds, opened: int) -> None:
        self._rounds, self._opened, self._ran = weakref.ref(rounds), opened, [False]
        weakref.finalize(self, _dropped, self._rounds, opened, self._ran)

    def __call__(self) -> None:
        self._ran[0] = True
        rounds = self._rounds()
        if rounds is not None and rounds.opened == self._opened and rounds.state is RoundState.OPEN:
            rounds.finish_round()  # OPEN -> FLUSHING -> IDLE: the backward pass ended


def _dropped(ref: weakref.ref[Rounds], opened: int, ran: list[bool]) -> None:
    rounds = ref()
    if rounds is not None and not ran[0] and rounds.opened == opened and rounds.state is RoundState.OPEN:
        rounds._to(RoundState.LOST)  # OPEN -> LOST: the backward pass raised; settle() finishes the round


def _rewire_hooks(leaf: torch.Tensor) -> None:
    """Make ``leaf``'s post-accumulate-grad hooks run from its autograd data now. Local.

    torch keeps a tensor's hook dict on the Python object and wires it into the autograd data of
    the tensor it was made on, once, when the first hook is registered. A swap
    (``torch.utils.swap_tensors``, which ``model.to(...)`` does to every DTensor parameter) keeps
    the dict on the object and hands the autograd data to the other one; a hook registered after
    it, into the same dict, would never run, nor would those still in it, even where every hook of
    an earlier optimizer was removed (its ``close()``). Setting the dict again wires it into the
    parameter's autograd data as it is now."""
    hooks = getattr(leaf, "_post_accumulate_grad_hooks", None)
    if hooks is not None:
        leaf._post_accumulate_grad_hooks = hooks


class JoinNotice:
    """Inside torch's ``Join``: the notice that this rank has inputs for the coming step, sent once
    per step before its first collective (a round's tag, or the step's message when no round ran),
    never while the rank shadows the others' step (``joined``). Held by the rounds, which open the
    step's first round; the optimizer sends and ends it around its own calls. Local decision;
    every rank of a Join makes the same calls."""

    def __init__(self, joinable: Callable[[], Joinable | None], world_size: int) -> None:
        self._joinable = joinable  # the optimizer, weakly: it holds its rounds
        self._world_size = world_size
        self._sent: Any = None  # None: none sent this step; else its work handle (or False: Join sends none)
        self.joined = False  # this rank shadows the others' calls (the optimizer's _shadow_step)

    def active(self) -> bool:
        """Whether a Join with this optimizer enabled is running. A question."""
        joinable = self._joinable()
        return joinable is not None and joinable._join_config.enable and self._world_size > 1

    def send(self) -> None:
        """Tell the Join that this rank has inputs, once per step (a no-op outside one)."""
        if self._sent is None and not self.joined and self.active():
            self._sent = Join.notify_join_context(cast(Joinable, self._joinable())) or False

    def end(self) -> None:
        """The step's notice was read by the step: wait for its collective; the next step sends anew."""
        sent, self._sent = self._sent, None
        if sent:
            sent.wait()


class Rounds:
    """The rounds of bucket reductions of one optimizer's flat groups, over ``comm``'s ranks.

    Each round's tag is a ``StepMessage`` with only its call header, the shape of the all-reduce
    that clip_grad_norm_ and step start with (see comm._messages [Note: ranks in different calls])."""

    def __init__(self, groups: Sequence[GradIntake], comm: Comm, record_of: dict[int, ParamRecord],
                 join: JoinNotice, hyperparameters: Callable[[], object]) -> None:
        self.groups, self.comm = list(groups), comm
        self._device = self.groups[0].flat.device
        self.buckets: list[BucketRecord] = [b for r in self.groups for b in r.buckets]  # every buffer's
        for i, b in enumerate(self.buckets):
            b.placed(i)
        for k, r in enumerate(self.groups):
            for rec in r.records:
                _rewire_hooks(rec.leaf)
                rec.hooked(owned_hook(rec.leaf.register_post_accumulate_grad_hook(self._make_hook(k, rec.index)),
                                      weakref.ref(self)))
        self.order: list[BucketRecord] | None = None  # the agreed launch order, from rank 0 in round 1
        self._forward = ForwardOrder(record_of)  # until then, the guess
        self._gradless = False  # some parameter was used only in forwards without gradients
        self.require_sync = True  # False under no_sync
        self.started_by = Backward.PLAIN  # how the backward pass running now was started: opt.backward sets it (``started``)
        self.join = join  # sent before a round's first collective, inside a Join
        self.sync_backward = True  # require_sync when the backward seen last started
        self.state = RoundState.IDLE
        self.opened = 0  # rounds opened since construction (tells a stale end-of-backward callback apart)
        self.lost_round = False  # a round of this rank was LOST since the last step: what the next tags say
        self.why_broken = ""  # once BROKEN: why the ranks can no longer train together
        self.rounds = 0  # rounds completed since zero_grad
        self.rounds_since_step = 0  # rounds completed since the last step (or clip_grad_norm_) read the gradient
        self.total_rounds = 0  # rounds completed since construction
        self._task: int | None = None  # autograd graph task of the backward pass seen last
        self._round_task: int | None = None  # the graph task that opened the round (or began the no_sync pass)
        self.nested = False  # the hook running now is in a backward pass nested in that one
        self.steady_task: int | None = None  # the open round's graph task, while its hooks may take the usual path
        self.nesting_seen = False  # some backward pass ran nested in another (reentrant checkpointing)
        self.steps_taken = 0  # steps the state has taken, skipped ones included: what the tags say (see _messages.steps_code)
        # the hyperparameters the coming step uses, which replica groups under torchft compare (see
        # comm._replicas [Note: replicas through torchft]): the optimizer's param groups', asked
        self.hyperparameters = hyperparameters
        self.agreed_hyper: object = None  # what the last round's check across replica groups compared (torchft)
        self._agree_due = False  # that check is still to be made in the open round
        self._reset()

    def _reset(self) -> None:
        self._pos = 0  # next position in self.order to launch
        # oldest first: (a bucket's handle, its bucket, whether a cross-replica follow-up)
        self._inflight: list[tuple[Pending, BucketRecord, bool]] = []
        self._tag_pending: Pending | None = None
        self._tag_lost = False
        self._tag_sum: torch.Tensor | None = None

    # -- entry points ---------------------------------------------------------------------
    def _make_hook(self, k: int, index: int) -> Callable[[torch.Tensor], None]:
        # Weakly: the parameter holds its hooks, and autograd's accumulator (held by the flat group) holds
        # the parameter from C++, where the garbage collector cannot follow. A strong reference would
        # close a cycle it cannot free: the optimizer's state would outlive the optimizer.
        # The record too is found through the rounds: it holds the accumulator.
        ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:  # parameter ``index`` of flat group ``k`` got its gradient
            if torch.compiler.is_compiling():  # see below
                eager_only(param)
                return
            rounds = ref()
            if rounds is None:  # the optimizer was freed; its hooks go with it
                return
            group = rounds.groups[k]
            rec = group.records[index]
            if rounds.steady_task == graph_task_id() and group.take_fresh(rec):
                rounds._count(rec.bucket)  # see [Note: the usual hook]
                return
            if rec.dtensor is not None:  # see core._dtensor [Note: DTensor parameters]
                move_grad(rec.dtensor, rec.param)
            sync = rounds.on_hook(rec)
            if group.take(rec, sync=sync, nested=rounds.nested, first=rounds.total_rounds == 0):
                rounds._count(rec.bucket)

        # Eager also where dynamo traces the backward pass (compiled autograd): the rounds'
        # bookkeeping must not be traced, so there the hook calls itself through torch.compiler.disable
        # (a graph break; inside it nothing is compiling). Asked per call instead of wrapping every
        # hook in torch.compiler.disable, whose wrapper costs about 5 us per parameter per backward
        # pass in eager mode (benchmarks/bench_per_param.py).
        eager_only = torch.compiler.disable(hook)
        return hook

    def release(self) -> None:
        """Stop taking gradients: remove the hooks from the parameters. Local."""
        self._forward.stop()
        for r in self.groups:
            for rec in r.records:
                if rec.hook is not None:
                    rec.hook.remove()
                    rec.hooked(None)

    @contextlib.contextmanager
    def started(self, how: Backward) -> Iterator[None]:
        """Inside, backward passes count as started ``how`` (``opt.backward``: see ``Backward``). Local."""
        previous, self.started_by = self.started_by, how
        try:
            yield
        finally:
            self.started_by = previous

    def on_hook(self, rec: ParamRecord) -> bool:
        """From every gradient hook (``rec``'s), before the flat group looks at the gradient: opens a
        round at the first hook of a backward pass. True when this backward pass reduces (not under
        no_sync)."""
        task = graph_task_id()
        if task != self._task:
            self._task = task
            if self.state is not RoundState.OPEN:  # not nested in the open round
                self.settle()
                self._round_task = task
                for r in self.groups:
                    r.begin_backward(self.started_by)
                self.sync_backward = self.require_sync
                if self.sync_backward:
                    self._open(reached=rec)
            self.nested = task != self._round_task
            self.nesting_seen |= self.nested
            steady = self.state is RoundState.OPEN and self.sync_backward and not self.nested and self.total_rounds > 0
            self.steady_task = task if steady else None
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
        if state is not RoundState.BROKEN and state not in _NEXT[self.state]:
            raise AssertionError(f"a round cannot go from {self.state} to {state}")
        self.state = state
        self.steady_task = None  # the next hook looks at the round again

    def fail(self, why: str) -> None:
        """The ranks can no longer train together (a check of the tags or a collective failed):
        every later call raises ``why``. The first reason is kept. Local."""
        if self.state is not RoundState.BROKEN:
            self.why_broken = why
            self._to(RoundState.BROKEN)  # any -> BROKEN

    def before_step(self) -> None:
        """At clip_grad_norm_ and step: settle, then run a round if none ran since zero_grad, or
        if none ran since the last step and some ``p.grad`` holds a gradient no round took (see
        [Note: gradients assigned by hand]); the gradient they read is then final. Every rank."""
        self.settle()
        for r in self.groups:  # a DTensor parameter's gradient assigned by hand: to its stand-in
            r.take_dtensor_grads()
        if self.rounds == 0 or (self.rounds_since_step == 0 and any(r.holds_unreduced() for r in self.groups)):
            for r in self.groups:
                r.begin_hand_round()
            self._open(queue=False)
            # A rank alone here (it dropped averaged gradients with opt.zero_grad()) meets the others'
            # step with this tag: raise before issuing bucket collectives that no rank would match.
            self._wait_tag()
            self.finish_round()
        for r in self.groups:
            r.round_sum()

    def zero_grad(self) -> None:
        """Forget the rounds since the last zero_grad; settles first. Local unless a round was lost."""
        self.settle()
        self.rounds = 0

    def stepped(self) -> None:
        self.agreed_hyper = None
        self.lost_round = False
        self.rounds_since_step = 0
        self.steps_taken += 1

    def resumed(self, steps: int) -> None:
        """A loaded state has taken ``steps`` steps, skipped ones included; its hyperparameters are the
        loaded ones, not those the last round compared across replica groups. Local."""
        self.steps_taken = int(steps)
        self.agreed_hyper = None

    # -- a round --------------------------------------------------------------------------
    def _open(self, queue: bool = True, reached: ParamRecord | None = None) -> None:
        """IDLE -> OPEN: the first hook of a backward pass (``queue``: its end runs finish_round;
        ``reached``: the parameter whose hook opened it), or clip_grad_norm_/step with gradients
        assigned by hand (finished at once)."""
        self._to(RoundState.OPEN)
        self.opened += 1
        self.join.send()
        if queue:
            queue_at_end_of_backward(_EndOfBackward(self, self.opened))
        self._agree_due = self.comm.managed  # every replica group holds the same state (see comm._replicas)
        if self.comm.world_size > 1:
            self._tag_lost = self.lost_round  # what this tag says, for its check
            # on the host: the control group is gloo (no device sync inside a backward hook)
            self._tag_sum = StepMessage.tag(call_header("backward", self._tag_lost),
                                            steps_code(self.steps_taken)).pack(torch.device("cpu"))
            self._tag_pending = self.comm.all_reduce_sum(self._tag_sum)
        if self.order is None:
            self._agree_order()
        if queue and not self.nesting_seen and (self.total_rounds or not self._gradless):
            # Inside a backward pass: parameters it will not reach hold nothing back.
            for r in self.groups:
                for rec in r.unreached(reached):
                    r.mark_absent(rec)
                    self._count(rec.bucket)

    def shadow_round(self) -> None:
        """A whole round with no gradient of this rank's: what a rank that ran out of inputs inside a
        Join runs when the others' round tag reached it (it met the tag with its own, see
        optimizer [Note: uneven inputs]). Every bucket is reduced in the agreed order with zeros for
        this rank's part, so the others' reductions complete and this rank's gradient shard gets the
        average. Every rank that is joined, while the others run their round."""
        self.settle()
        self._to(RoundState.OPEN)  # IDLE -> OPEN: the others' backward pass
        self.opened += 1
        if self.order is None:
            self._agree_order()
        self.finish_round()

    def _agree_order(self) -> None:
        """The first round: every rank takes rank 0's guess of the launch order (see [Note: launch
        order]); the tag is checked first, so that a rank in another call raises before the
        broadcast. Every rank."""
        self._wait_tag()
        self._forward.stop()
        for r in self.groups:
            r.note_forward_use()
        self._gradless = any(rec.gradless for r in self.groups for rec in r.records)  # the first round counts nothing ahead
        # beside torchft's replica groups the order must be every group's, whatever each group's
        # first forward saw: the reverse of the layout (see comm._replicas [Note: replicas through torchft])
        guess = (sorted(self.buckets, key=lambda b: (b.buffer, b.index), reverse=True) if self.comm.managed
                 else self._forward.bucket_order(self.buckets))
        order = torch.tensor([b.position for b in guess], dtype=torch.int64)
        if self.comm.world_size > 1:
            order = order.to(self._device)
            self.comm.broadcast(order, src=0).wait()
        self.order = [self.buckets[i] for i in order.cpu().tolist()]
        for i, b in enumerate(self.order):
            b.ordered(i)

    def _count(self, b: BucketRecord) -> None:
        """One more parameter of bucket ``b`` is in; launch what is ready, in order."""
        b.one_ready()
        if b.complete:  # else the first bucket of the order not launched is as incomplete as before
            self._launch_ready()

    def _launch_ready(self) -> None:
        order = cast(list[BucketRecord], self.order)  # agreed before any bucket is counted
        while self._pos < len(order) and order[self._pos].complete:
            b = order[self._pos]
            if self.nesting_seen and b.may_nest:
                return  # the plain slow path: reduced when the outer backward pass ends (see [Note: launch order])
            self._launch(b)
            self._pos += 1

    def _launch(self, b: BucketRecord) -> None:
        """Issue bucket ``b``'s reduction, one handle; its staging goes when it lands."""
        with _ranges.bucket_range(_ranges.REDUCE_LAUNCH, b):  # see _ranges [Note: profiler ranges]
            self._inflight.append((self.groups[b.buffer].launch(b), b, False))
            self.groups[b.buffer].held.buffers_changed()
            # at most MAX_INFLIGHT collectives on the network (a rank-order handle holds two), besides
            # the cross-replica follow-ups
            while sum(p.collectives for p, _, follow_up in self._inflight if not follow_up) > MAX_INFLIGHT:
                self._complete_oldest()

    def _wait_tag(self) -> None:
        """Before a round's first bucket collective: its tag's answer, then (beside torchft) the check
        that every replica group in the quorum holds the same state. Every rank."""
        try:
            self._check_tag()
            if self._agree_due:  # a group of one rank sends no tag, but its pieces cross the groups all the same
                self._agree_due = False
                self.agreed_hyper = self.hyperparameters()
                cast(ManagedReplicas, self.comm.cross).agree(self.steps_taken, self.agreed_hyper, self._layout(),
                                                             self._device)
        except RuntimeError as e:
            self.fail(str(e))
            raise

    def _layout(self) -> tuple:
        """What replica groups must share to exchange pieces: the shard count and each buffer's size."""
        return (self.comm.shard_size, tuple((r.flat.layout.numel, str(r.flat.dtype)) for r in self.groups))

    def _check_tag(self) -> None:
        if self._tag_pending is None:
            return
        pending, self._tag_pending = self._tag_pending, None
        pending.wait()
        got = StepMessage.reduced(cast(torch.Tensor, self._tag_sum))
        check_calls(got.call, "backward", self._tag_lost, self.comm.world_size, maxed=False)
        if not digests_agree(got.hyper, self.comm.world_size - joined_ranks(got.call), False):
            raise RuntimeError(
                f"the ranks of this optimizer's group hold states of different steps ({self.steps_taken} steps "
                "taken on this rank, another number on some other rank), so their shards are no longer one "
                "state; this backward pass stops before its gradients are reduced. Beside torchft this is a "
                "replica group that healed on some of its ranks only (the live group's rank it healed from "
                "failed): let the group restart, it heals again from a live group. Otherwise some rank loaded "
                "another checkpoint or state dict than the others")

    def _complete_oldest(self) -> None:
        """Wait for the oldest handle in flight. A reduction that starts a follow-up (the
        cross-replica all-reduce of hybrid sharding) frees its staging now; the follow-up goes to
        the back of the queue, and the bucket's gradient is complete when it lands."""
        self._wait_tag()
        pending, b, follow_up = self._inflight.pop(0)
        with _ranges.bucket_range(_ranges.REDUCE_LAND, b):
            follow = pending.wait_landed()
            if not follow_up:  # the bucket's reduction: its staging was read
                self.groups[b.buffer].landed(b)
            if follow is not None:
                self._inflight.append((follow, b, True))
            else:
                self.groups[b.buffer].reduced(b)
            # its staging or receive buffers went (see _held_bytes [Note: a gradient taken at once])
            self.groups[b.buffer].held.buffers_changed()

    def finish_round(self) -> None:
        """Launch every bucket not yet launched in this round, in order, and wait for all; runs
        at the end of each backward pass. Every rank."""
        self._to(RoundState.FLUSHING)  # OPEN or LOST -> FLUSHING: the pass ended, or settle() found it lost
        try:
            with _ranges.record_function(_ranges.FINISH_ROUND):
                for b in cast(list[BucketRecord], self.order)[self._pos:]:
                    self._launch(b)
                while self._inflight:
                    self._complete_oldest()
                self._wait_tag()
        except BaseException as e:
            self.fail(f"a round of gradient reductions failed on this rank: {e}")
            raise
        self._to(RoundState.IDLE)  # FLUSHING -> IDLE: every bucket of the round landed
        self.rounds += 1
        self.rounds_since_step += 1
        self.total_rounds += 1
        self._reset()
        for r in self.groups:
            r.end_round()
