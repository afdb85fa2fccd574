"""Memory per rank and bytes on the wire for a ``ShardedAdamW`` run, before any process exists.

Owns the analytic model a user consults before renting a cluster. The per-category ZeRO formula
is :func:`shardopt.memory.predict_bytes`; this module adds what that formula leaves out, the
padding of the flat buffer and the communication buffers, and the communication volume of a
step. It needs no process group; ``python -m shardopt.estimate`` prints its tables.

[Note: padding]
Each parameter starts at a multiple of 8 elements and each bucket is padded to a multiple of
``world_size * 8`` (``shardopt.core._layout``). With the parameter shapes the padded size is computed
by the layout code itself, so the estimate equals the measured bytes; without them the model is
treated as one tensor cut into buckets of equal size, which undercounts by less than 8 elements
per parameter tensor.

[Note: buffers estimate]
``buffers`` is the high-water mark of communication buffers while gradients are reduced, bucket
by bucket, with at most ``MAX_INFLIGHT`` reductions waiting on the network (``_rounds``). Stage 2
copies each bucket's gradients into a staging buffer for its reduce-scatter; stage 1 reduces in
place. On NCCL (the native path, see ``_bucket_paths`` [Note: the bucket paths]) the
collectives need no receive buffer; with ``reduce_dtype`` other than the gradient's, each
reduction reads a cast copy of its bucket, held until it lands. On gloo (the rank-order path)
each reduction receives the other ranks' copies of this rank's piece of the bucket,
``(world_size - 1) / world_size`` of a bucket, in two all-to-alls. With the shapes, the estimate replays the flat group: every
backward pass, the first included, launches a bucket once it is complete and every bucket that
completed before it has been launched (the first pass follows rank 0's completions, later ones the
order they learned; see ``_rounds`` [Note: launch order]), and a stage-2 bucket's staging exists
from its first gradient on. So a bucket whose first gradient
arrives early and whose last arrives late stays alive across the pass: in GPT recipes, the bucket
holding the biases and norms, which sit in their own param group at the front of the buffer.
``grad_order`` says in which order gradients become ready; the reverse of the model's
registration order is close for most models. Without it, gradients are taken to arrive in buffer
order, and the peak may be up to one bucket's buffers higher (``buffers_slack``). A bucket holds
whole parameters up to ``bucket_cap_mb``; a larger parameter gets a bucket of its own. Without
shapes, buckets are taken to be ``max(bucket cap, largest_param)`` and the worst rank to own
whole buckets.

[Note: communication volume]
Bytes each rank sends per step with ring algorithms (NCCL's choice for large messages), over
the padded buffer of ``P`` bytes: all-reduce ``2 (N-1)/N P``, reduce-scatter and all-gather
``(N-1)/N P`` each. Stage 1 all-reduces gradients (every rank keeps the full averaged gradient,
as with DDP) and then all-gathers the weights: ``3 (N-1)/N P``. Stage 2 reduce-scatters and
all-gathers: ``2 (N-1)/N P``, the same as DDP's all-reduce. Dividing by the per-rank link
bandwidth gives a floor on the step's communication time, ignoring latency and any overlap with
backward.

With hybrid sharding (``shard_size`` S < N, R = N / S replicas) the padded buffer is cut S ways:
state and buffers are those of S ranks, the reduce-scatter and the all-gathers run over the S
ranks of the shard group (``(S-1)/S P`` per pass), and each rank's averaged piece of ``P / S``
is all-reduced across the R replicas, ``2 (R-1)/R P/S`` (in fp32 on gloo, which sums there in
fp32; on NCCL in ``reduce_dtype`` when it is set, else in the gradient dtype). With the shard group inside a node, only that last term
crosses nodes: ``comm_cross``, against the whole ``comm_bytes`` of flat sharding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from shardopt.memory._buffer_model import replay_buffers
from shardopt.core._config import OFFLOAD_TARGETS
from shardopt.core._layout import DEFAULT_ALIGNMENT, build_layout
from shardopt.group._muon_packing import owned_layout
from shardopt.group._rounds import MAX_INFLIGHT
from shardopt.update._master import STRATEGIES
from shardopt.update._moments import MOMENTS, MUON_MOMENTS, moment_alignment
from shardopt.memory import CATEGORIES, ddp_adamw_bytes, predict_bytes

__all__ = ["MemoryEstimate", "estimate_memory", "DTYPES", "BACKENDS"]

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Predicted bytes on one rank, by category, and bytes each rank sends per step.

    Categories are those of :class:`shardopt.MemoryReport`. ``master_weights`` is the mode in
    effect (fp32 parameters are their own master, whatever was asked for).
    """

    num_params: int  # trainable parameter elements
    world_size: int
    shard_size: int  # ranks the state is sharded over (world_size unless hybrid)
    stage: int
    master_weights: str
    param_dtype: torch.dtype
    moments: str  # how the Adam moments are stored (see shardopt.update._moments)
    padded_numel: int  # elements of the flat buffer, padding included
    params: int
    grads: int
    master: int
    exp_avg: int
    exp_avg_sq: int
    extra: int
    buffers: int
    backend: str  # "nccl" or "gloo": which collectives the buffers are estimated for (its default path)
    rank: int  # the rank whose buffers these are
    buffers_slack: int  # bytes one bucket adds to buffers: the margin for another gradient order, see [Note: buffers estimate]
    comm_reduce: int  # bytes sent per rank per step for the gradients (all-reduce or reduce-scatter)
    comm_gather: int  # bytes sent per rank per step for the all-gather of the weights
    comm_cross: int  # hybrid: bytes sent per rank per step by the cross-replica all-reduce (0 when flat)
    buckets: int  # gradient buckets, each one reduction (and one all-gather) per step
    ddp: dict[str, int]  # the same parameters under DDP + mixed-precision AdamW, by category
    ddp_comm: int  # bytes sent per rank per step by DDP's gradient all-reduce
    offload: str | None = None  # "cpu": master, moments and extra are in host memory, not on the accelerator
    host: int = 0  # bytes of host memory per rank for the offloaded state and the weight and gradient copies

    @property
    def accelerator(self) -> int:
        """Bytes on the accelerator of one rank: ``total`` less the offloaded state."""
        return self.total - (self.master + self.exp_avg + self.exp_avg_sq + self.extra if self.offload else 0)

    @property
    def total(self) -> int:
        """Bytes on one rank, all categories."""
        return sum(getattr(self, c) for c in CATEGORIES)

    @property
    def bytes_per_param(self) -> float:
        return self.total / max(self.num_params, 1)

    @property
    def comm_bytes(self) -> int:
        """Bytes each rank sends per step."""
        return self.comm_reduce + self.comm_gather + self.comm_cross

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_size

    @property
    def comm_inside(self) -> int:
        """Bytes each rank sends per step inside its shard group (all of them when flat)."""
        return self.comm_reduce + self.comm_gather

    def ring_hops(self, gpus_per_node: int) -> tuple[int, int]:
        """(ring steps per step whose slowest hop is inside a node, those that cross nodes), with
        nodes of ``gpus_per_node`` consecutive ranks: each ring collective over g ranks takes g - 1
        steps per pass, and a step costs at least one link latency. Every bucket's reduction and
        all-gather runs over the shard group (3 passes in stage 1: reduce-scatter, all-gather of
        the gradient, of the weights; 2 in stage 2); hybrid adds a ring all-reduce (2 passes) over
        the replicas. NCCL's tree and PAT algorithms need fewer steps; this is the ring bound."""
        inside = self.buckets * (3 if self.stage == 1 else 2) * (self.shard_size - 1)
        cross = self.buckets * 2 * (self.replicas - 1)
        if self.shard_size > gpus_per_node:  # the shard group itself spans nodes
            return 0, inside + cross
        return inside, cross

    @property
    def ddp_total(self) -> int:
        return sum(self.ddp.values())

    def by_category(self) -> dict[str, int]:
        """Bytes per category, in :data:`shardopt.memory.CATEGORIES` order."""
        return {c: getattr(self, c) for c in CATEGORIES}

    def comm_seconds(self, bandwidth_gb_s: float) -> float:
        """Floor on the step's communication time at ``bandwidth_gb_s`` (1e9 bytes/s per rank)."""
        return self.comm_bytes / (bandwidth_gb_s * 1e9)

    def __str__(self) -> str:
        per, gib = max(self.num_params, 1), 2.0**30
        hybrid = f" ({self.replicas} replicas x {self.shard_size})" if self.shard_size != self.world_size else ""
        rows = [f"{self.num_params:,} parameters ({_dtype_name(self.param_dtype)}), {self.world_size} ranks{hybrid}, "
                f"stage {self.stage}, master_weights={self.master_weights}, moments={self.moments} "
                "(bytes on one rank; GiB = 2^30 bytes)",
                f"| {'category':<10} | {'GiB':>10} | {'B/param':>7} | {'DDP + AdamW GiB':>15} |",
                f"|{'-' * 12}|{'-' * 12}|{'-' * 9}|{'-' * 17}|"]
        for c in CATEGORIES + ("total",):
            v = self.total if c == "total" else getattr(self, c)
            d = self.ddp_total if c == "total" else self.ddp[c]
            rows.append(f"| {c:<10} | {v / gib:>10.3f} | {v / per:>7.3f} | {d / gib:>15.3f} |")
        if self.buffers:
            rows.append(f"buffers: {self.backend} communication buffers of rank {self.rank}; a gradient order other "
                        f"than the one assumed can add up to {self.buffers_slack / 2**20:,.1f} MiB")
        kind = "all-reduce" if self.stage == 1 else "reduce-scatter"
        cross = f" + cross-replica all-reduce {self.comm_cross / 1e9:.3f} GB" if self.comm_cross else ""
        rows.append(f"sent per rank per step: {kind} {self.comm_reduce / 1e9:.3f} GB + all-gather "
                    f"{self.comm_gather / 1e9:.3f} GB{cross} = {self.comm_bytes / 1e9:.3f} GB "
                    f"(DDP all-reduce {self.ddp_comm / 1e9:.3f} GB)")
        return "\n".join(rows)


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def _as_dtype(param_dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(param_dtype, str):
        key = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(
            param_dtype, param_dtype)
        if key not in DTYPES:
            raise ValueError(f"unknown param_dtype={param_dtype!r}; use one of {sorted(DTYPES)} or a torch.dtype")
        return DTYPES[key]
    if param_dtype not in DTYPES.values():
        raise ValueError(f"param_dtype={param_dtype!r} is not supported; ShardedAdamW takes "
                         f"{[str(d) for d in DTYPES.values()]}")
    return param_dtype


def _as_count(name: str, value: float | int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {name}={value!r}")
    return int(value)


def _ring(world_size: int, nbytes: int, passes: int) -> int:
    """Bytes one rank sends in ``passes`` ring passes over ``nbytes`` (a pass moves (N-1)/N of it)."""
    return passes * (world_size - 1) * nbytes // world_size


def estimate_memory(
    num_params: float | int | None,
    world_size: int,
    stage: int = 2,
    master_weights: str = "fp32",
    param_dtype: torch.dtype | str = torch.bfloat16,
    *,
    param_shapes: Sequence[Sequence[int]] | None = None,
    grad_order: Sequence[int] | None = None,
    bucket_cap_mb: float = 25.0,
    largest_param: int | None = None,
    backend: str = "nccl",
    rank: int | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
    moments: str = "fp32",
    shard_size: int | None = None,
    rule: str = "adamw",
    offload: str | None = None,
    amsgrad: bool = False,
    reduce_dtype: torch.dtype | None = None,
) -> MemoryEstimate:
    """Bytes one rank of a ``ShardedAdamW`` run holds, by category, and the bytes it sends per step.

    ``num_params`` counts trainable elements (``7e9`` is accepted); it may be ``None`` when
    ``param_shapes`` is given. ``param_shapes`` are the shapes of the trainable parameters in the
    order they are passed to ``ShardedAdamW``; with them padding and buckets are those the
    optimizer builds and every category is exact, ``buffers`` (see [Note: buffers estimate]) on
    ``rank`` (default: the rank with the most) given ``grad_order`` (indices into ``param_shapes``
    in the order their gradients become ready in backward, e.g. the reverse of registration order);
    without it within ``buffers_slack``. ``largest_param``
    (elements) sizes the buckets when shapes are not given. ``bucket_cap_mb`` is in MiB, as in
    ``ShardedAdamW``; ``backend`` is ``"nccl"`` (GPUs) or ``"gloo"`` (CPUs), each with its default
    bucket path (``SHARDOPT_COLLECTIVES`` unset); ``reduce_dtype`` as in ``ShardedAdamW`` (on NCCL a
    reduction in another dtype than the gradient's reads a cast copy of its bucket); ``moments`` as in
    ``ShardedAdamW`` (``"fp32"``, ``"bf16"``, ``"8bit"``); ``shard_size`` the ranks the state is
    sharded over with hybrid sharding (a ``(world_size / shard_size, shard_size)`` device mesh;
    default ``world_size``, flat), and ``rank`` then a rank of the shard group. ``rule="muon"``
    estimates ``ShardedMuon``'s Muon matrices (one momentum buffer, fp32 or with ``moments="bf16"``
    bf16, counted as ``exp_avg``;
    with ``param_shapes``, each matrix placed whole in one rank's shard, padding included); a
    ShardedMuon's AdamW parameters are a second estimate with ``rule="adamw"``. ``offload="cpu"``:
    the master weights, moments and extras are counted in ``host`` with the host copies of the
    weight and gradient shards (Muon: of the weights only), and ``accelerator`` leaves them out.
    ``amsgrad=True`` (AdamW's): ``exp_avg_sq`` also holds its running maximum, stored as the moments
    are (fp32 or bf16; not with ``"8bit"``). Needs no process group; call it anywhere.
    """
    if offload not in OFFLOAD_TARGETS or isinstance(offload, bool):
        raise ValueError(f"offload must be None or 'cpu', got {offload=!r}")
    if rule not in ("adamw", "muon"):
        raise ValueError(f"rule must be 'adamw' or 'muon', got {rule=!r}")
    world_size = _as_count("world_size", world_size, 1)
    shard = world_size if shard_size is None else _as_count("shard_size", shard_size, 1)
    if world_size % shard:
        raise ValueError(f"shard_size={shard} must divide world_size={world_size} (a mesh of "
                         f"world_size / shard_size replicas of shard_size ranks)")
    replicas = world_size // shard
    if stage not in (1, 2) or isinstance(stage, bool):
        raise ValueError(f"stage must be 1 or 2, got stage={stage!r}")
    if master_weights not in STRATEGIES:
        raise ValueError(f"unknown master_weights={master_weights!r}; choose one of {sorted(STRATEGIES)}")
    if moments not in MOMENTS:
        raise ValueError(f"unknown moments={moments!r}; choose one of {sorted(MOMENTS)}")
    if rule == "muon" and moments not in MUON_MOMENTS:
        raise ValueError(f"rule='muon' stores Muon's momentum in fp32 or bf16, got moments={moments!r}")
    if amsgrad and (rule == "muon" or moments == "8bit"):
        raise ValueError(f"amsgrad=True is AdamW's, with moments='fp32' or 'bf16'; got {rule=!r} {moments=!r}")
    alignment = math.lcm(alignment, moment_alignment(moments))  # as ShardedAdamW lays the buffer out
    dtype = _as_dtype(param_dtype)
    if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
        raise ValueError(f"bucket_cap_mb must be a positive number (MiB), got {bucket_cap_mb=!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend=!r}")
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < shard):
        raise ValueError(f"rank must be in [0, world_size), got {rank=!r} {world_size=}" if replicas == 1 else
                         f"rank must be a rank of the shard group, in [0, shard_size), got {rank=!r} shard_size={shard}")
    psize = torch.empty((), dtype=dtype).element_size()
    cap_bytes = bucket_cap_mb * 2**20
    bucket_numel = None if math.isinf(cap_bytes) else max(1, int(cap_bytes / psize))
    if reduce_dtype is not None and (not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point):
        raise ValueError(f"reduce_dtype must be None (the gradient dtype) or a float torch.dtype, got {reduce_dtype!r}")
    reduce_size = 0 if reduce_dtype in (None, dtype) else torch.empty((), dtype=reduce_dtype).element_size()
    gloo = backend == "gloo"  # its default bucket path: rank-order (see comm._bucket_paths [Note: the bucket paths])

    if param_shapes is not None:
        # ShardedAdamW lays parameters out in reverse order (see ShardedAdamW._build_buffers).
        if rule == "muon":
            layout, _, order = owned_layout(list(param_shapes)[::-1], shard, alignment=alignment, bucket_numel=bucket_numel)
            position = {i: k for k, i in enumerate(order)}  # index in the shapes given -> in the buffer
        else:
            layout = build_layout(list(param_shapes)[::-1], shard, alignment=alignment, bucket_numel=bucket_numel)
        if num_params is not None and _as_count("num_params", num_params, 1) != layout.param_numel:
            raise ValueError(f"num_params={num_params!r} disagrees with param_shapes, which hold "
                             f"{layout.param_numel} elements; pass one or make them agree")
        num_params, padded = layout.param_numel, layout.numel
        last = len(layout.params) - 1
        if grad_order is not None and sorted(grad_order) != list(range(last + 1)):
            raise ValueError(f"grad_order must be a permutation of the {last + 1} indices of param_shapes, "
                             f"got {list(grad_order)[:8]}{'...' if len(grad_order) > 8 else ''}")
        arrival = None if grad_order is None else [last - i for i in grad_order]  # to buffer positions
        if rule == "muon" and arrival is not None:  # the packing reorders the matrices by owner
            arrival = [position[i] for i in arrival]
        ranks = [rank] if rank is not None else (range(shard) if gloo else [0])  # gloo: ranks receive unalike
        (buffers, slack), chosen = max((replay_buffers(layout, r, arrival, stage=stage, psize=psize, rank_order=gloo,
                                                       reduce_size=reduce_size, hybrid=replicas > 1,
                                                       max_inflight=MAX_INFLIGHT), r) for r in ranks)
    else:
        if num_params is None:
            raise ValueError("give num_params or param_shapes")
        num_params = _as_count("num_params", num_params, 1)
        unit = shard * alignment
        cap = max(cap_bytes, (largest_param or 0) * psize)  # bytes of a bucket's parameters
        count = 1 if math.isinf(cap) else max(1, -(-num_params * psize // int(cap)))  # buckets of equal size
        each = -(-num_params // count)  # elements of one bucket
        padded = count * (-(-each // unit) * unit)  # each padded to a multiple of unit
        whole = padded * psize
        bucket = int(min(whole, max(cap_bytes, (largest_param or 0) * psize)))
        window = min(whole, (MAX_INFLIGHT + 1) * bucket)
        staging = window if stage == 2 else 0
        if gloo:  # rank-order: each reduction in flight receives (shard - 1) / shard of a bucket
            held = min(whole, MAX_INFLIGHT * bucket) * (shard - 1) // shard
            if replicas > 1:  # and holds an fp32 partial sum of its piece
                held += min(whole, (MAX_INFLIGHT + 1) * bucket // shard) * max(psize, 4) // psize
            per_bucket = min(whole, bucket) * (shard - 1) // shard
        else:  # native: reduce_dtype's cast copy of each bucket in flight
            held, per_bucket = window * reduce_size // psize, bucket * reduce_size // psize
        buffers, slack = staging + held, (bucket if stage == 2 else 0) + per_bucket
        chosen = 0 if rank is None else rank

    mode = master_weights if psize == 2 else "fp32"
    formula = predict_bytes(padded, shard, stage=stage, param_dtype=dtype, master_weights=mode,
                            moments=moments, rule=rule, amsgrad=amsgrad)
    formula["buffers"] = buffers
    nbytes = padded * psize
    buckets = len(layout.buckets) if param_shapes is not None else -(-(padded * psize) // bucket)
    cross_size = max(psize, 4) if gloo else (reduce_size or psize)  # rank-order: the fp32 partial sums
    cross = 0 if replicas == 1 else 2 * (replicas - 1) * (nbytes // shard) // replicas * cross_size // psize
    shard_numel = padded // shard
    host = 0 if offload is None else (formula["master"] + formula["exp_avg"] + formula["exp_avg_sq"] + formula["extra"]
                                      + shard_numel * psize * (1 if rule == "muon" else 2))
    return MemoryEstimate(
        offload=offload, host=host, num_params=num_params, world_size=world_size, shard_size=shard, stage=stage, master_weights=mode, param_dtype=dtype, moments=moments,
        padded_numel=padded, **formula, backend=backend, rank=chosen, buffers_slack=slack,
        comm_reduce=_ring(shard, nbytes, 2 if stage == 1 else 1), comm_gather=_ring(shard, nbytes, 1), comm_cross=cross, buckets=buckets,
        ddp=ddp_adamw_bytes(num_params, dtype, amsgrad), ddp_comm=_ring(world_size, num_params * psize, 2))

