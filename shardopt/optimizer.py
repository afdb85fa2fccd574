"""``ShardedAdamW``: orchestration only. The math lives in ``kernels``, index math in ``_layout``,
communication in ``comm``, and each flat buffer's gradients, state and gathers in its
``group._flat_group.FlatGroup``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, cast

import torch
from torch import Tensor
from torch.distributed.algorithms.join import JoinHook, Joinable
from torch.utils.hooks import RemovableHandle

from shardopt.comm._messages import check_calls, joined_ranks, the_call
from shardopt.comm._replicas import check_replicas_arguments
from shardopt.step._agreement import agree_on_building, agree_on_params, check_unchanged_since_compared, hyperparameters
from shardopt.comm._collectives import Comm, CommStats, ProcessGroup
from shardopt.comm._model_parts import ModelParts
from shardopt.core._compat import require as require_torch_internals
from shardopt.core._dtensor import is_dtensor, move_grad
from shardopt.core._config import ADAMW_FLAGS, ShardConfig, check_hyperparameters, check_param_group, param_names
from shardopt.group._gather_wait import GatherWatch, WeightGathers, in_flight, landed, outside_read_guard
from shardopt.group._held_bytes import HeldTotal
from shardopt.view import OptimizerView
from shardopt.core._ownership import Lifetime, remove_freed_hooks, take_over
from shardopt.core._ranges import STEP, STEP_AGREEMENT, record_function
from shardopt.group._left_grads import take_left
from shardopt.group._intake import Backward
from shardopt.group._rounds import JoinNotice, Rounds
from shardopt.group._flat_group import LateProblems, build_buffers
from shardopt.step._skips import SkipWatch
from shardopt.checkpoint._state_dict import OptimizerStateDict
from shardopt.checkpoint._torch_state import ParamStateView
from shardopt.step._step_agreement import StepAgreement
from shardopt.step._copies import DeclaredCopies
from shardopt.step._internals import Internals, Progress
from shardopt.step._usage_checks import UsageChecks, watch_for_ddp
from shardopt.step._loss_scale import LossScaler, make_scaler
from shardopt.memory import MemoryReport

log = logging.getLogger("shardopt")

class _JoinHook(JoinHook):
    """What a rank that ran out of inputs inside ``torch.distributed.algorithms.Join`` runs for
    each training step of the others (see ShardedAdamW [Note: uneven inputs])."""

    def __init__(self, opt: ShardedAdamW) -> None:
        self._ref = weakref.ref(opt)

    def main_hook(self) -> None:
        opt = self._ref()
        if opt is not None:
            opt._shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        opt = self._ref()
        if opt is not None:
            opt.finish_param_gather()


class ShardedAdamW(Lifetime, OptimizerStateDict, torch.optim.Optimizer, Joinable):
    """AdamW whose master weights, moments and (stage 2) gradients are split over data-parallel ranks.

    Build it on every rank after ``torch.distributed.init_process_group``, with the same
    parameters in the same order. The parameters become views into one flat buffer per dtype;
    their values are made equal to rank 0's at construction. Each rank keeps 1/N of the fp32
    master weights and moments; ``step`` updates this rank's shard and all-gathers the new
    weights into every rank's model. All methods except ``memory_report``, ``inspect`` and ``no_sync``
    must be called on every rank, in the same order.

    ``device_mesh``: a 2-D ``DeviceMesh`` (replicate, shard) shards over each shard group and
    replicates across the groups (hybrid sharding; see ``_collectives`` [Note: hybrid sharding]);
    a 1-D mesh, like ``process_group``, shards over all its ranks. Pass one or the other.

    ``replicas``: a ``torchft.Manager`` (one per replica group): this optimizer shards over its
    group's ranks (``process_group``) and averages each piece over the replica groups in torchft's
    quorum; wrap it in ``torchft.optim.OptimizerWrapper`` (quorum in ``zero_grad``, commit vote
    before ``step``) and register its state with ``shardopt.fault_tolerance.register`` (see
    ``comm._replicas`` [Note: replicas through torchft] and docs/fault-tolerance.md).

    ``offload="cpu"``: this rank's master weights, moments and a copy of its gradient shard live
    in host memory and are updated there, bucket by bucket, by the fused CPU kernels; the
    weights and gradient buckets stay on the accelerator (see ``shardopt.update._offload``).
    ``offload_fraction`` (0, 1]: only about that share of each rank's buckets is offloaded, the rest
    updated beside the weights. On CPU the results are bit for bit those without offload, for any
    fraction (on a GPU ``benchmarks/offload_exact.py`` checks it).

    Numerics follow ``torch.optim.AdamW`` (decoupled weight decay, bias correction, a step count
    per parameter). Gradients are averaged over ranks, as DDP does; a parameter that no rank has a
    gradient for is left untouched, as AdamW leaves a parameter whose ``.grad`` is None.

    It is ``Joinable``: ``with torch.distributed.algorithms.Join([opt]):`` (beside other
    joinables too) trains ranks with uneven numbers of batches.

    [Note: uneven inputs]
    Inside ``Join([opt, ...])`` each rank tells the Join that it still has inputs before the first
    collective of each step (``Join.notify_join_context``: at its first round, or at
    ``clip_grad_norm_``/``step``). A rank that ran out of batches leaves the loop and, in the Join's
    exit, runs ``_shadow_step`` once per step of the others: it meets each of their messages (a
    round's tag, clip_grad_norm_'s, step's; every one has the same shape) with one that adds
    nothing but a "joined" slot (``StepAgreement.listen``), reads from the sum which call they are
    in, and runs that call's collectives with no gradient of its own: every bucket of a round
    reduced with zeros (``Rounds.shadow_round``), the step's checks with a gradient for no
    parameter, the others' hyperparameters and clip coefficient (one small collective each), and
    the update of its shard with the average, which divides by the whole world size (DDP's
    default), and the weight gathers. Then it zeroes its gradients, as the others do each step. A
    call every rank must make (a checkpoint) raises on every rank while a rank is joined.
    """

    # torch.optim.Optimizer's stub types state as a defaultdict; here it is a view of the shard.
    state: ParamStateView  # type: ignore[assignment]
    internals: Internals
    """This optimizer's parts (flat groups, comm, rounds, loss scaler, step count, ...), the objects it
    holds itself, as the package's own checkpoint and inspection code reads them (see
    ``step._internals``). Not a stable API: ``inspect()`` is the public view."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        stage: int = 2,
        master_weights: str = "fp32",
        moments: str = "fp32",
        loss_scale: str | float | LossScaler | None = "auto",
        process_group: ProcessGroup = None,
        device_mesh: Any = None,
        model_parallel_group: Any = None,
        replicas: Any = None,
        bucket_cap_mb: float = 25.0,
        accumulate_dtype: torch.dtype | None = torch.float32,
        reduce_dtype: torch.dtype | None = None,
        overlap_param_gather: bool = False,
        seed: int = 0,
        timeout: float | None = None,
        max_consecutive_skips: int | None = 3,
        offload: str | None = None,
        offload_fraction: float = 1.0,
    ) -> None:
        check_hyperparameters(lr, betas, eps, weight_decay)
        require_torch_internals(bool(overlap_param_gather))  # see _compat
        self.config = ShardConfig(stage=stage, master_weights=master_weights, moments=moments, bucket_cap_mb=bucket_cap_mb,
                                  accumulate_dtype=accumulate_dtype, seed=seed, reduce_dtype=reduce_dtype,
                                  overlap_param_gather=overlap_param_gather, timeout=timeout,
                                  max_consecutive_skips=max_consecutive_skips, offload=offload,
                                  offload_fraction=offload_fraction)
        make_scaler(loss_scale, set())  # validate before any communication
        if replicas is not None:
            check_replicas_arguments(overlap_param_gather, model_parallel_group)
        self._built = False
        flags = dict(amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
                     differentiable=differentiable, fused=fused)
        super().__init__(params, self._defaults(lr, tuple(betas), eps, weight_decay, flags))
        # timeout= covers construction too: every wait for the other ranks here, connects included
        self._comm = Comm(process_group, device_mesh, connect=self.config.timeout, replicas=replicas)
        self._comm.timeout = self.config.timeout
        self._names = param_names(self.param_groups)  # how messages name each parameter
        # Which ranks hold which part of the model: tensor, pipeline and expert parallelism (see comm._model_parts)
        self._parts = ModelParts(self.param_groups, self._names, self._comm, model_parallel_group, self.config.timeout)
        with self._comm.during(f"{type(self).__name__}'s construction"):
            trainable = agree_on_params(self, self._comm, self._parts, self._names, loss_scale,
                                         check=self._check_params)
        # after the data-parallel ranks agreed on the axes (see comm._model_parts [Note: ranks that built the optimizer differently])
        self._parts.connect()
        self._closed: str | None = None  # why this optimizer no longer trains, once released
        flat = self._parts.settle(trainable, self._names)  # DTensor parameters by their stand-ins (core._dtensor)
        # see _ownership [Note: one optimizer per parameter]
        take_over(self, [p for p, _ in trainable], self._parts.stand_ins())
        remove_freed_hooks()
        landed()  # the read guard of an optimizer collected with gathers in flight goes too (group._gather_wait)
        self._scaler = make_scaler(loss_scale, {p.dtype for p, _ in flat})
        with self._comm.during(f"{type(self).__name__}'s construction"):
            for s, _ in flat:  # a DTensor parameter's gradient is its stand-in's from here on (see core._dtensor)
                dt = self._parts.dtensor_of.get(id(s))
                if dt is not None:
                    move_grad(dt, s)
            # what earlier optimizers left in p.grad, as torch would hold it, at this one's loss scale (see group._left_grads)
            left_made = take_left([p for p, _ in flat], self._comm, self._names, self._scaler.scale)
        parts = self._parts
        error: TypeError | ValueError | None = None
        # The most gradient and buffer bytes held at one moment over every flat group (see _held_bytes).
        held_total = HeldTotal()
        late = LateProblems()  # found outside a check (a write racing a gather, into opt.state), in order
        try:  # from each rank's own pieces: a problem may be one rank's, raised on every rank below
            self._buffers = build_buffers(flat, self._comm, self.config, self._names,
                                          lambda gi: self._rule_of(self.param_groups[gi]),
                                          lambda gi: bool(self.param_groups[gi].get("amsgrad")),
                                          lambda p, gi: parts.counted(p, self.param_groups[gi]),
                                          parts.dtensor_of, parts.group_comm, held_total, late)
        except (TypeError, ValueError) as e:
            error = e
        with self._comm.during(f"{type(self).__name__}'s construction"):
            agree_on_building(error, self._comm, parts)
        tracked = {id(p) for p, _ in trainable}
        # Parameters given with requires_grad=False: no state; their values still follow rank 0.
        self._untracked = [p for g in self.param_groups for p in g["params"] if id(p) not in tracked]
        for p in self._untracked:
            if p.device == self._buffers[0].flat.device:
                self._comm.broadcast(p.detach().to_local() if is_dtensor(p) else p.detach(), src=0).wait()
        self._checks = UsageChecks(self._buffers, self._untracked, self._names, self._comm, late)
        # id(param) -> its record (core._records): the one index by parameter, for hooks that get a parameter
        self._record_of = {id(k): r for b in self._buffers for r in b.records for k in (r.param, r.leaf)}
        ref = weakref.ref(self)
        self._rounds = Rounds(self._buffers, self._comm, self._record_of,
                              join=JoinNotice(ref, self._comm.world_size),
                              hyperparameters=lambda: hyperparameters(ref().param_groups))  # type: ignore[union-attr]
        for b in self._buffers:  # in each: one buffer without counts would take them as assigned by hand
            for made in left_made:
                b.inherit(made)
        self._held = held_total
        self._agreement = StepAgreement(self._buffers, self._rounds, self._checks, self._comm, self._parts.axes)
        # The first step checks that copies across the model axes are copies, and parts parts (see step._copies)
        self._copies = DeclaredCopies([self._record_of[id(p)] for p, _ in trainable], self._buffers,
                                      self.param_groups, self._parts, self._comm)
        self.last_step_check_seconds = 0.0  # this rank's time in the usage checks of the last step, seconds
        # The last step's update with the gathers started bucket by bucket, then the time blocked on
        # the gathers after it (0 with overlap_param_gather: the next forward waits), seconds, this rank.
        self.last_step_update_seconds = self.last_step_gather_wait_seconds = 0.0
        self._progress = Progress()  # the step count (see step._internals)
        # held by step() and by what reads or writes the state from another thread (torchft's
        # healing, see shardopt.fault_tolerance): a reader sees the state between two steps
        self._state_lock = threading.RLock()
        self._clip_coef = 1.0  # what clip_grad_norm_ asked the next step to multiply the gradient by
        self._clip_zeroings = self._clip_rounds = 0  # the flat groups' zeroings and rounds when it asked (see _pending_clip)
        self._rounds_at_step = 0  # rounds of reductions completed when the last step() ran
        self.step_was_skipped = False
        self.skipped_steps = 0
        self._skips = SkipWatch(self.config.max_consecutive_skips)  # see _skips [Note: skips that cannot fix themselves]
        self.last_step_comm = CommStats()  # communication of the last completed step (see step())
        # Weight all-gathers still in flight, in their buckets' records: see group._gather_wait.
        self._gathers = WeightGathers(self._buffers, self._record_of, self.config.overlap_param_gather)
        self._gather_hook = GatherWatch(self._gathers) if self.config.overlap_param_gather else None
        self._consolidated: dict[str, Any] | None = None  # consolidate_state_dict's result, until step()
        self._ddp_watch: RemovableHandle | None = watch_for_ddp(tracked, stage, ref)  # until the first forward over them, or the first step
        Joinable.__init__(self)  # the Join context manager sets _join_config (see [Note: uneven inputs])
        # torch.optim's per-parameter state, read from this rank's shard (see checkpoint._torch_state)
        self.state = ParamStateView(self._buffers, [p for g in self.param_groups for p in g["params"]],
                                    lambda: ref()._progress.step)  # type: ignore[union-attr]
        self.internals = Internals(self._buffers, self._comm, self._parts, self._scaler, self._checks, self._rounds,
                                   self._gathers, self._held, self._state_lock, self._progress)
        self._built = True

    def _release(self, why: str) -> None:
        """See ``Lifetime.close``; also hand ``p.grad`` back as torch would hold it (see
        ``FlatGroup.release``). Local."""
        if self.__dict__.get("_closed") is None:
            self._leave_gradients()
        super()._release(why)

    def _leave_gradients(self) -> None:
        """Leave ``p.grad`` as torch would hold it, for the next optimizer over the parameters (see
        group._left_grads [Note: gradients left to the next optimizer]). Local; no communication."""
        scaler, checks = self.__dict__.get("_scaler"), self.__dict__.get("_checks")
        scale = scaler.scale if scaler is not None else 1.0
        for b in self.__dict__.get("_buffers", ()):  # __dict__: see Lifetime._remove_hooks
            b.release(scale, checks.grad_scale if checks is not None else scale)

    def __del__(self) -> None:
        # Collected while it trains: the placeholders it left in p.grad keep what holds their values,
        # for the next optimizer to gather; its hooks stay until the next safe point (see _ownership).
        # Not while the interpreter shuts down: no optimizer can take them then, and a DTensor
        # parameter's gradient made then (core._dtensor.leave_grad) may meet a tensor torch is
        # clearing, which aborts the process.
        with contextlib.suppress(Exception):
            if self.__dict__.get("_closed", "") is None and not sys.is_finalizing():
                self._leave_gradients()
        super().__del__()

    # -- construction --------------------------------------------------------------------
    def _defaults(self, lr: float, betas: tuple[float, ...], eps: float, weight_decay: float,
                  flags: dict[str, Any]) -> dict[str, Any]:
        """Every param group's defaults: the hyperparameters, then torch.optim.AdamW's flags (see
        core._config.ADAMW_FLAGS), as torch.optim.AdamW's param groups hold them."""
        return dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **{**ADAMW_FLAGS, **flags})

    def _rule_of(self, group: dict[str, Any]) -> str:
        """The update rule of a param group's parameters (see ``ShardedMuon``)."""
        return "adamw"

    def _check_params(self) -> None:
        """The update rule's own check of every param group's parameters, frozen ones included (see
        ``ShardedMuon``); raises TypeError or ValueError, on every rank alike. Local."""
        for gi, g in enumerate(self.param_groups):
            if self.config.overlap_param_gather and any(is_dtensor(p) for p in g["params"]):
                raise ValueError(f"overlap_param_gather=True with DTensor parameters (param group {gi}): the "
                                 "overlapped gather is not tested beside tensor parallelism, so it is refused there; "
                                 "leave overlap_param_gather off (each step then waits for its gathers)")
            if g.get("replicated") and not self._parts.axes:
                raise ValueError(f'param group {gi} is marked "replicated": {g["replicated"]!r}, which says its '
                                 "parameters are copies on ranks of model_parallel_group; pass model_parallel_group= (the ranks "
                                 "with the other pipeline stages or tensor-parallel shards), or leave the key out")
            self._parts.check_replicated(g, gi)
            off_cuda = sorted({p.device.type for p in g["params"] if p.device.type != "cuda"})
            if g.get("capturable") and off_cuda:
                raise ValueError(f"capturable=True (param group {gi}) applies to parameters on CUDA, these are on "
                                 f"{', '.join(off_cuda)} (torch.optim.AdamW refuses it there too); leave capturable "
                                 f"out. On CUDA it is accepted, but {type(self).__name__}'s step agrees with the other ranks "
                                 "on the host, so it cannot be captured in a CUDA graph")
            if g.get("amsgrad") and self.config.moments == "8bit":
                raise ValueError(f"amsgrad=True (param group {gi}) with moments='8bit': the running maximum of "
                                 "exp_avg_sq has no 8-bit form in shardopt; use moments='fp32' (bit for bit "
                                 "torch.optim.AdamW(amsgrad=True)) or 'bf16'")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_built", False):
            raise RuntimeError(f"{type(self).__name__} lays out all parameters in flat buffers at construction; "
                               "pass every param group to the constructor instead of add_param_group")
        super().add_param_group(check_param_group(param_group, len(self.param_groups), self.defaults,
                                                  type(self).__name__))

    # -- training loop -------------------------------------------------------------------
    @torch.compiler.disable  # runs eagerly inside a compiled function (a graph break)
    def backward(self, loss: Tensor, gradient: Tensor | None = None, **kwargs: Any) -> None:
        """``loss.backward()`` with the loss multiplied by the current loss scale. Every rank.

        ``gradient=g``: ``loss.backward(g)`` from a tensor that is not a loss. Without axes of
        ``model_parallel_group=`` (plain data parallelism, or DTensor parameters alone, whose
        tensor-parallel ranks run one backward pass together) ``g`` is a gradient of your own and is
        multiplied by the loss scale, as the loss is. Beside them it is the gradient a pipeline
        stage received from the next stage, which that stage's ``opt.backward(loss)`` scaled already,
        so it is not multiplied again, as ``loss.backward(g)`` without the optimizer does (see
        step._usage_checks [Note: the loss scale a gradient carries]). Other keywords go to
        ``Tensor.backward``."""
        self._check_open()
        scale = self._scaler.scale
        # Only model_parallel_group= can hold pipeline stages: a DTensor mesh is a tensor-parallel axis
        carried = gradient is not None and bool(self._parts.user_axes)
        how = Backward.CARRIED if carried else Backward.SCALED
        with self._comm.during("opt.backward()"), self._rounds.started(how):
            if carried:
                loss.backward(gradient, **kwargs)
            elif gradient is not None:
                loss.backward(gradient * scale if scale != 1.0 else gradient, **kwargs)
            else:
                (loss * scale if scale != 1.0 else loss).backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward passes accumulate gradients locally without communicating; the first
        backward after it reduces everything accumulated. Use for all micro-batches but the last."""
        previous, self._rounds.require_sync = self._rounds.require_sync, False
        try:
            yield
        finally:
            self._rounds.require_sync = previous

    def _agree_on_gradients(self, norm_type: float | None, caller: str = "step") -> tuple[bool, float]:
        """(any inf/NaN gradient on any rank, global norm of the scaled gradient): the step's one
        all-reduce (see _step_agreement). Every rank."""
        self.finish_param_gather()
        # inside a Join, before this step's first collective: tell it that this rank has inputs
        # (group._rounds.JoinNotice). Local decision, once per step
        self._rounds.join.send()
        return self._agreement.exchange(self.param_groups, self._scaler.scale, norm_type, caller, self._in_join())

    @torch.compiler.disable
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the averaged gradient to ``max_norm`` (over all ranks and shards); returns the total
        norm of the unscaled gradient, as ``torch.nn.utils.clip_grad_norm_`` would. The clipping is
        applied inside the next ``step``; a second call before it sees the gradient the first one
        clipped, as torch's does. Every rank."""
        self._check_open()
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type must be > 0 (or inf), got {norm_type=}")
        with self._comm.during("clip_grad_norm_()"):
            found_inf, norm = self._agree_on_gradients(norm_type, "clip_grad_norm_")
        # the gradient this call sees is the stored one times what an earlier call since the last
        # step asked the step to multiply it by: its norm is the stored one's times that, and a
        # further clip multiplies in (torch clips p.grad in place, so a second call clips the
        # clipped gradient and returns its norm)
        norm = norm / self._checks.grad_scale * self._pending_clip()
        coef = 1.0 if found_inf else min(1.0, float(max_norm) / (norm + 1e-6))
        self._clip_coef *= coef
        self._clip_zeroings, self._clip_rounds = self._zeroings(), self._rounds.total_rounds
        return torch.tensor(norm)  # inf or nan when a gradient is, as torch's

    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update this rank's shard and all-gather the new weights; skipped on every rank when any
        gradient is inf/NaN. Every rank."""
        self._check_open()
        with self._comm.during("step()"), record_function(STEP), self._state_lock:  # see core._ranges [Note: profiler ranges]
            return self._take_step(closure)

    def _take_step(self, closure: Callable[[], Any] | None) -> Any:
        remove_freed_hooks()  # see _ownership [Note: hooks of a freed optimizer]
        self.finish_param_gather()  # an update must not race the previous step's gathers
        self._consolidated = None  # gathered before this step: stale from here on
        if self._ddp_watch is not None:
            self._ddp_watch.remove()
            self._ddp_watch = None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Always the step's own all-reduce, also after clip_grad_norm_: user code between the two
        # (model.zero_grad(), a weight write, another backward) may have changed something on one
        # rank only, and a rank-local test deciding whether to look again would let one rank issue
        # a collective alone. The clip coefficient stays the one clip_grad_norm_ returned for,
        # unless the gradients it scaled were zeroed since.
        coef, self._clip_coef = self._clip_coef, 1.0
        # writes into opt.state reach the shard before the update reads it (see checkpoint._torch_state)
        self._checks.report_late(self.state.take_writes())
        try:
            with record_function(STEP_AGREEMENT):
                found_inf = self._agree_on_gradients(None)[0]
            if coef != 1.0 and self._clip_dropped():
                coef = 1.0  # what the clip scaled was zeroed since (see _pending_clip)
            # beside torchft: the values the replica groups compared are the ones this step uses
            check_unchanged_since_compared(self._rounds.agreed_hyper, self.param_groups)
            if self._in_join():  # a joined rank takes the clip coefficient from here (see [Note: uneven inputs])
                coef = self._agreement.max_follow_up(coef)
            # the first step taken beside model axes, before its update (see step._copies): a skipped
            # step's gradients are not finite, and prove nothing about copies
            if not found_inf and not self._copies.checked:
                self._copies.check_once()
            return self._apply_step(found_inf, coef, loss)
        finally:
            self._rounds.join.end()

    def _zeroings(self) -> int:
        return sum(b.zeroings for b in self._buffers)

    def _clip_dropped(self) -> bool:
        return self._zeroings() != self._clip_zeroings and self._rounds.total_rounds != self._clip_rounds

    def _pending_clip(self) -> float:
        """The coefficient clip_grad_norm_ asked for since the last step, or 1 where gradients were
        zeroed or replaced since it asked (``model.zero_grad()``, ``p.grad = None``) and a backward
        pass made new ones: what it clipped is gone, as in torch, where the clip scaled the discarded
        ``p.grad`` and the new gradient is not clipped. (Some gradients dropped and no backward
        since: the clip stays, on those still there, as torch's.) Every rank (the ranks zero alike,
        or the step raises)."""
        if self._clip_coef != 1.0 and self._clip_dropped():
            self._clip_coef = 1.0
        return self._clip_coef

    def _apply_step(self, found_inf: bool, coef: float, loss: Any) -> Any:
        """The step once every rank agreed: skip it (``found_inf``), or update this rank's shard with
        the gradient times ``coef`` and gather the weights. Every rank, with the same arguments."""
        self._rounds_at_step = self._rounds.total_rounds
        self.step_was_skipped = found_inf
        self._rounds.stepped()
        self.last_step_check_seconds = self._checks.seconds + sum(b.check_seconds for b in self._buffers)
        self._checks.seconds = 0.0
        for b in self._buffers:
            b.stepped()
        if found_inf:
            self.skipped_steps += 1
            attempt = self._progress.step + self.skipped_steps  # step() calls so far, skipped ones included
            self._scaler.update(True, attempt)
            log.info("shardopt: step %d skipped: inf/NaN gradients on some rank; loss scale now %g (%d skipped so far)",
                     attempt, self._scaler.scale, self.skipped_steps)
            self._skips.skipped(attempt, self._scaler, self._nonfinite_params)
            return loss
        self._skips.taken()
        self._progress.step += 1
        grad_scale = coef / self._checks.grad_scale
        # See FlatGroup.update: each bucket's all-gather runs while the next bucket is updated.
        start = time.perf_counter()
        try:
            # another optimizer's read guard, if its gathers are in flight, is not this update's concern
            # (see _gather_wait [Note: the optimizer's own update])
            with outside_read_guard():
                for b in self._buffers:
                    b.update(self._progress.step, grad_scale, self.param_groups)
        finally:
            if self.config.overlap_param_gather:  # the read guard, see _gather_wait [Note: reads of a weight in flight]
                in_flight()
        waited = time.perf_counter()
        if not self.config.overlap_param_gather:
            self.finish_param_gather()
        self.last_step_update_seconds = waited - start
        self.last_step_gather_wait_seconds = time.perf_counter() - waited
        self._scaler.update(False, self._progress.step + self.skipped_steps)
        self.state.refresh()  # the state tensors opt.state handed out hold the new state, as torch's
        self.last_step_comm = dataclasses.replace(self._comm.stats)
        self._comm.stats.reset()
        return loss

    # -- uneven inputs: torch.distributed.algorithms.Join ----------------------------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a Join runs on this rank once it ran out of inputs (see [Note: uneven inputs])."""
        if self._parts.axes:
            raise RuntimeError("torch.distributed.algorithms.Join with an optimizer that has model_parallel_group= "
                               "(or DTensor parameters) is not supported: a joined rank would have to shadow the "
                               "other parts of the model too; give every data-parallel rank the same number of "
                               "batches (e.g. DistributedSampler(drop_last=True))")
        return _JoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the Join's own collectives: the parameters'."""
        return self._buffers[0].flat.device

    @property
    def join_process_group(self) -> Any:
        """The group of the Join's own collectives: the optimizer's (data-parallel) group."""
        return self._comm.data_group

    def _in_join(self) -> bool:
        return self._rounds.join.active()

    @torch.compiler.disable
    @torch.no_grad()
    def _shadow_step(self) -> None:
        """On a rank that ran out of inputs inside a Join: run the others' calls until their step,
        with no gradient of this rank's (see [Note: uneven inputs]). Every joined rank, once per
        step of the others."""
        if self._comm.world_size == 1:
            return
        self._check_open()
        self.zero_grad()  # what it held from its last own step is no part of the others' steps
        self._rounds.join.joined = True
        try:
            with self._comm.during("the shadow of the other ranks' step inside a Join"):
                while True:
                    got = self._agreement.listen()
                    call = the_call(got.call) or "step"
                    lost = got.call[-2] > 0
                    check_calls(got.call, call, lost, self._comm.world_size, maxed=False)
                    if call == "backward":
                        self._rounds.shadow_round()
                        continue
                    self.finish_param_gather()
                    for b in self._buffers:
                        b.round_sum()
                    found = self._checks.joined()
                    scale = self._scaler.scale
                    if call == "clip_grad_norm_":  # its norm needs this rank's share; the coefficient comes with the step
                        norm_type = cast(float, got.norm) / (self._comm.world_size - joined_ranks(got.call))  # reduced: a float
                        self._agreement.norm_follow_up(norm_type, self._agreement.local_grad_stats(norm_type)[1])
                        self._agreement.conclude(got, call, self.param_groups, found, None, scale, None, False)
                        continue
                    found_inf = self._agreement.conclude(got, call, self.param_groups, found, None, scale, None, False)[0]
                    coef = self._agreement.max_follow_up(0.0)
                    self._apply_step(found_inf, coef, None)
                    return
        finally:
            self._rounds.join.joined = False

    def _nonfinite_params(self) -> list[str]:
        """Names of the parameters whose averaged gradient has an inf/NaN on some rank of the whole
        model (every tensor-parallel rank, pipeline stage and expert group), each marked with the part
        that holds it where the ranks hold different parts (``ModelParts.where``). Every rank of the job."""
        where = self._parts.where
        mine = [where(r.param) + r.name for b in self._buffers
                for r, bad in zip(b.records, b.nonfinite_params().tolist()) if bad > 0]
        return self._parts.gather_names(mine)

    @torch.compiler.disable  # waits on collectives and changes the torch function mode stack (a graph break)
    def finish_param_gather(self) -> None:
        """Wait until every rank's updated weights are in this rank's model. Local (the collectives were
        issued by step() on every rank), from any thread. With ``overlap_param_gather=True`` a read
        or write of a weight in the thread that called step() waits by itself (see group._gather_wait);
        this waits for all of them at once, as another thread must before it reads the weights."""
        self._gathers.finish()
        if self.config.overlap_param_gather:
            landed()  # the read guard leaves, also when its last gather landed inside its own call

    def pending_param_buckets(self) -> list[tuple[int, int]]:
        """(buffer, bucket) pairs whose all-gather has not been waited on yet."""
        return [(b.buffer, b.index) for b in self._gathers]

    def bucket_of(self, param: torch.nn.Parameter) -> tuple[int, int] | None:
        """(buffer, bucket) holding ``param``, or None for parameters this optimizer does not train."""
        r = self._record_of.get(id(param))
        return None if r is None else (r.bucket.buffer, r.bucket.index)

    @torch.compiler.disable  # runs eagerly inside a compiled function (a graph break)
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients of all parameters (also those accumulated under ``no_sync``). Local.

        As with torch, ``set_to_none=True`` leaves parameters without a gradient (the next step
        skips those that get none) and ``set_to_none=False`` with a zero one. Stage 1 keeps ``p.grad``
        a (zeroed) view of the flat gradient buffer either way, so backward accumulates in place.
        Once this optimizer no longer trains (closed or superseded), torch's ``zero_grad`` on
        ``p.grad`` of its parameters."""
        if self._closed is not None:
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None and set_to_none:
                        p.grad = None
                    elif p.grad is not None:
                        p.grad.zero_()  # a placeholder left to the next optimizer stands for zeros then
            return
        # Averaged gradients dropped before their step: must happen on every rank alike (checked at the step).
        self._checks.zeroed_after_round |= self._rounds.total_rounds != self._rounds_at_step
        self._rounds.zero_grad()
        for b in self._buffers:
            b.zero_grad(set_to_none)
        for p in self._untracked:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self._clip_coef = 1.0

    def parameters_moved(self) -> list[str]:
        """The parameters whose dtype or device changed since this optimizer laid them out (a
        ``model.to(...)`` or a framework's precision conversion after construction), one line each:
        ``"name: built as DTYPE on DEVICE, now DTYPE on DEVICE"``. Local; ``step`` refuses them."""
        return [f"{r.name}: built as {b.flat.dtype} on {b.flat.device}, now {r.param.dtype} on {r.param.device}"
                for b in self._buffers for r in b.records
                if r.param.dtype != b.flat.dtype or r.param.device != b.flat.device]

    def refresh_master_weights(self) -> None:
        """Take the model's current weights as the master weights (rank 0's values, on every rank).

        Writes through ``model.load_state_dict``, ``nn.init`` or ``p.copy_`` are noticed by the
        next ``step`` on their own; call this after writing through ``p.data``. Every rank: it
        starts with the entry message, so a call on some ranks only raises there, naming it."""
        from shardopt.checkpoint._adamw import settle

        self._check_open()
        with self._comm.during("refresh_master_weights()"):
            settle(self, "refresh_master_weights")  # also takes writes seen so far; raises on every rank if it cannot
            for b in self._buffers:
                b.take_model_weights(b.records)

    # -- reporting -----------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The loss scale that ``backward`` applies now."""
        return self._scaler.scale

    @property
    def step_count(self) -> int:
        """Steps taken (skipped steps not counted)."""
        return self._progress.step

    def inspect(self) -> OptimizerView:
        """A read-only view of what this optimizer holds on this rank: ranks, buffers and their
        layout, shards, master weights, moments, rounds (see ``shardopt.view``). Local."""
        return OptimizerView(self)

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds, by category, measured and predicted. Local; no communication."""
        total = sum((b.memory_report() for b in self._buffers[1:]), self._buffers[0].memory_report())
        total = dataclasses.replace(total, held_peak=max(self._held.peak, total.grads + total.buffers))
        if total.stage and self._buffers[0].flat.device.type == "cuda":
            total = dataclasses.replace(total, cuda_max_allocated=torch.cuda.max_memory_allocated(
                self._buffers[0].flat.device))
        return total

    def reset_peak_memory(self) -> None:
        """Restart the high-water marks of ``memory_report()`` (``peak``, ``buffers``) from what is
        held now; also ``torch.cuda.reset_peak_memory_stats()`` on CUDA. Local."""
        for b in self._buffers:
            b.reset_peaks()
        self._held.reset()
        if self._buffers[0].flat.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._buffers[0].flat.device)
