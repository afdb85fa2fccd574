"""One flat buffer of same-dtype parameters with everything this rank keeps and does for it.

The owner of each bucket's life (see design.md "Decisions", one owner for a bucket's life): its
layout, flat parameters and records, its gradients (the backward half, ``_intake.GradIntake``),
the master-weight and moment strategies of this rank's shard, the update, and the weight gathers
from their start to their wait. Holds no math of its own.
"""
from __future__ import annotations

import functools
import math
import threading
from typing import Any, Callable, Sequence, cast

import torch
from torch import Tensor

from shardopt.group._binding import ParamBinding, warn_layout_change
from shardopt.comm._collectives import Comm, Pending
from shardopt.core._config import ShardConfig
from shardopt.core._flat import FlatParams, ShardView, views, whole
from shardopt.core._layout import Range, build_layout
from shardopt.core._ranges import ALL_GATHER, GATHER_WAIT, UPDATE, bucket_range
from shardopt.core._records import BucketRecord, ParamRecord, build_records
from shardopt.group._held_bytes import HeldTotal
from shardopt.group._intake import GradIntake
from shardopt.group._rounds import MAX_INFLIGHT
from shardopt.memory._buffer_model import replay_buffers
from shardopt.group._muon_packing import owned_layout
from shardopt.group._muon_tp import sharded_dim, whole_orthogonalizer
from shardopt.kernels import make_scalars, select
from shardopt.kernels.muon_reference import muon_step_
from shardopt.update._master import make_master
from shardopt.update._moments import MuonMomentum, make_moments, moment_alignment
from shardopt.update._offload import OnDevice, make_placement
from shardopt.update._split import SplitMaster, SplitMoments, split_point
from shardopt.memory import MemoryReport, predict_bytes


# a parameter written while its bucket's gather was in flight (see ``FlatGroup.wait_gather``)
_RACED = ("parameter {} was written (through the parameter, a view or .data) while the optimizer "
          "(overlap_param_gather=True) was still gathering the weights of the last step into the model, which "
          "overwrote the write. A write in the thread that called step() waits for the gathers by itself; from "
          "another thread, call opt.finish_param_gather() before writing weights into the model")


class LateProblems:
    """Problems found outside a check, in the order they were found, over every flat group of one
    optimizer: a weight written while its bucket's gather was in flight (``FlatGroup.wait_gather``),
    a write into ``opt.state`` that cannot be taken (``UsageChecks.report_late``). The next check
    reports them on every rank (the first one named), then ``clear``. Local."""

    def __init__(self) -> None:
        self.found: list[str] = []  # the messages, oldest first

    def add(self, problems: Sequence[str]) -> None:
        self.found += problems

    def clear(self) -> None:
        self.found = []


def lr_value(lr: object) -> float | Tensor:
    """A param group's ``lr`` as the update takes it: a float, or a 1-element tensor kept a tensor
    (see kernels.reference [Note: a tensor learning rate])."""
    return lr if isinstance(lr, Tensor) else float(lr)  # type: ignore[arg-type]


_Segments = list[tuple[tuple[int, int], Range]]  # runs of one (param group, lag) key in the shard (update)


class FlatGroup(GradIntake):
    """Parameters of one (dtype, device, update rule, process group), their flat buffer, and
    everything this rank keeps and does for them: one owner for each bucket's life. Its verbs, in
    the order a training step calls them:

    * backward (``GradIntake``, the scheduler ``_rounds`` calls them): ``take_fresh``/``take`` a
      parameter's gradient into its bucket, ``launch`` a complete bucket's reduction, ``landed``
      and ``reduced`` when it arrives, ``end_round``;
    * step: ``grad_stats``/``nonfinite_params`` read the averaged gradient, ``update`` steps this
      rank's shard and starts each bucket's weight gather (``start_gather``);
    * forward: ``wait_gather`` (one bucket), ``finish_gathers`` (all) before the weights are read.

    One list of parameter records and one of bucket records (see core._records)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], group_of: Sequence[int], comm: Comm,
                 config: ShardConfig, names: Sequence[str], rule: str = "adamw", index: int = 0,
                 amsgrad: bool = False, counted: Sequence[bool] | None = None,
                 dtensors: Sequence[Tensor | None] | None = None,
                 grad_factor: float = 1.0, held_total: HeldTotal | None = None,
                 late: LateProblems | None = None) -> None:
        self.comm, self.config, self.rule = comm, config, rule
        # The reduction averages over this buffer's group; the gradient each rank steps with is
        # that average times this (a param group with its own process_group, see
        # comm._model_parts [Note: param groups with their own data-parallel group]).
        self.grad_factor = grad_factor
        self.amsgrad = amsgrad  # some param group of this buffer sets amsgrad=True: its moments keep max_exp_avg_sq
        element_size = params[0].element_size()
        alignment = math.lcm(config.alignment, moment_alignment(config.moments))  # 8-bit: whole blocks
        if rule == "muon":  # each matrix whole in its owner's shard (see _muon_packing)
            dtensors = dtensors if dtensors is not None else [None] * len(params)
            # placed by the whole matrices: alike at every tensor-parallel position (see
            # _muon_packing [Note: owners of tensor-parallel pieces])
            self.layout, self.packing, order = owned_layout(
                [p.shape for p in params], comm.shard_size, alignment=alignment,
                bucket_numel=config.bucket_numel(element_size),
                whole_shapes=[(p if dt is None else dt).shape for p, dt in zip(params, dtensors)])
            counted = counted if counted is not None else [True] * len(params)
            in_order: list[Sequence[Any]] = [params, group_of, names, dtensors, counted]
            params, group_of, names, dtensors, counted = ([seq[i] for i in order] for seq in in_order)
        else:
            self.layout = build_layout([p.shape for p in params], comm.shard_size, alignment=alignment,
                                       bucket_numel=config.bucket_numel(element_size))
        warn_layout_change([n for n, p in zip(names, params) if not p.is_contiguous()], "when the optimizer was built")
        self.flat = FlatParams(params, self.layout, dtensors)
        comm.broadcast(self.flat.data, src=0).wait()  # every rank starts from rank 0's weights
        self.shard = self.flat.shard(comm.shard_rank)  # this rank's pieces of the weights, local coordinates
        # One record per parameter and per bucket (see core._records [Note: the records]). A record's
        # lag counts the steps it was left out of because no rank had a gradient for it, so that its
        # own step count (for bias correction, as torch.optim.AdamW keeps per parameter) is the
        # optimizer's step minus its lag.
        self.records, self.buckets = build_records(params, names, group_of, self.layout, comm.shard_rank, index,
                                                   dtensors)
        self.groups = sorted(set(group_of))  # the param groups with parameters here
        # This rank's parts of the parameters it does not count in the gradient's norm: copies across a
        # model axis, which that axis's rank 0 counts (see comm._model_axes [Note: the whole model's agreement])
        uncounted = sorted((r.local for r, c in zip(self.records, counted or [True] * len(self.records))
                            if not c and r.local is not None), key=lambda r: r.start)
        self.counted_runs: list[Range] | None = None  # None: the whole shard counts
        if uncounted:
            self.counted_runs, at = [], 0
            for r in uncounted:
                if r.start > at:
                    self.counted_runs.append(Range(at, r.start))
                at = r.end
            if at < self.layout.shard_numel:
                self.counted_runs.append(Range(at, self.layout.shard_numel))
        self._segments: dict[tuple, _Segments] = {}  # update segments by (group, lag)-or-None keys (a cache)
        self._init_intake(config.stage, config.accumulate_dtype, config.reduce_dtype,
                          held_total if held_total is not None else HeldTotal())
        self._place_state(config, rule)
        self.binding = ParamBinding(self.flat, self.records)
        # Buckets whose weight gather is in flight, in the order started (see ``wait_gather``)
        self._started: tuple[BucketRecord, ...] = ()
        self._gather_lock = threading.RLock()  # held while a gather is waited for (RLock: a landing may look again)
        self.late = late if late is not None else LateProblems()  # the optimizer's, over every group

    def _place_state(self, config: ShardConfig, rule: str) -> None:
        """Where the master weights and moments live and the update runs (see update._offload [Note:
        offload]): one placement for the whole shard, or with offload_fraction < 1 a host piece and a
        device piece (see update._split [Note: offload fraction]), each with its own strategies."""
        n = self.layout.shard_numel
        split = n if config.offload is None or config.offload_fraction >= 1 else \
            split_point(self.buckets, n, config.offload_fraction)
        pieces = [(0, split, config.offload), (split, n, None)] if 0 < split < n else \
            [(0, n, config.offload if split else None)]
        kernels: dict[str, Any] = dict(dtype=self.flat.dtype, master=config.master_weights, moments=config.moments,
                                       rule=rule)
        masters, moments, self.placements = [], [], []
        for start, end, offload in pieces:
            state = predict_bytes(end - start, 1, stage=2, param_dtype=self.flat.dtype,
                                  master_weights=config.master_weights, moments=config.moments, rule=rule,
                                  amsgrad=self.amsgrad)
            place = make_placement(offload, self.shard.window(Range(start, end)),
                                   grad_dtype=None if rule == "muon" else self.flat.dtype,
                                   buckets=[b for b in self.buckets if start <= b.local.start < end],
                                   state_bytes=sum(state[c] for c in ("master", "exp_avg", "exp_avg_sq", "extra")))
            self.placements.append(place)
            masters.append(make_master(config.master_weights, place.weights,
                                       logical=functools.partial(self._logical, start), seed=config.seed,
                                       empty=place.empty, kernels=select(**kernels, device=place.device)))
            moments.append(MuonMomentum(end - start, place.device, config.moments, empty=place.empty)
                           if rule == "muon" else
                           make_moments(config.moments, end - start, place.device, empty=place.empty,
                                        amsgrad=self.amsgrad))
        starts = [start for start, _, _ in pieces]
        self.master = masters[0] if len(masters) == 1 else SplitMaster(masters, starts)
        self.moments = moments[0] if len(moments) == 1 else SplitMoments(moments, starts)
        # bytes of master weights, moments and extras in host memory (memory_report's host_state)
        self.host_state_bytes = sum(m.master_bytes + m.extra_bytes + mo.exp_avg_bytes + mo.exp_avg_sq_bytes
                                    for place, m, mo in zip(self.placements, masters, moments) if place.name)
        # the kernels of the gradient's statistics, which run where the gradient lives
        self.kernels = masters[-1].kernels if self.placements[-1].device == self.flat.device else \
            select(**kernels, device=self.flat.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    def _logical(self, start: int, local: int) -> int:
        """The logical offset of element ``start + local`` of this rank's shard (see core._layout
        [Note: logical offsets]): the key of its random bits."""
        return self.layout.logical_offset(self.comm.shard_rank, start + local)

    def update(self, step: int, grad_scale: float, param_groups: Sequence[dict]) -> None:
        """AdamW on this rank's shard, then the all-gather of the new weights, bucket by bucket in
        the order the forward pass uses them: a bucket's gather is started as soon as its part of
        the shard is updated (``start_gather``), so it runs while the next bucket is updated. One kernel call per run of parameters with the same param group and
        step count within a bucket. Parameters whose record is not ``trained`` (no rank has a gradient); the
        others are left untouched, as ``torch.optim.AdamW`` leaves parameters whose ``.grad`` is
        None. Every rank."""
        if not self.amsgrad and self.rule == "adamw":
            late = [g for g in self.groups if param_groups[g].get("amsgrad")]
            if late:  # every rank alike: the hyperparameters agreed at this step's message
                raise ValueError(f"param group {late[0]} has amsgrad=True, set after the optimizer was built without "
                                 "it: the running maximum of exp_avg_sq is laid out at construction, so the step "
                                 "cannot honour it; pass amsgrad=True (or the group's \"amsgrad\": True) to the "
                                 "constructor. The step was not taken")
        grad_scale *= self.grad_factor
        if self.rule == "muon":
            self._update_muon(step, grad_scale, param_groups)
            return
        grad = self.local_grad()
        keys = tuple((r.group, r.lag) if r.trained else None for r in self.records)
        segments = self._segments.get(keys)
        if segments is None:
            if len(self._segments) > 8:
                self._segments.clear()
            segments = self._segments[keys] = cast(_Segments, self.layout.segments(self.comm.shard_rank, keys))
        scalars: dict[tuple, tuple] = {}  # by (group, lag, device): the step's scalars where each piece updates

        def scalars_of(g: int, lag: int, device: torch.device) -> tuple:
            if (g, lag, device) not in scalars:
                hp = param_groups[g]
                beta1, beta2 = hp["betas"]
                scalars[g, lag, device] = make_scalars(
                    lr=lr_value(hp["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(hp["eps"]),
                    weight_decay=float(hp["weight_decay"]), step=step - lag,
                    grad_scale=-grad_scale if hp.get("maximize") else grad_scale, device=device)
            return scalars[g, lag, device]

        order = self.forward_order
        for place in self.placements:
            place.begin(grad, order)
        for b in order:
            place = self.place_of(b)
            with bucket_range(UPDATE, b):  # see core._ranges [Note: profiler ranges]
                g = place.grad_of(b, grad)
                for key, whole in segments:
                    r = whole.intersect(b.local)
                    if r.size:
                        s, gr = scalars_of(*key, place.device), g[r.as_slice()]
                        vmax = self.moments.max_operand(r) if param_groups[key[0]].get("amsgrad") else None
                        m, v = self.moments.prepare(r, gr, s, self.master.kernels_for(r))
                        self.master.update_(r, gr, m, v, s, step - key[1], vmax)
                place.publish(b)
            self.start_gather(b)
        if None in keys:  # some parameter had no gradient on any rank: its own step count falls behind
            for rec in self.records:
                rec.stepped()

    def _muon_step(self, rec: ParamRecord, grad: Tensor | ShardView, grad_scale: float, param_groups: Sequence[dict],
                   step: int) -> None:
        """torch.optim.Muon's step of matrix ``rec``, which this rank owns: on its fp32 master, from
        its averaged gradient in ``grad`` (this rank's shard), the mode encoding the result. A
        tensor-parallel piece is orthogonalised as part of the whole matrix (see _muon_tp). Local,
        but for that piece's gather across its mesh."""
        place, r = self.place_of(rec.bucket), rec.local
        shape, hp, here = rec.span.shape, param_groups[rec.group], self.flat.device
        tp = rec.dtensor if rec.dtensor is not None and sharded_dim(rec.dtensor) is not None else None  # a TP piece
        moments = cast("MuonMomentum | SplitMoments", self.moments)  # rule "muon": Muon's one moment
        if r is None:  # an empty tensor-parallel piece: its owner still gathers the whole matrix (see _muon_tp)
            if tp is None or rec.span.numel:
                raise AssertionError(f"Muon's step of matrix {rec.name} on a rank that holds no part of it")
            g, master, momentum = (torch.zeros(shape, dtype=torch.float32, device=here) for _ in range(3))
        else:
            gb = place.grad_of(rec.bucket, grad)  # Muon's gradient stays where it is (no host copy is kept)
            g = gb[r.as_slice()].view(shape).float()
            # offloaded: the master and momentum move to the gradient's device for the step and back
            master, momentum = self.master.read_fp32(r).to(here), moments.read(r).to(here)
        if grad_scale != 1.0:
            g = g * grad_scale  # unscaled, then clipped, as clip_grad_norm_ before torch's Muon
        muon_step_(master.view(shape), g, momentum.view(shape),
                   lr=lr_value(hp["lr"]), weight_decay=float(hp["weight_decay"]), momentum=float(hp["momentum"]),
                   nesterov=bool(hp["nesterov"]), ns_coefficients=tuple(hp["ns_coefficients"]),
                   eps=float(hp["eps"]), ns_steps=int(hp["ns_steps"]), adjust_lr_fn=hp["adjust_lr_fn"],
                   orthogonalize_fn=whole_orthogonalizer(tp, self.comm) if tp is not None else None,
                   shape=tuple(tp.shape) if tp is not None else None)
        if r is not None:
            self.master.write_fp32_(r, master.to(place.device), step)
            moments.write_(r, momentum.to(place.device))

    def _update_muon(self, step: int, grad_scale: float, param_groups: Sequence[dict]) -> None:
        """``update`` for Muon matrices: each one this rank owns (whole in its shard) gets torch.optim.Muon's
        step on its fp32 master (as the master-weight mode decodes it) from its averaged fp32 gradient,
        and the mode encodes the result. Muon keeps no step count; a matrix's lag (steps no rank had a
        gradient for it) only tells whether it has state yet. Every rank."""
        grad = self.local_grad()
        # Tensor-parallel pieces first, in layout order (see _muon_tp [Note: Muon beside tensor parallelism])
        split = [rec for rec in self.records if rec.dtensor is not None and sharded_dim(rec.dtensor) is not None]
        for rec in split:  # by owner, not by elements held: an owner's piece may be empty
            if self.packing.owner[rec.index] == self.comm.shard_rank and rec.trained:
                self._muon_step(rec, grad, grad_scale, param_groups, step)
        done = {id(rec) for rec in split}
        for b in self.forward_order:
            place = self.place_of(b)
            with bucket_range(UPDATE, b):
                for rec in b.params:
                    if rec.local is not None and rec.trained and id(rec) not in done:
                        self._muon_step(rec, grad, grad_scale, param_groups, step)
                place.publish(b)
            self.start_gather(b)
        for rec in self.records:  # left out: no state yet (see checkpoint._torch_state), as AdamW's lag
            rec.stepped()

    def grad_stats(self, norm_type: float | None) -> tuple[Tensor, Tensor]:
        """(inf/NaN count, the norm to the power p or, for the inf-norm, the max) of this rank's
        gradient shard, 0-d fp32 (no sync); ``norm_type`` None: the count only. Local."""
        grad = self.local_grad()
        zero = torch.zeros((), dtype=torch.float32, device=self.flat.device)
        if not grad.numel():
            return zero, zero
        k = self.kernels  # compiled reductions: one pass, about 20x eager's on CPU for 16-bit gradients
        if norm_type is None or math.isinf(norm_type):  # a maximum: piece by piece (stage 1), in any order
            stat = k.grad_nonfinite if norm_type is None else k.grad_max  # a copy counted twice changes no maximum
            s = functools.reduce(torch.maximum, (stat(v) for v in views(grad) if v.numel()))
            if norm_type is None:
                return s, zero
        else:
            # Stage 1 with several ranks and buckets: the shard's pieces copied into one tensor, so the
            # norm is summed as over stage 2's shard, in one call (a sum per piece differs in its last bits)
            g = whole(grad)
            # counted_runs: without the copies that another rank of a model axis counts
            runs = self.counted_runs if self.counted_runs is not None else [Range(0, g.numel())]
            s = sum((k.grad_norm_power(g[r.as_slice()], norm_type) for r in runs if r.size),
                    torch.zeros((), dtype=torch.float32, device=g.device))
        if self.grad_factor != 1.0:  # the norm of the gradient the step takes
            s = s * (self.grad_factor if math.isinf(norm_type) else self.grad_factor ** norm_type)
        return (~torch.isfinite(s)).float(), s

    def nonfinite_params(self) -> Tensor:
        """1D fp32, one flag per parameter in buffer order: 1 where this rank's part of its averaged
        gradient holds an inf/NaN. Local."""
        grad = self.local_grad()
        flags = torch.zeros(len(self.records), dtype=torch.float32, device=self.flat.device)
        for r in self.records:
            if r.local is not None:
                flags[r.index] = (~torch.isfinite(grad[r.local.as_slice()])).any().float()
        return flags

    def take_model_weights(self, records: Sequence[ParamRecord]) -> None:
        """Make rank 0's current weights of the parameters of ``records`` the master weights on every
        rank (see group._binding [Note: parameters changed behind the optimizer's back]). Every rank."""
        pending = [self.comm.broadcast(self.flat.slice(r), src=0)
                   for r in self.layout.param_runs([rec.index for rec in records])]
        for p in pending:
            p.wait()
        self.refresh_master(records)
        self.binding.record()

    def refresh_master(self, records: Sequence[ParamRecord]) -> None:
        """Make this rank's weights of ``records`` the master weights of its shard. Local."""
        for r in records:
            if r.local is not None:
                self.place_of(r.bucket).pull(r.local)
                self.master.refresh_(r.local)

    def load_master(self, tensors: dict[str, Tensor]) -> None:
        """Restore the master weights from ``tensors`` (``MasterWeights.state_tensors``, any mode's) and
        write the weights they encode into this rank's shard of the flat buffer. Local."""
        self.master.load_state_tensors(tensors)
        for place in self.placements:
            place.push()

    def place_of(self, b: BucketRecord) -> OnDevice:
        """The placement that holds bucket ``b``'s part of the shard: the host's when the bucket has
        host copies (``b.host``), else the one beside the weights."""
        return self.placements[0] if b.host is not None else self.placements[-1]

    # -- the weight gathers: started by the update, waited once (see group._gather_wait) ---------
    def _gather(self, b: BucketRecord) -> Pending:
        with bucket_range(ALL_GATHER, b):
            return self.comm.all_gather_inplace(self.flat.data, b.gather_pieces)

    def start_gather(self, b: BucketRecord) -> None:
        """Start the all-gather of bucket ``b``'s updated pieces into the flat buffer (the model's
        weights); its record holds the handle until ``wait_gather``. Every rank, in one order."""
        pending = self._gather(b)
        with self._gather_lock:
            if b.gathering(pending) is None:  # a bucket still in flight keeps its place, with the new handle
                self._started += (b,)

    def wait_gather(self, b: BucketRecord) -> bool:
        """Wait for the gather of bucket ``b`` if it is in flight; True if it was. The bucket counts
        as in flight until its gather has landed: another thread asking for it meanwhile waits here.
        Once it arrived with ``overlap_param_gather``, a parameter of ``b`` written from outside
        while it was in flight lost that write: a late problem the next step reports on every rank. The
        landing is shardopt's own work (its profiler range): it runs with torch functions off, so
        that no torch function mode sees it, the read guard of group._gather_wait included, whose
        look at every call would otherwise be paid for each of them. Local, from any thread."""
        with self._gather_lock, torch._C.DisableTorchFunction():
            pending = b.gather
            if pending is None:
                return False
            arrived = False
            try:
                with bucket_range(GATHER_WAIT, b):  # see core._ranges [Note: profiler ranges]
                    pending.wait()
                arrived = True
            finally:  # waited once, also when the wait raised
                b.gathering(None)
                # the first, as a rule (the forward waits in the order step() started them): O(1) to find
                at = next((i for i, x in enumerate(self._started) if x is b), len(self._started))
                self._started = self._started[:at] + self._started[at + 1:]
                if arrived and self.config.overlap_param_gather:
                    self.late.add([_RACED.format(r.name) for r in self.binding.raced(b.params)])
            return True

    def finish_gathers(self) -> None:
        """Wait for every gather in flight, in the order they were started. Local, from any thread."""
        for b in self._started:
            self.wait_gather(b)

    def drop_gathers(self) -> None:
        """Wait for every gather in flight without looking at what landed (the optimizer is being
        collected). Local."""
        with self._gather_lock:
            for b in self._started:
                cast(Pending, b.gathering(None)).wait()  # a started bucket holds its gather
            self._started = ()

    @property
    def gathers_in_flight(self) -> tuple[BucketRecord, ...]:
        """The buckets whose gather is in flight, in the order started: replaced, never changed in
        place, so a thread may go through it while another waits. A question."""
        return self._started

    def touching(self, first: int, end: int) -> list[BucketRecord]:
        """The buckets in flight with memory in the bytes [first, end) of this group's flat buffer. A question."""
        lo, size = self.flat.data.data_ptr(), self.flat.data.element_size()
        return [b for b in self._started
                if first < lo + b.global_range.end * size and lo + b.global_range.start * size < end]

    def gather_params(self) -> Pending:
        """All buckets' all-gathers as one handle, in the order the forward pass uses them, not
        kept in flight (a checkpoint's restore waits for it). Every rank."""
        parts = [self._gather(b) for b in self.forward_order]
        return Pending([w for p in parts for w in p.works], keep_alive=[self.flat.data], stats=self.comm.stats,
                       comm=self.comm, what="the gather of the weights")

    def memory_report(self) -> MemoryReport:
        """Bytes held on this rank for this buffer, measured from the tensors, and predicted."""
        predicted = predict_bytes(self.layout.param_numel, self.comm.shard_size, stage=self.config.stage,
                                  param_dtype=self.dtype, master_weights=self.master.name,
                                  moments=self.moments.name, rule=self.rule, amsgrad=self.amsgrad)
        # The one model of buffers (see _buffer_model), replayed with the order gradients arrived in
        # the first round (buffer order before any), plus the no_sync fp32 sum when one was used.
        arrival = [r.index for r in self.arrival()] or None
        reduce_dtype = self.reduce_dtype  # None: the gradient's own
        predicted["buffers"], _ = replay_buffers(self.layout, self.comm.shard_rank, arrival, stage=self.config.stage,
                                                 psize=self.flat.data.element_size(),
                                                 rank_order=self.comm.path.name == "rank-order",
                                                 reduce_size=reduce_dtype.itemsize if reduce_dtype is not None else 0,
                                                 hybrid=self.comm.hybrid, max_inflight=MAX_INFLIGHT)
        if self.accumulated:
            predicted["buffers"] += self.layout.numel * cast(torch.dtype, self.accumulate_dtype).itemsize
        if self.store.shard_accumulated:  # several rounds between two steps (see _grad_store)
            predicted["buffers"] += self.layout.shard_numel * cast(torch.dtype, self.accumulate_dtype).itemsize
        return MemoryReport(
            params=self.flat.nbytes, grads=self.grad_bytes, master=self.master.master_bytes,
            exp_avg=self.moments.exp_avg_bytes, exp_avg_sq=self.moments.exp_avg_sq_bytes, extra=self.master.extra_bytes,
            buffers=self.held.buffer_peak, grads_peak=self.held.grad_peak,
            predicted=predicted,
            num_params=self.layout.param_numel, world_size=self.comm.world_size, rank=self.comm.rank,
            shard_size=self.comm.shard_size,
            stage=self.config.stage, offload=self.config.offload, host=sum(p.host_bytes for p in self.placements),
            host_copies=sum(p.copy_bytes for p in self.placements), host_state=self.host_state_bytes)


def build_buffers(trainable: Sequence[tuple[torch.nn.Parameter, int]], comm: Comm, config: ShardConfig,
                  names: dict[int, str], rule_of: Callable[[int], str] = lambda gi: "adamw",
                  amsgrad_of: Callable[[int], bool] = lambda gi: False,
                  counted_of: Callable[[torch.nn.Parameter, int], bool] = lambda p, gi: True,
                  dtensor_of: dict[int, Tensor] | None = None,
                  group_comm: Callable[[int], Comm] | None = None,
                  held_total: HeldTotal | None = None, late: LateProblems | None = None) -> list[FlatGroup]:
    """One FlatGroup per parameter dtype, update rule (``rule_of(group index)``) and process
    group, from (parameter, param-group index) pairs; ``names`` by ``id``;
    ``amsgrad_of(group index)``: the group keeps amsgrad's maximum; ``counted_of(param, group
    index)``: whether this rank counts the parameter in the gradient's norm (a copy across a model
    axis counts on that axis's rank 0 only, see comm._model_axes); ``dtensor_of``: by ``id`` of a
    stand-in, the DTensor parameter it stands in for (see core._dtensor); ``group_comm(group index)``: the Comm a param
    group's parameters are sharded over (its own process_group, else ``comm``); ``held_total``:
    the optimizer's high-water mark of bytes held, over its flat groups; ``late``: its problems
    found outside a check. Every rank (each
    buffer broadcasts rank 0's weights)."""
    dtensor_of = dtensor_of or {}
    group_comm = group_comm or (lambda gi: comm)
    by_kind: dict[tuple[torch.dtype, str, int], list[tuple[torch.nn.Parameter, int]]] = {}
    comms: dict[int, Comm] = {}
    for p, gi in trainable:
        c = group_comm(gi)
        comms[id(c)] = c
        by_kind.setdefault((p.dtype, rule_of(gi), id(c)), []).append((p, gi))
    buffers = []
    for k, ((_, rule, cid), entries) in enumerate(by_kind.items()):
        own = comms[cid]
        # Gradients become ready roughly in reverse registration order: lay buffers out that
        # way so bucket 0 fills first during backward.
        entries = entries[::-1]
        buffers.append(FlatGroup([p for p, _ in entries], [g for _, g in entries], own, config,
                                     names=[names[id(p)] for p, _ in entries], rule=rule, index=k,
                                     amsgrad=rule == "adamw" and any(amsgrad_of(g) for _, g in entries),
                                     counted=[counted_of(p, g) for p, g in entries],
                                     dtensors=[dtensor_of.get(id(p)) for p, _ in entries],
                                     grad_factor=own.world_size / comm.world_size, held_total=held_total,
                                     late=late))
    return buffers
