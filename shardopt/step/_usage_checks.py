"""The per-step checks that keep ordinary torch usage from silently corrupting training.

Owns: what changed on this rank since the last step behind the optimizer's back (parameters
re-bound or written from outside, parameters unfrozen that were frozen at construction, backward
passes that skipped ``opt.backward``), how those findings ride in the step's one all-reduce as
numbers, and what every rank does once they are summed over ranks (raise everywhere, take
written weights as master weights, skip parameters no rank has a gradient for, pick the loss
scale the gradients carry). See docs/design.md, "Ordinary torch usage is followed or refused".

[Note: the loss scale a gradient carries]
``opt.backward(loss)`` multiplies the loss by the loss scale, so the gradients it makes carry it;
``loss.backward()`` does not. Which one ran is known only where it ran, and a backward pass that
starts from a gradient cannot be told from one that starts from a loss: a pipeline stage runs
``act.backward(g)`` (or ``opt.backward(act, gradient=g)``, which does not multiply again) from the
gradient ``g`` the next stage sent back, and ``g`` carries whatever scale the next stage's backward
applied. Only beside the axes of ``model_parallel_group=`` can ``g`` come from another stage (a
DTensor mesh is a tensor-parallel axis, whose ranks run one backward pass together, never a
pipeline's): without them ``opt.backward(t, gradient=g)`` takes ``g`` as a gradient of one's own, carrying no scale, and
multiplies it as it multiplies a loss (counted as through ``opt.backward(loss)``; beside
``opt.backward(loss)`` in one step it would otherwise be divided by a scale it never had). So each
rank counts its backward passes since the last step by how they were started
(``group._intake.Backward``: through ``opt.backward(loss)``, through ``opt.backward(t,
gradient=g)`` beside ``model_parallel_group=`` axes, or neither; gradients assigned by hand count as neither), the counts are summed
over the data-parallel group in the step's message and then over the model axes (``Scaling``,
see comm._model_axes [Note: the whole model's agreement]), and every rank of the model decides
alike: if some rank of the model ran ``opt.backward(loss)``, every gradient of the model carries
the loss scale (the other stages' gradients started from the gradients it sent back); if none
did, none does, and the gradients are taken as unscaled with a warning (small fp16 gradients
underflow). A part of the model whose ranks ran both ``opt.backward(loss)`` and plain backward
passes has gradients with two scales summed: every rank of the model raises.
"""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from shardopt.comm._collectives import Comm
from shardopt.core._compat import compiled_inner
from shardopt.core._ownership import owned_hook
from shardopt.core._records import flagged

if TYPE_CHECKING:
    import weakref


    from shardopt.core._records import ParamRecord
    from shardopt.group._flat_group import FlatGroup, LateProblems

log = logging.getLogger("shardopt")


@dataclass
class Findings:
    """What one rank found; ``flags()`` turns it into the numbers that are summed over ranks."""

    written: list[list[ParamRecord]]  # per buffer: records of parameters written from outside
    problems: list[str]  # messages of problems that stop training
    scaled: int = 0  # backward passes since the last step through opt.backward(loss)
    unscaled: int = 0  # ... outside opt.backward (or gradients assigned by hand)
    carried: int = 0  # ... through opt.backward(t, gradient=g)
    used: list[list[bool]] = field(default_factory=list)  # per buffer, in buffer order: got a gradient on this rank
    regraded: bool = False  # averaged gradients were zeroed or replaced on this rank since their round
    joined: bool = False  # this rank shadows the others inside a Join: it has no gradient and takes no side


@dataclass
class Scaling:
    """The backward passes since the last step by how they were started, summed over ranks (see
    [Note: the loss scale a gradient carries]); what decides the loss scale the gradients carry."""

    scaled: float  # through opt.backward(loss)
    unscaled: float  # outside opt.backward, or gradients assigned by hand
    carried: float  # through opt.backward(t, gradient=g)
    mixed: float  # parts of the model whose ranks ran both opt.backward(loss) and plain backward passes

    @classmethod
    def of(cls, summed: Sequence[float]) -> Scaling:
        """From ``UsageChecks.flags`` summed (or maxed) over one data-parallel group."""
        scaled, unscaled, carried = summed[1:4]
        return cls(scaled, unscaled, carried, float(scaled > 0 and unscaled > 0))

    def numbers(self) -> list[float]:
        """In field order: what the follow-up over the model axes sums."""
        return [self.scaled, self.unscaled, self.carried, self.mixed]


@dataclass
class Followed:
    """What ``UsageChecks.follow`` found on this rank, for ``local``."""

    regraded: bool = False  # averaged gradients were zeroed or replaced since their round
    # per buffer: (records written from outside, those re-bound included; problems), see ParamBinding.follow
    bindings: list[tuple[list[ParamRecord], list[str]]] = field(default_factory=list)


class UsageChecks:
    """The checks of one ``ShardedAdamW``: ``local()`` on this rank, then ``apply()`` on the summed
    flags. ``buffers`` are the optimizer's flat groups (group._flat_group): their records,
    gradients and binding are read; ``late``: the problems found outside a check, shared with them."""

    def __init__(self, buffers: Sequence[FlatGroup], untracked: Sequence[torch.nn.Parameter],
                 names: dict[int, str], comm: Comm, late: LateProblems) -> None:
        self.buffers, self.untracked, self.names, self.comm = list(buffers), list(untracked), names, comm
        self.grad_scale = 1.0  # the loss scale the gradients of the coming step carry
        self.seconds = 0.0  # time spent in local() and apply() since the last reset, seconds
        self.late = late  # found outside a check, in order (a write racing a gather, into opt.state): the next check's
        self._warned_unscaled = False
        self.zeroed_after_round = False  # opt.zero_grad() dropped averaged gradients (see _raise_regraded)

    def follow(self) -> Followed:
        """Before the step's findings: follow what changed on this rank behind the optimizer's back
        (stage 1's ``p.grad`` set to None or replaced, gradients zeroed by hand, parameters given
        new storage of their own kind), and say what was found. Local."""
        start = time.perf_counter()
        followed = Followed()
        for b in self.buffers:
            followed.regraded |= b.follow_views()
            followed.regraded |= b.apply_zeroing(at_step=True)
            followed.bindings.append(b.binding.follow())
        self.seconds += time.perf_counter() - start
        return followed

    def local(self, followed: Followed) -> Findings:
        """What this rank found since the last step (after ``follow``, whose findings are
        ``followed``): writes, problems, gradients. A question: ``forget`` clears what it reported
        once the step acted on it. Local; no communication."""
        start = time.perf_counter()
        found = Findings(written=[], problems=list(self.late.found),
                         regraded=self.zeroed_after_round or followed.regraded)
        for b, (written, problems) in zip(self.buffers, followed.bindings):
            found.problems += b.problems
            replaced = flagged(b.records, "replaced")
            found.regraded |= bool(replaced)
            for r in replaced:
                found.problems.append(
                    f"p.grad of parameter {r.name} was replaced by a tensor after backward. With "
                    "stage=2 each rank holds only its shard of the averaged gradient, so a gradient "
                    "assigned after backward cannot be averaged any more: assign it before backward (it is then "
                    "added to), change the loss instead, or use stage=1, where p.grad is the averaged gradient")
            found.written.append(written)
            found.problems += problems
            found.scaled += b.scaled_backwards
            found.carried += b.carried_backwards
            found.unscaled += b.unscaled_backwards
            found.used.append([r.used for r in b.records])
        for p in self.untracked:
            if p.requires_grad and p.grad is not None:
                found.problems.append(
                    f"parameter {self.names[id(p)]} had requires_grad=False when the optimizer was built and now has "
                    "a gradient: the optimizer lays out and shards its parameters at construction, so it cannot start "
                    "training this one. Build the optimizer with the parameter trainable and freeze it while it should "
                    "not train (a frozen parameter is left untouched), or build a new optimizer after unfreezing")
        self.seconds += time.perf_counter() - start
        return found

    def forget(self) -> None:
        """The step acted on what ``local`` found: clear the problems and replacements it reported. Local."""
        self.late.clear()
        self.zeroed_after_round = False
        for b in self.buffers:
            b.forget_problems()
            for r in flagged(b.records, "replaced"):
                r.mark_replaced(False)

    def joined(self) -> Findings:
        """What a rank that shadows the others inside a Join reports: no gradient for any parameter,
        nothing written, no problem, no side on whether gradients were changed. Local."""
        return Findings(written=[[] for _ in self.buffers], problems=[], joined=True,
                        used=[[False] * len(b.records) for b in self.buffers])

    def report_late(self, problems: Sequence[str]) -> None:
        """Problems found outside a check (a write into ``opt.state`` that cannot be taken): raised
        by the next check on every rank. Local."""
        self.late.add(problems)

    def take_outside_writes(self, late: Sequence[str] = ()) -> None:
        """Only the written-weights part of the checks, as small collectives: before a checkpoint
        or an export reads the master weights. ``late``: problems found on this rank before (writes
        into ``opt.state`` that cannot be taken), raised on every rank with the others. Every rank."""
        found = Findings(written=[], problems=list(late))
        for b in self.buffers:
            written, problems = b.binding.follow()
            found.written.append(written)
            found.problems += problems
            found.used.append([True] * len(b.records))
        head = torch.tensor([len(found.problems), sum(map(len, found.written))], dtype=torch.float32,
                            device=self.buffers[0].flat.device)
        self.comm.all_reduce_max(head).wait()
        n_problems, n_written = head.tolist()
        self._raise_if(n_problems, found)
        if n_written > 0:
            for b, changed in zip(self.buffers, self._exchange_bitmaps(found)[1]):
                if changed:
                    b.take_model_weights(changed)

    def _raise_if(self, n_problems: float, found: Findings) -> None:
        if n_problems > 0:
            every = self.comm.all_gather_objects(found.problems)
            rank, first = next((r, msgs[0]) for r, msgs in enumerate(every) if msgs)
            raise RuntimeError(first if rank == self.comm.rank else f"on rank {rank}: {first}")

    # [Note: gradients changed on some ranks only]
    # Once a round has averaged the gradients, every rank holds its shard of the same average.
    # Zeroing or replacing them (``model.zero_grad()``, ``p.grad = None``, stage 1's ``p.grad = t``)
    # on every rank alike is torch's behaviour and followed. On some ranks only, the shards would
    # stop being parts of one gradient and the replicas would be trained with different ones
    # (DDP's replicas would diverge), so every rank raises, naming the ranks that changed them.
    def _raise_regraded(self, found: Findings) -> None:
        ranks = [r for r, did in enumerate(self.comm.all_gather_objects(found.regraded)) if did]
        raise RuntimeError(
            f"gradients were zeroed on some ranks only (rank {', '.join(map(str, ranks))}: model.zero_grad(), "
            "opt.zero_grad(), p.grad = None, p.grad.zero_() or p.grad replaced) after backward had averaged them "
            "over the ranks, e.g. between clip_grad_norm_ and step: the ranks would update their shards with "
            "different gradients. Zero gradients on every rank alike (or before backward)")

    def _exchange_bitmaps(self, found: Findings) -> tuple[list[list[bool]], list[list[ParamRecord]]]:
        """Per buffer: which parameters have a gradient on some rank, and the records of those
        written from outside on some rank: one all-reduce (MAX) of two bitmaps. Every rank."""
        parts = []
        for used, written in zip(found.used, found.written):
            changed = torch.zeros(len(used), dtype=torch.float32)
            changed[[r.index for r in written]] = 1.0
            parts += [torch.tensor(used, dtype=torch.float32), changed]
        maps = torch.cat(parts).to(self.buffers[0].flat.device)
        self.comm.all_reduce_max(maps).wait()
        used_out, written_out, offset = [], [], 0
        for b in self.buffers:
            n = len(b.records)
            used_out.append((maps[offset:offset + n] > 0).tolist())
            written_out.append([b.records[i] for i in torch.nonzero(maps[offset + n:offset + 2 * n] > 0).view(-1).tolist()])
            offset += 2 * n
        return used_out, written_out

    def refresh_local(self) -> None:
        """This rank's shard of the master follows the weights written on this rank, without
        communication (for ``state_dict``, which one rank may call alone); the next step still
        takes rank 0's values everywhere. Local."""
        for b in self.buffers:
            written, problems = b.binding.follow()
            if problems:
                raise RuntimeError(problems[0])
            b.refresh_master(written)

    @staticmethod
    def flags(found: Findings) -> list[float]:
        """``StepMessage.checks``, 8 numbers: problems, backward passes through ``opt.backward(loss)``,
        outside it and through ``opt.backward(t, gradient=g)`` (see [Note: the loss scale a gradient
        carries]), parameters without a gradient on this rank, parameters written from outside, and
        whether averaged gradients were zeroed or replaced here, as (yes, no): summed or maxed, both
        are positive exactly when some ranks did and some did not (see [Note: gradients changed on
        some ranks only]). The bitmaps behind the parameter counts are exchanged only when some rank
        has one (``apply``)."""
        not_used = sum(len(u) - sum(u) for u in found.used)
        return [len(found.problems), found.scaled, found.unscaled, found.carried, not_used,
                sum(map(len, found.written)), float(found.regraded), float(not found.regraded and not found.joined)]

    def apply(self, found: Findings, summed: Sequence[float], loss_scale: float,
              scaling: Scaling | None = None) -> None:
        """Act on ``flags`` summed (or maxed) over ranks; ``scaling``: the backward passes over the
        whole model (``Scaling.of(summed)`` summed over the model axes; None: this data-parallel
        group's, where it is the whole model). Every rank, with the same ``summed`` and ``scaling``."""
        start = time.perf_counter()
        n_problems, _, _, _, not_used, n_written, regraded, kept = summed
        scaling = scaling or Scaling.of(summed)
        self._raise_if(n_problems, found)
        if regraded > 0 and kept > 0:
            self._raise_regraded(found)
        if not_used > 0 or n_written > 0:  # some parameter lacks a gradient on some rank, or was written
            trained, written = self._exchange_bitmaps(found)
            for b, flags in zip(self.buffers, trained):
                for r, t in zip(b.records, flags):
                    # beside torchft's replica groups every parameter takes every step: which ones had
                    # gradients is not exchanged between groups (see comm._replicas [Note: replicas through torchft])
                    r.mark_trained(t or self.comm.managed)
        else:  # the usual step: every parameter has a gradient everywhere, nothing was written
            written = [[] for _ in self.buffers]
            for b in self.buffers:
                for r in b.records:
                    r.mark_trained(True)
        for b, changed in zip(self.buffers, written):
            if changed:
                log.info("shardopt: %d parameters were written from outside the optimizer (e.g. load_state_dict); "
                         "rank 0's values become the master weights", len(changed))
                b.take_model_weights(changed)
        self.grad_scale = loss_scale  # see [Note: the loss scale a gradient carries]
        if loss_scale != 1.0 and scaling.mixed > 0:
            raise RuntimeError(
                f"since the last step, some backward passes ran through opt.backward(loss) (scaled by the loss "
                f"scale {loss_scale:g}) and some through loss.backward() (unscaled), on this or another rank holding "
                "the same part of the model, so the summed gradient has no single scale; call opt.backward(loss) for "
                "every backward pass (and opt.backward(t, gradient=g) for one from a gradient another pipeline "
                "stage sent)")
        if loss_scale != 1.0 and scaling.scaled == 0 and scaling.unscaled + scaling.carried > 0:
            self.grad_scale = 1.0
            if not self._warned_unscaled:
                self._warned_unscaled = True
                warnings.warn(
                    f"loss.backward() ran without the loss scale ({loss_scale:g}, dynamic loss scaling for fp16 "
                    "parameters), or gradients were assigned to p.grad by hand, and no rank of the model ran "
                    "opt.backward(loss) since the last step; the gradients are taken as unscaled, but small fp16 "
                    "gradients underflow to zero: call opt.backward(loss) instead of loss.backward() (a pipeline "
                    "stage that runs backward from the gradient the next stage sent takes the scale of that stage's "
                    "opt.backward(loss))",
                    UserWarning, stacklevel=4)
        self.seconds += time.perf_counter() - start


DDP_MESSAGE = ("the model is wrapped in torch.nn.parallel.DistributedDataParallel, but shardopt's optimizer reduces the "
               "gradients itself (DDP would reduce them a second time{what}). Train the bare model: with "
               "transformers.Trainer use shardopt.integrations.hf.ShardedTrainer, with Accelerate "
               "shardopt.integrations.accelerate.prepare(accelerator, model, optimizer, ...), with Lightning "
               "shardopt.integrations.lightning.ShardedStrategy")


def watch_for_ddp(param_ids: set[int], stage: int, owner: weakref.ref) -> torch.utils.hooks.RemovableHandle:
    """A global module forward pre-hook that looks at the first module called whose parameters
    include these (the outermost one of the forward: a DistributedDataParallel wrapper if there is
    one, also under ``torch.compile``) and then removes itself, so that it costs nothing later and
    is gone before a compiled module is traced. A DDP wrapper gets a warning in stage 1 (the
    results are right, the communication doubled) and an error in stage 2 (DDP would write full
    gradients into ``p.grad``), alike on every rank, since every rank runs the same forward.
    ``owner``: a weak reference to the optimizer; once it is freed (built and dropped without a
    step) the hook does nothing, and is removed at the next optimizer's construction (see
    _ownership [Note: hooks of a freed optimizer]), so it never mistakes a new model whose
    parameters reuse freed ids for its own."""
    from torch.nn.parallel import DistributedDataParallel

    handle: list = []

    def hook(module: torch.nn.Module, args: object) -> None:
        if torch.compiler.is_compiling():
            return  # torch.compile's wrapper was looked at eagerly (see _gather_wait [Note: compiled models])
        if owner() is None:
            return  # its optimizer is gone
        if not any(id(p) in param_ids for p in module.parameters()):
            return  # another model: keep watching
        handle[0].remove()
        inner = module
        while (wrapped := compiled_inner(inner)) is not None:  # torch.compile's wrapper
            inner = wrapped
        if not isinstance(inner, DistributedDataParallel):
            return
        if stage == 2:
            raise RuntimeError(DDP_MESSAGE.format(what=", into gradients that stage 2 keeps sharded"))
        warnings.warn(DDP_MESSAGE.format(what=", doubling the communication"), stacklevel=2)

    handle.append(owned_hook(torch.nn.modules.module.register_module_forward_pre_hook(hook), owner))
    return handle[0]
