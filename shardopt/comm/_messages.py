"""The control messages: their one shape, the call header each carries, and a call's entry.

Owns the layout of the small all-reduce that ``clip_grad_norm_`` and ``step`` start with, that
each reducing backward pass's round tag and each call every rank makes alike (a checkpoint's
save or load, a state dict's gathering or loading) send too: which numbers each rank puts in,
where they sit, and how the reduced tensor is read back (``StepMessage``); the call header that
says which call a rank is in (``call_header``, ``check_calls``); and the entry of a call every
rank makes (``enter``). The modules that fill the other fields (``step._agreement`` for the
hyperparameter digest, ``step._usage_checks`` for the check flags) take their lengths from here,
so nothing else does index arithmetic on it. Every decision that leads to a collective after a
message is taken from the reduced message, never from a rank-local value. The messages travel on
the control group (``_control``), sent by ``_collectives.Comm.control_all_reduce``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import torch
from torch import Tensor

from shardopt.comm._control import ControlGone, ControlTimeout
from shardopt.comm._digest import HYPER_LEN as HYPER_LEN  # the hyper field's length, importable from here too
from shardopt.comm._digest import digest_code as digest_code
from shardopt.comm._digest import digests_agree as digests_agree
from shardopt.comm._digest import steps_code as steps_code

if TYPE_CHECKING:
    from shardopt.comm._collectives import Comm

CALL_LEN = 13  # call_header: one slot per call (CALLS), a lost round as (a, -a)
CHECKS_LEN = 8  # _usage_checks.UsageChecks.flags


@dataclass
class StepMessage:
    """One rank's part of the step's all-reduce, or (after ``reduced``) every rank's, summed or maxed."""

    nonfinite: Tensor | float  # > 0: some element of the gradient is inf/NaN
    norm: Tensor | float  # the gradient's norm to the power p (or its max for the inf-norm)
    call: Sequence[float]  # which optimizer call this rank is in, whether it lost a round
    checks: Sequence[float]  # the usage checks' flags
    hyper: Sequence[float]  # the hyperparameters' digest

    LENGTHS: ClassVar[dict[str, int]] = {"nonfinite": 1, "norm": 1, "call": CALL_LEN, "checks": CHECKS_LEN, "hyper": HYPER_LEN}
    NUMEL = sum(LENGTHS.values())  # elements of the all-reduce

    def pack(self, device: torch.device) -> Tensor:
        """1D fp32, ``NUMEL`` elements, in field order. Local."""
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            t = v.reshape(-1).float() if isinstance(v, Tensor) else torch.tensor(
                [float(v)] if f.name in ("nonfinite", "norm") else [float(x) for x in v], dtype=torch.float32)
            if t.numel() != self.LENGTHS[f.name]:
                raise AssertionError(f"step message field {f.name} has {t.numel()} numbers, its slot "
                                     f"{self.LENGTHS[f.name]}")
            parts.append(t.to(device))
        return torch.cat(parts)

    @classmethod
    def tag(cls, call: Sequence[float], hyper: Sequence[float] | None = None) -> StepMessage:
        """A message that carries only a call header: each backward pass's round tag, which has the
        step's shape so that a rank in a backward pass meets a rank in a step (``hyper``: the
        round tag's ``steps_code``; none for a call's entry)."""
        return cls(0.0, 0.0, call, [0.0] * CHECKS_LEN, list(hyper) if hyper is not None else [0.0] * HYPER_LEN)

    @classmethod
    def reduced(cls, t: Tensor) -> StepMessage:
        """Read back the reduced tensor: every field as plain floats. Local (one device sync)."""
        values = t.tolist()
        out: dict[str, Any] = {}
        at = 0
        for name, n in cls.LENGTHS.items():
            out[name] = values[at] if name in ("nonfinite", "norm") else values[at:at + n]
            at += n
        return cls(**out)


# [Note: ranks in different calls]
# clip_grad_norm_ and step each start with the same small all-reduce, and so does every round of
# gradient reductions (its tag; see _rounds [Note: a round that did not end]) and every call that
# every rank must make alike (a checkpoint's save or load, a full state dict's gathering, a state
# dict's loading). One rank in clip_grad_norm_ (say, to log the norm on rank 0 only) would pair with
# another rank's step, a rank that skipped a step with the others' step, a rank saving under
# ``if rank == 0:`` with the others' next backward pass: the norm, the clipping, the gradients or
# the checkpoint would silently mix, or gloo would abort the process on buffers of different
# sizes. Each rank adds a header to that all-reduce: one slot per call, 1 in its own call's slot
# and 0 elsewhere, then whether it lost a round since the last step (a backward pass that raised
# there) as (a, -a). Summed, each slot counts the ranks in that call; maxed, it says whether any
# rank is in it (and max(a), max(-a) tell whether the ranks agree on a). So every rank sees the
# same difference, names the other call, and raises.
CALLS = ("clip_grad_norm_", "step", "backward", "save_checkpoint", "load_checkpoint", "full_state_dict",
         "load_full_state_dict", "load_state_dict", "consolidate_state_dict",
         "refresh_master_weights", "joined")  # one slot each in the header, in this order
# "joined" is no call: the slot of a rank that ran out of inputs inside torch.distributed.algorithms.Join
# and shadows the others' calls (see optimizer [Note: uneven inputs]); it counts the joined ranks.
_CALL_NAMES = {"clip_grad_norm_": "clip_grad_norm_()", "step": "step()", "backward": "a backward pass",
               "save_checkpoint": "save_checkpoint()", "load_checkpoint": "load_checkpoint()",
               "full_state_dict": "full_state_dict()",
               "load_full_state_dict": "load_full_state_dict()", "load_state_dict": "load_state_dict()",
               "consolidate_state_dict": "consolidate_state_dict()",
               "refresh_master_weights": "refresh_master_weights()", "joined": "a Join's shadow of the calls"}
if len(CALLS) + 2 != CALL_LEN:  # checked at import, also under python -O
    raise AssertionError(f"_messages.CALL_LEN is {CALL_LEN}: one slot per call ({len(CALLS)}), then (a, -a)")


def call_header(call: str, lost_round: bool) -> list[float]:
    """This rank's header (see [Note: ranks in different calls]); ``call`` "joined" for a rank that
    shadows the others' calls inside a Join (it adds to no call and says nothing of lost rounds)."""
    a = 0.0 if call == "joined" else float(lost_round)
    return [float(c == call) for c in CALLS] + [a, -a]


def _every_rank_calls(call: str) -> bool:
    return call not in ("clip_grad_norm_", "step", "backward", "joined")


def joined_ranks(header: Sequence[float]) -> int:
    """How many ranks shadow the others' calls inside a Join, from a summed header."""
    return int(header[CALLS.index("joined")])


def the_call(header: Sequence[float]) -> str | None:
    """The call the ranks that are not joined are in, from a summed header; None when they are in
    several (every rank raises at its own check then)."""
    calls = [c for c, n in zip(CALLS, header) if n > 0 and c != "joined"]
    return calls[0] if len(calls) == 1 else None


def check_calls(header: Sequence[float], call: str, lost_round: bool, world_size: int, maxed: bool) -> None:
    """Raise RuntimeError unless ``header`` (every rank's ``call_header``, summed or maxed) shows
    every rank in ``call`` with the same ``lost_round``; ranks that joined inside a Join (summed
    headers only) shadow ``clip_grad_norm_``, ``step`` and backward passes, not the calls every rank
    makes. Every rank, with the same ``header``."""
    a = float(lost_round)
    slots = dict(zip(CALLS, header[:len(CALLS)]))
    joined = 0 if maxed else int(slots["joined"])
    n = 1 if maxed else world_size - joined
    others = [c for c in CALLS if c not in (call, "joined") and slots[c] > 0]
    same_call = slots[call] == n and not others
    same_loss = header[-2] == n * a and header[-1] == -n * a
    if joined and same_call and _every_rank_calls(call):
        raise RuntimeError(f"{_CALL_NAMES[call]} ran inside torch.distributed.algorithms.Join while {joined} of "
                           f"{world_size} ranks had run out of inputs and joined: it must be called on every rank, "
                           f"and joined ranks only shadow training steps; call {call}() after the Join block")
    if same_call and same_loss:
        return
    lost = ""
    if not same_loss:
        who = "this rank's backward pass" if lost_round else (
            "the backward pass of another rank" if maxed else f"the backward pass of {int(header[-2])} of {world_size} ranks")
        lost = (f"{who} raised after its gradient reductions had started, and training went on there, so the ranks "
                "no longer hold the same gradients; let such an exception end training on every rank, or catch it on "
                "every rank alike (then zero_grad() and go on)")
    if same_call:
        raise RuntimeError(f"ranks fell out of step: {lost}")
    other = _CALL_NAMES[others[0]] if others else "another call"
    alone = next((c for c in (call, *others) if _every_rank_calls(c)), None)
    if alone is not None:
        hint = (f"{alone}() must be called on every rank of the optimizer's group, at the same point (each rank writes "
                f"or reads its own shard): call it on every rank, not under `if rank == 0:`")
    elif {call, *others} == {"clip_grad_norm_", "step"}:
        hint = ("call clip_grad_norm_ and step on every rank, in the same order (to log the norm on one rank, call "
                "clip_grad_norm_ everywhere and log its result there)")
    else:
        hint = ("a rank skipped step() or ran more backward passes than the others, e.g. it caught an exception "
                "from its backward pass and went on to the next batch, or it alone called opt.zero_grad() between "
                "backward and step, which drops the averaged gradients there, or it alone assigned gradients by "
                "hand (p.grad = g, reduced by a round of their own at the step); call backward, clip_grad_norm_, "
                "zero_grad and step, and assign gradients, alike on every rank")
    raise RuntimeError(f"ranks are in different optimizer calls: this rank is in {_CALL_NAMES[call]}, another rank "
                       f"in {other}; {hint}" + (f". Also, {lost}" if lost else ""))


ENTRY_TIMEOUT = 60.0  # seconds, by default, that a rank waits for the others to enter a call every rank makes


def entry_deadline(timeout: float | None) -> float | None:
    """Seconds a rank waits for the others to enter a call: ``timeout``, ``ENTRY_TIMEOUT`` when
    None; None (the comm's timeout, else the group's own, as a step waits) for ``math.inf``."""
    if timeout is None:
        return ENTRY_TIMEOUT
    return None if math.isinf(timeout) else timeout


def enter(comm: Comm, call: str, *, lost_round: bool = False, deadline: float | None = None) -> None:
    """Agree that every rank of ``comm``'s group is in ``call`` (a name of ``CALLS``
    that every rank must make alike, e.g. ``"save_checkpoint"``): one all-reduce of the step's
    shape on the control group, before anything else of the call. Raises RuntimeError on every
    rank when some rank is in another call (it meets this message with its own); TimeoutError on
    this rank when no answer came within ``deadline`` seconds (``ENTRY_TIMEOUT`` when None;
    ``math.inf``: as long as a step waits, the comm's timeout or else the group's own): the
    other ranks are elsewhere (in a collective of their own, or in other work); RuntimeError on
    this rank when another rank had already given up waiting for it in a call like this one. After
    either of the last two, this rank's control group can no longer be used (see _collectives
    [Note: shardopt's own control group]). Every rank."""
    header = StepMessage.tag(call_header(call, lost_round)).pack(torch.device("cpu"))
    advice = (f"{call}() must be called on every rank of the optimizer's group, at the same point (each rank writes "
              f"or reads its own shard), not under `if rank == 0:`; where one rank legitimately arrives later (it "
              f"does work of its own first), pass a larger timeout= to {call}() or to the optimizer")
    with comm.during(f"{call}()"):
        try:
            comm.control_all_reduce(header, deadline=entry_deadline(deadline)).wait()
        except ControlTimeout as e:
            why = (f"rank {comm.rank} of {comm.world_size}: {call}() waited {e.waited:g} s for the other ranks to "
                   f"call it too. {advice}")
            comm.give_up(f"shardopt can no longer agree with the other ranks on this rank: {why}. Restart every rank "
                         "(the last complete checkpoint is intact)")
            raise TimeoutError(why) from None
        except ControlGone as e:  # a rank gave up waiting for this one (it left a line saying so), or died
            why = (f"rank {comm.rank} of {comm.world_size}: {call}() could not meet the other ranks: {e.why}. "
                   + (advice if e.noticed else "Restart every rank and resume from the last complete checkpoint"))
            comm.give_up(f"shardopt can no longer agree with the other ranks on this rank: {why}. Restart every rank "
                         "(the last complete checkpoint is intact)")
            raise RuntimeError(why) from None
    check_calls(StepMessage.reduced(header).call, call, lost_round, comm.world_size, maxed=False)
