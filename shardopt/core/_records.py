"""The two records that carry the optimizer's state: one per parameter, one per bucket.

[Note: the records]
Everything shardopt knows about one parameter sits in its :class:`ParamRecord`, and everything
about one bucket (a run of whole parameters that is reduced and gathered together) in its
:class:`BucketRecord`. They are built once per flat buffer, from its layout (:func:`build_records`),
and every other part reads them and asks them to change: the scheduler and the flat group
(``reduce/``) move a parameter's gradient through its round, the step's checks (``step/``) read
what each parameter got and whether it was written from outside, the update (``update/``) reads
each parameter's shard range, param group and lag, and starts each bucket's weight gather. No
list or dict indexed by parameter or bucket lives anywhere else in those paths; the orders (the
agreed launch order, the order gradients arrived in) are lists of records, or each record's own
place in them.

[Note: the records' verbs] Outside :func:`build_records`, a field changes only in a method of its
record (``to``, ``place``, ``nest``, ``arrived``, ``stepped``, ``gathering``, ...), each named for
what happened, so a search for the verb finds every writer; ``tests/test_records.py`` walks the
package's syntax trees and fails on an assignment to a record field anywhere else. A field that
has states has an enum, and each enum changes in one guarded method, as ``Rounds._to`` does for a
round: :meth:`ParamRecord.to` for :class:`ParamState`, :meth:`ParamRecord.place` for
:class:`GradSlot`, :meth:`BucketRecord.to` for :class:`BucketState`; a transition the table does
not allow raises (an explicit raise, so ``python -O`` keeps it). A fact is stored once: what
follows from other fields is a question (``gradless`` from the forward uses, ``complete`` from
``ready``), and asking a record a question (``holds``, ``may_nest``, ``gradless``) never changes it.

The life of a gradient through them (stage 2; stage 1 all-reduces into its view of the flat
gradient instead)::

    backward: autograd accumulates p.grad ──hook──▶ ParamRecord  WAITING ─▶ TAKEN  (copied into
                                                    │                        its bucket's staging)
                                                    └▶ bucket.ready += 1
    every parameter of the bucket in, and every bucket before it in the launch order launched:
        BucketRecord  WAITING ─▶ LAUNCHED (reduce-scatter of staging into this rank's shard part)
                               ─▶ LANDED  (staging freed)
    end of backward: every record back to WAITING; p.grad = the placeholder (GradSlot.PLACEHOLDER)
    step: each record's shard range (local) is updated, then each bucket's all-gather starts
          (BucketRecord.gather) and is waited for before the next forward uses its weights.
          offload="cpu": the bucket's gradient is first copied to host memory (BucketRecord.host),
          updated there, and its new weights copied back before its gather starts.
"""
from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from itertools import compress
from typing import TYPE_CHECKING, Any, Sequence, cast

import torch
from torch import Tensor

from shardopt.core._layout import FlatLayout, ParamSpan, Range

if TYPE_CHECKING:
    class Placeholder(Tensor):
        """What group._grad_placeholder.GradPlaceholder adds to a tensor, for the type checker: this
        layer cannot name that class. At run time the name is Tensor, GradPlaceholder's base."""

        zeroed: bool
        pending: Tensor | None
        accumulating: bool

    class Gather:
        """What comm._collectives.Pending is to a bucket record: a weight all-gather in flight, to
        be waited for (for the type checker, as Placeholder; at run time the name is object)."""

        def wait(self) -> None: ...
else:
    Placeholder = Tensor
    Gather = object


class ParamState(enum.Enum):
    """Where one parameter's gradient is in the open round; the round's end sets every one WAITING."""

    __hash__ = object.__hash__  # members are singletons: identity, in C (Enum's own hashes the name in Python)

    WAITING = "waiting"  # nothing taken in this round yet
    TAKEN = "taken"  # its gradient (or zero) is in its bucket; another one in this round is a second gradient
    ABSENT = "absent"  # this backward pass will not reach it: counted in at once; a gradient for it is refused


_PARAM_NEXT = {
    ParamState.WAITING: {ParamState.TAKEN, ParamState.ABSENT, ParamState.WAITING},
    ParamState.TAKEN: {ParamState.WAITING},
    ParamState.ABSENT: {ParamState.TAKEN, ParamState.WAITING},
}


class GradSlot(enum.Enum):
    """What the optimizer last put in ``p.grad`` (the user may have changed it since: see
    :meth:`ParamRecord.holds`)."""

    OWN = "own"  # nothing of the optimizer's: None, autograd's tensor, or (stage 1) its view of the flat gradient
    PLACEHOLDER = "placeholder"  # stage 2 after a round: the storage-less placeholder; the values are in the shard
    ACCUMULATING = "accumulating"  # the placeholder stands for a 16-bit gradient summed in fp32 under no_sync


class Holds(enum.Enum):
    """What ``p.grad`` holds now, as :meth:`ParamRecord.holds` reads it."""

    NONE = "none"  # p.grad is None
    VIEW = "view"  # stage 1: the parameter's own view of the flat gradient
    PLACEHOLDER = "placeholder"  # the parameter's placeholder, as placed
    ZEROED = "zeroed"  # the placeholder, zeroed (p.grad.zero_()) since it was placed
    TENSOR = "tensor"  # another tensor: autograd's new gradient, or one assigned by hand


class Reach(enum.Enum):
    """How a backward pass reaches the parameter (see group._rounds [Note: launch order])."""

    DIRECT = "direct"  # the outer pass shows it: counted ready at once where that pass will not reach it
    NESTED = "nested"  # its gradient may come from a pass nested in the outer one: never counted ahead


class BucketState(enum.Enum):
    """Where one bucket's reduction is in the open round; the round's end sets every one WAITING."""

    __hash__ = object.__hash__  # as ParamState's: the transition tables are looked up on every gradient

    WAITING = "waiting"  # gradients coming in (``ready`` counts them)
    LAUNCHED = "launched"  # staged and its collectives issued
    LANDED = "landed"  # its reduction arrived; staging freed


_BUCKET_NEXT = {
    BucketState.WAITING: {BucketState.LAUNCHED},
    # LAUNCHED again: its launch raised inside a backward pass, and finishing that LOST round launches it
    BucketState.LAUNCHED: {BucketState.LANDED, BucketState.LAUNCHED},
    BucketState.LANDED: {BucketState.WAITING},
}


@dataclass(eq=False)
class ParamRecord:
    """One trained parameter: where it lies, where its gradient is, what it was bound to."""

    param: torch.nn.Parameter  # a plain parameter: the model's, or a DTensor parameter's stand-in (core._dtensor)
    name: str  # how messages name it
    group: int  # its param group's index
    span: ParamSpan  # shape and global range in the flat buffer
    local: Range | None  # this rank's part of it, relative to the start of this rank's shard; None: no part
    bucket: BucketRecord = field(init=False, repr=False)
    at: slice = field(init=False, repr=False)  # its elements within its bucket (a bucket-sized buffer)
    accumulator: Any = None  # autograd's gradient accumulator, held so that autograd keeps using this one
    placeholder: Placeholder | None = None  # its stage-2 / no_sync placeholder (group._grad_placeholder)
    state: ParamState = ParamState.WAITING
    slot: GradSlot = GradSlot.OWN
    used: bool = False  # got a gradient on this rank since its gradient was last zeroed
    reach: Reach = Reach.DIRECT
    arrival: int | None = None  # its place in the order gradients arrived in the first round; None: none arrived
    replaced: bool = False  # stage 2: p.grad replaced by a tensor after backward; reported at the step
    trained: bool = True  # some rank has a gradient for it at this step: the update touches it (step._usage_checks)
    hook: Any = None  # the handle of its post-accumulate-grad hook (group._rounds)
    kept_bytes: int = 0  # its .grad kept across no_sync backward passes, bytes
    first_use: int | None = None  # position of its first use in the forwards before the first round
    forward_with_grad: bool = False  # its module ran a forward with gradients enabled then
    forward_without_grad: bool = False  # ... and with gradients disabled
    ptr: int = 0  # data_ptr of its storage when last bound
    version: int = 0  # its version counter when its value was last taken
    rebound: bool = False  # re-bound to the flat buffer since then: written, though its version did not move
    lag: int = 0  # steps it was left out of (no rank had a gradient): its step count is the optimizer's minus this
    dtensor: Tensor | None = None  # the model's DTensor parameter that ``param`` stands in for (see core._dtensor)
    grad_view: Tensor | None = None  # stage 1: its own view of the flat gradient, shaped (made once)
    grad_ptr: int = 0  # stage 1: data_ptr of its place in the flat gradient (0: an empty parameter, or stage 2)

    @property
    def index(self) -> int:
        """Its position in its flat buffer: the layout's (``span.index``), not a second copy of it."""
        return self.span.index

    @property
    def leaf(self) -> Tensor:
        """The tensor autograd accumulates this parameter's gradient into: the model's parameter."""
        return self.param if self.dtensor is None else self.dtensor

    @property
    def gradless(self) -> bool:
        """Used only in forwards without gradients (as a reentrant checkpoint runs its first
        forward) before the first round. A question."""
        return self.forward_without_grad and not self.forward_with_grad

    # -- the verbs: outside build_records, every field changes in one of these ------------------
    def to(self, state: ParamState) -> None:
        """The one place ``state`` changes."""
        if state not in _PARAM_NEXT[self.state]:
            raise AssertionError(f"parameter {self.name}: its gradient cannot go from {self.state} to {state}")
        self.state = state

    def attach(self, placeholder: Placeholder, accumulator: Any) -> None:
        """The flat group's: its stage-2 placeholder, and autograd's gradient accumulator (held)."""
        self.placeholder, self.accumulator = placeholder, accumulator

    def hooked(self, handle: Any) -> None:
        """The scheduler's: the handle of its post-accumulate-grad hook (None: removed)."""
        self.hook = handle

    def used_in_forward(self, position: int, grad_enabled: bool) -> bool:
        """Its module runs a forward before the first round; ``position``: the next first use's
        place. True if this was its first use (the position is taken)."""
        first = self.first_use is None
        if first:
            self.first_use = position
        if grad_enabled:
            self.forward_with_grad = True
        else:
            self.forward_without_grad = True
        return first

    def nest(self) -> None:
        """Its gradient may come from a backward pass nested in the outer one: never counted ahead."""
        self.reach = Reach.NESTED

    def arrived(self, position: int) -> bool:
        """Its gradient arrived in the first round, ``position``-th; True if it had not before."""
        if self.arrival is not None:
            return False
        self.arrival = position
        return True

    def got_gradient(self, used: bool = True) -> None:
        """Whether it has a gradient on this rank since its gradient was last zeroed."""
        self.used = used

    def mark_replaced(self, replaced: bool) -> None:
        """Stage 2: ``p.grad`` was (or no longer is) a tensor put there by hand after backward."""
        self.replaced = replaced

    def mark_trained(self, trained: bool) -> None:
        """Whether some rank has a gradient for it at this step (agreed over the ranks)."""
        self.trained = trained

    def keep_bytes(self, nbytes: int) -> int:
        """Its ``.grad`` kept across no_sync passes is now ``nbytes``; returns the change, bytes."""
        change, self.kept_bytes = nbytes - self.kept_bytes, nbytes
        return change

    def bound(self, ptr: int) -> None:
        """It is (again) a view of its flat buffer at ``ptr``."""
        self.ptr = ptr

    def seen(self, version: int) -> None:
        """Its value, at version counter ``version``, was taken by the optimizer."""
        self.version, self.rebound = version, False

    def mark_rebound(self) -> None:
        """Re-bound to the flat buffer from storage of its own: written, though its version did not move."""
        self.rebound = True

    def stepped(self) -> None:
        """A step ran: a parameter no rank had a gradient for falls one more step behind."""
        self.lag += not self.trained

    def resume(self, lag: int) -> None:
        """A loaded state: its own step count is the optimizer's minus ``lag``."""
        self.lag = int(lag)

    def place(self, slot: GradSlot) -> None:
        """The one place ``slot`` changes: what the optimizer just put in ``p.grad``. The placeholder
        knows whether it stands for an fp32 sum, for the message it raises when its values are read."""
        self.slot = slot
        ph = self.placeholder
        if ph is not None and ph.accumulating is not (slot is GradSlot.ACCUMULATING):  # a tensor's attribute: set only when it changes
            ph.accumulating = slot is GradSlot.ACCUMULATING

    def zeroed(self) -> None:
        """Its gradient was set to None (``zero_grad(set_to_none=True)``): nothing of the
        optimizer's is in ``p.grad``, and it has no gradient since."""
        self.place(GradSlot.OWN)
        self.used = False

    def holds(self) -> Holds:
        """What ``p.grad`` holds now. A question: changes nothing."""
        g = self.param.grad
        if g is None:
            return Holds.NONE
        ph = self.placeholder
        if ph is not None and g is ph:
            return Holds.ZEROED if ph.zeroed else Holds.PLACEHOLDER
        view = self.bucket.view_of(self)
        return Holds.VIEW if view is not None and g.data_ptr() == view.data_ptr() else Holds.TENSOR


@dataclass(eq=False)
class HostCopy:
    """A bucket's part of this rank's shard in host memory (``offload="cpu"``, see update._offload):
    views of the placement's one host allocation over the bucket's ``local`` range, and the events
    of the copies in flight (CUDA events on an accelerator; None where a copy completes at once)."""

    weights: Tensor  # 1D, param dtype: the host copy of its weights, which the update writes
    device_weights: Tensor  # 1D, param dtype: the same range of the flat param buffer, on the accelerator
    gradient: Tensor | None  # 1D, grad dtype: the host copy of its averaged gradient (None: not copied, Muon)
    grad_copied: Any = None  # recorded when its gradient's device-to-host copy was issued
    weights_copied: Any = None  # recorded when its new weights' host-to-device copy was issued


@dataclass(eq=False)
class BucketRecord:
    """One bucket of one flat buffer: reduced together in backward, gathered together after a step."""

    index: int  # position in its flat buffer's buckets
    buffer: int  # which flat buffer of the optimizer
    params: tuple[ParamRecord, ...]
    global_range: Range  # its elements of the flat buffer, padding up to the next bucket included
    local: Range  # this rank's part of it, relative to the start of this rank's shard (may be empty)
    pieces: tuple[Range, ...]  # each rank's part of it, relative to the bucket start: how its reduction is cut
    gather_pieces: tuple[Range, ...]  # each rank's global range of it: what its weight all-gather assembles
    position: int = -1  # its place among every bucket of the optimizer (group._rounds)
    launch: int | None = None  # its place in the launch order the ranks agreed on; None until the first round
    ready: int = 0  # parameters in for the open round
    state: BucketState = BucketState.WAITING
    staging: Tensor | None = None  # stage 2: 1D, grad dtype, the bucket's gradients while it is reduced
    landing: Tensor | None = None  # stage 2: 1D, where its reduction lands when not in the gradient shard itself
    grad_view: Tensor | None = None  # stage 1: 1D, its part of the flat gradient
    gather: Gather | None = None  # the weight all-gather step() started and nobody waited for yet (a Pending)
    host: HostCopy | None = None  # offload="cpu": its part of the shard in host memory, and the copies' events

    # -- the verbs: outside build_records, every field changes in one of these ------------------
    def to(self, state: BucketState) -> None:
        """The one place ``state`` changes; WAITING (the next round) counts no parameter in."""
        if state not in _BUCKET_NEXT[self.state]:
            raise AssertionError(f"bucket {self.index} of buffer {self.buffer} cannot go from {self.state} to {state}")
        self.state = state
        if state is BucketState.WAITING:
            self.ready = 0

    def placed(self, position: int) -> None:
        """Its place among every bucket of the optimizer."""
        self.position = position

    def ordered(self, launch: int) -> None:
        """Its place in the launch order the ranks agreed on (group._rounds [Note: launch order])."""
        self.launch = launch

    def one_ready(self) -> None:
        """One more of its parameters is in for the open round."""
        self.ready += 1

    def stage(self, staging: Tensor | None) -> None:
        """Stage 2: the buffer its gradients are reduced from (None: freed)."""
        self.staging = staging

    def land_in(self, landing: Tensor | None) -> None:
        """Stage 2: where its reduction lands before it goes into the gradient shard (None: in the shard itself)."""
        self.landing = landing

    def view_grad(self, grad_view: Tensor) -> None:
        """Stage 1: its part of the flat gradient, and each parameter's own view of it (made once:
        the hook hands the same tensor back to ``p.grad`` at every backward pass)."""
        self.grad_view = grad_view
        for p in self.params:
            p.grad_view = grad_view[p.at].view(p.span.shape)
            p.grad_ptr = grad_view.data_ptr() + p.at.start * grad_view.element_size() if p.span.numel else 0

    def gathering(self, pending: Gather | None) -> Gather | None:
        """Its weight gather is ``pending`` (None: waited for); returns the one it held."""
        held, self.gather = self.gather, pending
        return held

    def offloaded(self, host: HostCopy) -> None:
        """``offload="cpu"``: its part of the shard in host memory."""
        self.host = host

    @property
    def complete(self) -> bool:
        """Every parameter of it is in for the open round. A question."""
        return self.ready >= len(self.params)

    @property
    def may_nest(self) -> bool:
        """Some parameter was used only inside reentrant checkpoints: its gradients may come from
        several nested backward passes, so the bucket waits for the end of the outer one."""
        return any(p.gradless for p in self.params)

    def view_of(self, p: ParamRecord) -> Tensor | None:
        """Stage 1: parameter ``p``'s view of the flat gradient, shaped; else None. A question: the
        view made once (``view_grad``), or a new one where that no longer points at its place in the
        flat gradient (``Module.to()`` and friends assign ``p.grad.data``, which re-points it)."""
        view = p.grad_view
        if view is None or not p.grad_ptr or view.data_ptr() == p.grad_ptr:
            return view
        return cast(Tensor, self.grad_view)[p.at].view(p.span.shape)


# -- questions over many records at once, each a pass that runs in C (map, attrgetter, compress):
#    the walks over every parameter at each backward pass and step are made of these
def column(items: Sequence[Any], name: str) -> list[Any]:
    """Field ``name`` of each of ``items`` (records, or the tensors they hold), in order."""
    return list(map(operator.attrgetter(name), items))


def flagged(records: Sequence[ParamRecord], name: str) -> list[ParamRecord]:
    """Those of ``records`` whose field ``name`` is true, in order."""
    return list(compress(records, map(operator.attrgetter(name), records)))


def grads(records: Sequence[ParamRecord]) -> list[Tensor | None]:
    """Each record's ``p.grad``, in order."""
    return column(column(records, "param"), "grad")


def build_records(params: Sequence[torch.nn.Parameter], names: Sequence[str], groups: Sequence[int],
                  layout: FlatLayout, shard_rank: int, buffer: int,
                  dtensors: Sequence[Tensor | None] | None = None) -> tuple[list[ParamRecord], list[BucketRecord]]:
    """The records of one flat buffer laid out by ``layout``, seen from ``shard_rank``;
    ``dtensors``: the DTensor parameter each of ``params`` stands in for, or None. Local."""
    locals_ = layout.local_ranges(shard_rank)
    records = []
    dtensors = dtensors if dtensors is not None else [None] * len(params)
    for i, (p, name, g, span, dt) in enumerate(zip(params, names, groups, layout.params, dtensors)):
        records.append(ParamRecord(param=p, name=name, group=g, span=span, local=locals_.get(i), dtensor=dt))
    buckets = []
    for b in layout.buckets:
        local = b.local if b.piece_numel else Range(0, 0)
        bucket = BucketRecord(index=b.index, buffer=buffer, params=tuple(records[i] for i in b.params),
                              global_range=b.global_range, local=local,
                              pieces=tuple(layout.bucket_pieces(b.index)),
                              gather_pieces=tuple(layout.bucket_shard_ranges(b.index)))
        for r in bucket.params:
            r.bucket = bucket
            r.at = r.span.global_range.relative_to(b.global_range.start).as_slice()
        buckets.append(bucket)
    return records, buckets
