"""The step's one all-reduce, from what each rank puts in to what every rank does with the sum.

``clip_grad_norm_`` and ``step`` each start with it. Each rank finishes its reduction round, runs
its local usage checks and packs a :class:`StepMessage` (inf/NaN count, norm, which call it is in,
check flags, hyperparameter digest); after the all-reduce every rank reads the same reduced
message and takes the same decisions from it (raise, take written weights, skip parameters
without gradients), so no rank-local value decides whether a rank issues a collective.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Sequence, cast

import torch
from torch import Tensor

from shardopt.comm._collectives import Comm
from shardopt.comm._messages import CALLS, CHECKS_LEN, HYPER_LEN, StepMessage, call_header, check_calls, joined_ranks
from shardopt.comm._model_axes import ModelAxes
from shardopt.step._agreement import (adopt_hyperparameters, check_hyperparameters_agree, hyper_code,
                                      hyperparameters)
from shardopt.step._usage_checks import Scaling

if TYPE_CHECKING:
    from shardopt.group._rounds import Rounds
    from shardopt.step._usage_checks import Findings, UsageChecks
    from shardopt.group._flat_group import FlatGroup


class StepAgreement:
    """The step's all-reduce for one optimizer's flat buffers (``buffers``), its scheduler
    (``rounds``) and usage checks (``checks``) over ``comm``."""

    def __init__(self, buffers: Sequence[FlatGroup], rounds: Rounds, checks: UsageChecks, comm: Comm,
                 axes: ModelAxes) -> None:
        self.buffers, self.rounds, self.checks, self.comm = list(buffers), rounds, checks, comm
        self.axes = axes  # the ranks with the rest of the model (see _model_axes); empty without
        self.device = self.buffers[0].flat.device

    def local_grad_stats(self, norm_type: float | None) -> tuple[Tensor, Tensor]:
        """(inf/NaN count, the norm to the power p or, for the inf-norm, the max) of this rank's
        gradient shards, 0-d fp32 on the device (no sync). ``None``: the count only. Local; a query."""
        nonfinite, norm = (torch.zeros((), dtype=torch.float32, device=self.device) for _ in range(2))
        if self.comm.replica != 0:  # replicas hold the same shards (hybrid sharding): count each once
            return nonfinite, norm
        for b in self.buffers:
            bad, n = b.grad_stats(norm_type)
            nonfinite += bad
            norm = torch.maximum(norm, n) if norm_type is not None and math.isinf(norm_type) else norm + n
        return nonfinite, norm

    def exchange(self, param_groups: list[dict], loss_scale: float, norm_type: float | None,
                 caller: str, join: bool = False) -> tuple[bool, float]:
        """(any inf/NaN gradient on any rank, global norm of the scaled gradient): finish this
        rank's round, all-reduce the step message, check that every rank is in ``caller`` (see
        comm._messages [Note: ranks in different calls]) with the same hyperparameters, and apply the
        usage checks' reduced flags (``loss_scale``: the scale the gradients carry). ``join``: inside
        a Join, where the message is always summed (see [Note: the step message inside a Join]).
        Every rank; the weight gathers of the last step must have landed."""
        self.rounds.before_step()
        checks = self.checks
        found = checks.local(checks.follow())  # follow what changed behind the optimizer's back, then ask
        checks.forget()  # reported once: by this step's message
        maxed = norm_type is not None and math.isinf(norm_type) and not join
        start = time.perf_counter()  # the hyperparameter digest counts as a check (last_step_check_seconds)
        hyper = hyperparameters(param_groups)
        lost = self.rounds.lost_round
        nonfinite, norm = self.local_grad_stats(norm_type)
        # inside a Join the norm field carries the norm type; the norm itself follows (see the Note below)
        sent = norm if not join else 0.0 if norm_type is None else norm_type
        mine = StepMessage(nonfinite, sent, call=call_header(caller, lost), checks=checks.flags(found),
                           hyper=hyper_code(hyper, maxed))
        checks.seconds += time.perf_counter() - start
        packed = mine.pack(self.device)
        (self.comm.all_reduce_max if maxed else self.comm.all_reduce_sum)(packed).wait()
        got = StepMessage.reduced(packed)
        try:
            check_calls(got.call, caller, lost, self.comm.world_size, maxed)
        except RuntimeError as e:
            self.rounds.fail(str(e))
            raise
        if join and norm_type is not None:
            got.norm = self.norm_follow_up(norm_type, norm)
        scaling = Scaling.of(got.checks)
        if self.axes:
            try:
                scaling = self.whole_model(got, caller, norm_type, scaling)
            except RuntimeError as e:
                self.rounds.fail(str(e))
                raise
        return self.conclude(got, caller, param_groups, found, hyper, loss_scale, norm_type, maxed, scaling)

    def whole_model(self, got: StepMessage, caller: str, norm_type: float | None, scaling: Scaling) -> Scaling:
        """The follow-up over the model axes (see _model_axes [Note: the whole model's agreement]):
        ``got``'s inf/NaN count and norm become the whole model's, in place, and the backward passes
        of this data-parallel group (``scaling``) the whole model's, returned (see _usage_checks
        [Note: the loss scale a gradient carries]). Raises RuntimeError on every rank of the model
        when its ranks are in different calls. Every rank of the model."""
        axes = self.axes
        inf_norm = norm_type is not None and math.isinf(norm_type)
        backwards = scaling.numbers()
        t = torch.zeros(2 + len(CALLS) + len(backwards), dtype=torch.float64)
        t[0], t[1] = float(got.nonfinite), 0.0 if inf_norm or norm_type is None else float(got.norm)
        t[2 + CALLS.index(caller)] = 1.0
        t[2 + len(CALLS):] = torch.tensor(backwards, dtype=torch.float64)
        where = f"{self.comm.where}, in its agreement with the ranks that hold the other parts of the model " \
                f"({axes.describe()}),"
        with axes.during(where):
            axes.reduce(t)
        counts = dict(zip(CALLS, t[2:2 + len(CALLS)].tolist()))
        if counts[caller] != axes.size:
            others = ", ".join(f"{int(n)} in {c}()" for c, n in counts.items() if n and c != caller)
            raise RuntimeError(f"ranks that hold parts of one model ({axes.describe()}) are in different optimizer "
                               f"calls: {int(counts[caller])} of {axes.size} in {caller}(), {others}; call "
                               "clip_grad_norm_ and step alike on every rank of the job, every pipeline stage and "
                               "tensor-parallel rank included (the norm and the skip are the whole model's)")
        got.nonfinite = float(t[0])
        if inf_norm:
            m = torch.tensor([float(got.norm)], dtype=torch.float64)
            with axes.during(where):
                axes.reduce(m, "max")
            got.norm = float(m[0])
        elif norm_type is not None:
            got.norm = float(t[1])
        return Scaling(*t[2 + len(CALLS):].tolist())

    def conclude(self, got: StepMessage, caller: str, param_groups: list[dict], found: Findings,
                 hyper: list | None, loss_scale: float, norm_type: float | None, maxed: bool,
                 scaling: Scaling | None = None) -> tuple[bool, float]:
        """What every rank does with the reduced step message ``got``: check the hyperparameters
        (``hyper`` None on a rank that shadows the others inside a Join, which takes theirs at a
        step), apply the usage checks with this rank's ``found`` and the whole model's backward
        passes (``scaling``; None: ``got``'s). Every rank, with the same ``got``."""
        checks = self.checks
        start = time.perf_counter()
        joined = 0 if maxed else joined_ranks(got.call)
        check_hyperparameters_agree(got.hyper, hyper, self.comm, maxed, joined)
        if joined and caller == "step":
            adopt_hyperparameters(param_groups, hyper, self.comm)
        checks.seconds += time.perf_counter() - start
        checks.apply(found, got.checks, loss_scale, scaling)
        nonfinite, norm = cast(float, got.nonfinite), cast(float, got.norm)  # reduced: plain floats
        found_inf = nonfinite > 0 or not math.isfinite(norm)
        if norm_type is None or maxed or math.isinf(norm_type):
            return found_inf, norm
        return found_inf, norm ** (1.0 / norm_type)

    def norm_follow_up(self, norm_type: float, local: Tensor) -> float:
        """Inside a Join, after clip_grad_norm_'s message: its norm, from one small all-reduce of each
        rank's share (``local``: sum |g|^p, or max |g| for the inf-norm), summed or maxed as
        ``norm_type`` asks; every rank knows it from the message (see [Note: the step message inside
        a Join]). The p-norm to the power p, or the max. Every rank."""
        t = local.reshape(1).float().clone()
        (self.comm.all_reduce_max if math.isinf(norm_type) else self.comm.all_reduce_sum)(t).wait()
        return float(t.item())

    def max_follow_up(self, mine: float) -> float:
        """Inside a Join, at a step: the largest of the ranks' ``mine`` (a joined rank sends 0), by one
        small all-reduce (MAX) in fp64: the clip coefficient the other ranks apply. Every rank."""
        t = torch.tensor([mine], dtype=torch.float64)
        self.comm.all_reduce_max(t).wait()
        return float(t.item())

    def listen(self) -> StepMessage:
        """On a rank that shadows the others inside a Join: meet the others' next message (a round's
        tag, clip_grad_norm_'s or step's) with one that adds only the joined slot and this rank's
        count of inf/NaN elements in its gradient shard (the others' average there: a step skips
        for them too), and return the reduced message, which names their call. Every joined rank."""
        nonfinite, _ = self.local_grad_stats(None)
        packed = StepMessage(nonfinite, 0.0, call_header("joined", False), [0.0] * CHECKS_LEN,
                             [0.0] * HYPER_LEN).pack(self.device)
        self.comm.all_reduce_sum(packed).wait()
        return StepMessage.reduced(packed)


# [Note: the step message inside a Join]
# Inside ``torch.distributed.algorithms.Join`` a rank that ran out of inputs meets the others' next
# message without knowing which call they are in (see optimizer [Note: uneven inputs]), yet it
# holds its shard of their averaged gradient, whose inf/NaN elements and norm are part of the
# whole. So every message is summed there. A joined rank adds its inf/NaN count to whatever
# message it meets (a round's tag ignores it). clip_grad_norm_'s message carries the norm type
# instead of the norm (n ranks send p: the sum over the ranks not joined is n * p, exact for the
# norm types in use, integers and halves), and the norm follows in a second small all-reduce of
# every rank's share, summed, or maxed for the inf-norm, the joined ranks' from their shards. The
# step's clip coefficient, which only the ranks that called clip_grad_norm_ know, follows the
# step's message the same way (``max_follow_up``). Outside a Join nothing changes.
