"""The gradients an optimizer leaves in ``p.grad`` when it stops training the parameters, and how the
next optimizer over them takes them.

[Note: gradients left to the next optimizer]
In torch a gradient lives in ``p.grad``, whatever becomes of the optimizer: an optimizer built over
the parameters after a backward pass steps on it. A ShardedAdamW with stage=2 (and either stage
while a 16-bit gradient is summed in fp32 under no_sync) holds the gradients itself, and ``p.grad``
is a placeholder without values (see _grad_placeholder). When it stops training them (``close()``,
superseded by a new optimizer over them, or collected by the garbage collector while its
placeholders are out), ``FlatGroup.release`` hands each placeholder in ``p.grad`` what holds its
values: the :class:`LeftGrads` of its flat buffer (this rank's shard of the averaged gradient, the
fp32 sums under no_sync, the layout, the group), with the parameter's index and whether it had a
gradient on this rank. A ``LeftGrads`` holds no parameter, so the placeholder can keep it past the
optimizer's life without a cycle (``.grad`` is held from C++, where the garbage collector cannot
follow one back to the parameter); it holds memory only as long as a placeholder refers to it, as
torch's ``p.grad`` does.

A shard must be gathered over the ranks to become whole gradients: a collective. ``close()`` is
local and a collection happens at no agreed point, so the gathering waits for the place where
every rank is: the construction of the next ShardedAdamW over the parameters (``take_left``,
after ``take_over`` released the previous owner). There the ranks first agree on which
parameters hold such placeholders (one small all-gather, every construction; a difference raises
on every rank, as zeroing on some ranks only does at a step), gather each buffer's shard, and put
in ``p.grad`` what torch would hold: the averaged gradient (plus what autograd added to the
placeholder since, and this rank's fp32 sum under no_sync), zeros for a placeholder zeroed since
(``zero_grad(set_to_none=False)``, ``p.grad.zero_()``), and None for a parameter that no rank had
a gradient for (its average is zero and this rank had none: with none there, the new optimizer
leaves it alone as torch does; where another rank had a gradient that averaged to zero, that
rank's zeros still make it trained). The new optimizer then takes these tensors as gradients there
when it was built: averaged over the ranks again, which changes nothing for a gradient that is
alike on every rank.

[Note: the loss scale of left gradients]
With fp16 loss scaling the gradients an optimizer leaves carry the scale its ``opt.backward(loss)``
applied, and the step of the optimizer that made them would have divided it out; a new optimizer
takes a gradient it finds in ``p.grad`` as assigned by hand, carrying none. So what is left says
how it was made (:class:`LeftScale`: that loss scale and the backward passes since the old
optimizer's last step, by how they were started, see step._usage_checks [Note: the loss scale a
gradient carries]): the placeholders through their ``LeftGrads``, stage 1's views of the flat
gradient by a weak tag on the tensor (``tag_left``). At the construction ``take_left`` brings
each such gradient to the new optimizer's loss scale (multiplied by the ratio of the scales, powers
of two for dynamic scaling: exact unless it overflows, which then skips the step as any overflow
does) and returns how it was made, which the new optimizer's flat groups count as the backward passes
since its last step. The tensor it puts in ``p.grad`` is tagged again, at the new scale: the new
optimizer holds it as a gradient there when it was built, neither its view nor its placeholder,
and where it is still there when that one stops training (closed or dropped before a backward
pass, clip or step took it), a third optimizer finds the scale it carries; a gradient assigned by
hand carries no tag, and a change in place since (a zeroing, a backward pass outside any
optimizer) shows in its version. So a new ``opt.backward(loss)`` adds at the same scale, the step
divides it out once, and a plain ``loss.backward()`` added to scaled left gradients raises at the
step, as it does beside ``opt.backward(loss)`` in one optimizer. On this rank a left
gradient carries the old scale where ``opt.backward`` made it (``scaled`` or ``carried``), and
none where only plain backward passes did; the old optimizer's step counted none since (it took
them and was not zeroed): the scale that step divided out. A pipeline stage whose gradients came
only from a plain ``act.backward(g)`` takes its scale from the other stages at the step: if the
loss scale changed with the new optimizer, those are taken at the wrong one (run
``opt.backward(act, gradient=g)`` there).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence, cast

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from shardopt.comm._collectives import Comm
from shardopt.core._flat import ShardView
from shardopt.core._layout import FlatLayout
from shardopt.group._grad_placeholder import GradPlaceholder, is_placeholder


@dataclass(frozen=True)
class LeftScale:
    """How the gradients one optimizer left on this rank were made (see [Note: the loss scale of
    left gradients])."""

    scale: float  # the loss scale opt.backward applied when they were made
    scaled: int  # backward passes since that optimizer's last step through opt.backward(loss) (see group._intake.Backward)
    carried: int  # ... through opt.backward(t, gradient=g) beside model_parallel_group= axes
    unscaled: int  # ... outside opt.backward, or gradients assigned by hand

    @classmethod
    def of(cls, scaled: int, carried: int, unscaled: int, scale: float, stepped_at: float) -> LeftScale:
        """From an optimizer's backward passes since its last step and its loss scale now
        (``scale``); ``stepped_at``: the scale its last step divided out, which the gradients carry
        when no backward pass ran since (that step took them)."""
        if scaled or carried or unscaled:
            return cls(scale, scaled, carried, unscaled)
        return cls(stepped_at, int(stepped_at != 1.0), 0, int(stepped_at == 1.0))

    def carries(self) -> float:
        """The loss scale the gradients are at on this rank. A question."""
        return self.scale if self.scaled or self.carried else 1.0

    def added_to(self) -> LeftScale:
        """The same, with a backward pass outside any optimizer added since it was left."""
        return replace(self, unscaled=self.unscaled + 1)


# Stage 1's views of the flat gradient that an optimizer left in p.grad, and the gradients take_left
# put there: how they were made, and the tensor's version then (a later change in place is a
# backward pass added or a zeroing).
_TAGGED: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def tag_left(grad: Tensor, made: LeftScale) -> None:
    """Say how ``grad``, a gradient an optimizer leaves in ``p.grad`` as it is (or ``take_left``
    puts there), was made and the loss scale it is at (see [Note: the loss scale of left
    gradients]). Local."""
    _TAGGED[grad] = (made, grad._version)


@dataclass(eq=False)
class LeftGrads:
    """The gradients of one flat buffer whose optimizer no longer trains it, as this rank holds
    them (see [Note: gradients left to the next optimizer]). Holds no parameter."""

    comm: Comm  # the buffer's data-parallel group: the shard is gathered over its shard group
    layout: FlatLayout
    dtype: torch.dtype  # the gradients' (the parameters') dtype
    shard: Tensor | None  # 1D: this rank's shard of the averaged gradient, grad dtype or an fp32 sum; None: no reduction since zero_grad
    accum: Tensor | None  # 1D fp32, the whole buffer: this rank's 16-bit gradients summed under no_sync; None: none
    made: LeftScale  # how they were made: the loss scale they carry (see [Note: the loss scale of left gradients])

    def key(self) -> tuple[int, int, int, bool]:
        """What the ranks must agree on before gathering: the buffer's size, shard size and ranks,
        and whether there is a shard to gather. A question."""
        return self.layout.numel, self.layout.shard_numel, self.comm.shard_size, self.shard is not None

    def gather(self) -> Tensor | None:
        """The whole averaged gradient (1D, grad dtype, the whole buffer): every rank's shard,
        gathered; None without a shard. Every rank of the shard group, in the same order of
        buffers, or (without a shard, on every rank alike: see ``key``) none."""
        if self.shard is None:
            return None
        layout, comm = self.layout, self.comm
        whole = torch.zeros(layout.numel, dtype=self.dtype, device=self.shard.device)
        ShardView(whole, layout.shard_runs(comm.shard_rank), layout.shard_numel).copy_(self.shard)
        pending = [comm.all_gather_inplace(whole, layout.bucket_shard_ranges(b.index)) for b in layout.buckets]
        for p in pending:
            p.wait()
        return whole

    def grad_of(self, index: int, ph: GradPlaceholder, used: bool, whole: Tensor | None) -> Tensor | None:
        """What ``p.grad`` holds in torch for parameter ``index`` of the buffer, whose placeholder
        is ``ph`` and which had a gradient on this rank (``used``) when it was left (see [Note:
        gradients left to the next optimizer]); ``whole``: what ``gather`` returned. Local."""
        span = self.layout.params[index]
        at = span.global_range.as_slice()
        if ph.zeroed:  # zeroed since the last round: the shard still holds what came before
            grad = torch.zeros(span.shape, dtype=self.dtype, device=ph.device)
        else:
            grad = (whole[at].view(span.shape).clone() if whole is not None else
                    torch.zeros(span.shape, dtype=self.dtype, device=ph.device))
            if ph.accumulating and self.accum is not None:
                grad += self.accum[at].view(span.shape).to(self.dtype)
        grad = grad.to(dtype=ph.dtype, device=ph.device)  # a placeholder converted since (module.to)
        # No gradient on this rank and an average of zero: no rank had one (None, as in torch); a
        # zeroed one is a zero gradient where it had one.
        present = used or ph.pending is not None or (not ph.zeroed and bool(grad.any()))
        if ph.pending is not None:  # autograd added to it after the optimizer stopped taking gradients
            grad += ph.pending
        return grad if present else None


def take_left(params: Sequence[Tensor], comm: Comm, names: dict[int, str], scale: float) -> list[LeftScale]:
    """Replace each placeholder an earlier optimizer left in ``p.grad`` of ``params`` by the
    gradient torch would hold there (see [Note: gradients left to the next optimizer]), and bring
    every gradient an earlier optimizer left to ``scale``, the loss scale of the optimizer being
    built, tagging each (see [Note: the loss scale of left gradients]); returns how the gradients
    it found were made, once each, for that optimizer to count. ``names``: how messages name a
    parameter, by ``id``. Every rank of ``comm``, at the construction of the optimizer over ``params`` (the same
    parameters in the same order on every rank), after the previous owners were released; raises
    RuntimeError on every rank when the ranks hold such placeholders for different parameters. One
    small all-gather; one all-gather per bucket of each buffer whose shard is gathered."""
    made = [m for p in params if (m := _take_view(p, scale)) is not None]
    found = [(i, p, cast(GradPlaceholder, p.grad)) for i, p in enumerate(params) if is_placeholder(p.grad)]
    mine = [(i, None if ph.left is None else ph.left[0].key()) for i, _, ph in found]
    if not comm.same_everywhere(mine):
        every = comm.all_gather_objects(mine)
        _raise_difference(every, [names.get(id(p), f"#{i}") for i, p in enumerate(params)])
    if not found:
        return list(dict.fromkeys(made))
    lost = [names.get(id(p), f"#{i}") for i, p, ph in found if ph.left is None]
    if lost:  # alike on every rank: the keys were compared
        raise RuntimeError(
            f"building the optimizer: p.grad of {', '.join(lost[:5])}{' ...' if len(lost) > 5 else ''} holds the "
            "gradient placeholder of a shardopt optimizer that holds the values no more, so the gradient there is "
            "lost; call model.zero_grad() (or set p.grad = None) before building the new optimizer")
    wholes: dict[int, Tensor | None] = {}  # by id of each LeftGrads, in the order of the parameters: alike on every rank
    for _, _, ph in found:
        left = cast(tuple, ph.left)[0]
        if id(left) not in wholes:
            with left.comm.during("the construction of an optimizer over parameters an earlier one trained"):
                wholes[id(left)] = left.gather()
    for _, p, ph in found:
        left, index, used = cast(tuple, ph.left)
        how = left.made.added_to() if ph.pending is not None else left.made
        zeroed = ph.zeroed and ph.pending is None  # zeros: at every scale
        p.grad = _at_scale(left.grad_of(index, ph, used, wholes[id(left)]), how, scale)
        if p.grad is not None and not zeroed:
            tag_left(p.grad, replace(how, scale=scale))
            made.append(how)
    return list(dict.fromkeys(made))


def _take_view(p: Tensor, scale: float) -> LeftScale | None:
    """A gradient an earlier optimizer left in ``p.grad`` as a tensor (tagged by ``tag_left``: a
    stage-1 view, or what it took from one before it): bring it to ``scale``, tagged at it, and say
    how it was made; None for any other ``p.grad`` or a zero one. Local."""
    g = p.grad
    if g is None or is_placeholder(g):
        return None
    tag = _TAGGED.get(g)
    if tag is None:
        return None
    del _TAGGED[g]
    how, version = tag
    if g._version != version:  # changed in place since: zeroed, or a backward pass outside any optimizer added to it
        if not bool(g.any()):
            return None
        how = how.added_to()
    g = cast(Tensor, _at_scale(g, how, scale))
    p.grad = g
    tag_left(g, replace(how, scale=scale))
    return how


def _at_scale(grad: Tensor | None, how: LeftScale, scale: float) -> Tensor | None:
    """``grad``, made as ``how`` says, brought to the loss scale ``scale``: a new tensor (computed in
    fp32, rounded once to its dtype; a view of the old optimizer's buffer stays as it was), or
    ``grad`` itself where it is at that scale."""
    if grad is None or how.carries() == scale:
        return grad
    return (grad.float() * (scale / how.carries())).to(grad.dtype)


def _raise_difference(every: list[list[tuple[int, tuple | None]]], names: list[str]) -> None:
    """Raise, on every rank alike, the first parameter whose left placeholder differs between rank
    0 and another rank (``every``: each rank's ``(index, key)`` pairs)."""
    for r, theirs in enumerate(every):
        ours, other = dict(every[0]), dict(theirs)
        for i in sorted(set(ours) | set(other)):
            if ours.get(i, "none") == other.get(i, "none"):
                continue
            has = [q for q, e in ((0, ours), (r, other)) if i in e]
            lacks = [q for q in (0, r) if q not in has]
            what = (f"holds the gradient an earlier shardopt optimizer left there on rank {has[0]} but not on rank "
                    f"{lacks[0]}") if lacks else "holds the gradients of differently built earlier optimizers on ranks 0 and " + str(r)
            raise RuntimeError(
                f"building the optimizer: p.grad of {names[i]} {what}, so the ranks would start from different "
                "gradients; zero the gradients (model.zero_grad() or opt.zero_grad()) alike on every rank before "
                "building a new optimizer over the parameters")
    raise AssertionError("unreachable: the ranks' placeholders differ but no difference was found")
