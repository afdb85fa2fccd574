"""``ShardedAdamW.inspect()``: a read-only view of what one optimizer holds on this rank.

For tests, benchmarks and debugging: it names the optimizer's state without reaching into its
private attributes. Every property is read when asked (the view follows the optimizer as it
trains), is local to this rank and issues no collective, so any rank may read it at any time.

Properties have no setters. Sequences are tuples and mappings read-only; tensors are the ones the
optimizer holds, not copies (a copy of the state would double its memory): read them, never write
them. Element counts are elements of the buffer's dtype; byte counts are bytes.

Views hold the optimizer (and its buffers) weakly, so keeping one (in a hook, a logger) does not
keep the optimizer alive; reading one after the optimizer was collected raises ``ReferenceError``.
"""
from __future__ import annotations

import types
import weakref
from typing import TYPE_CHECKING, Any, Mapping, Protocol, TypeVar, cast

import torch
from torch import Tensor

from shardopt.comm._collectives import Pending
from shardopt.core._flat import whole
from shardopt.core._layout import FlatLayout, Range
from shardopt.core._records import BucketRecord, ParamRecord, ParamState
from shardopt.group._rounds import RoundState
from shardopt.group._muon_packing import MuonPacking
from shardopt.group._flat_group import FlatGroup

if TYPE_CHECKING:
    from shardopt.core._config import ShardConfig
    from shardopt.step._internals import Internals
    from shardopt.update._master import FP32Master
    from shardopt.update._split import SplitMaster

    class _Optimizer(Protocol):
        """What a view reads of a ShardedAdamW, which lives a layer up (optimizer.py): named by these
        attributes, since setup.cfg's contracts let no lower folder import it, not even for types; its
        parts through ``internals`` (``step._internals``)."""

        config: ShardConfig
        internals: Internals

_T = TypeVar("_T")


def _alive(ref: weakref.ref[_T]) -> _T:
    obj = ref()
    if obj is None:
        raise ReferenceError("the optimizer this view reads was collected")
    return obj


class BufferView:
    """One flat buffer (the parameters of one dtype and device) and this rank's state for it."""

    __slots__ = ("_ref",)

    def __init__(self, buffer: FlatGroup) -> None:
        self._ref = weakref.ref(buffer)

    def __repr__(self) -> str:
        if self._ref() is None:
            return "BufferView(<collected>)"
        return (f"BufferView(dtype={self.dtype}, params={len(self.params)}, numel={self.numel}, "
                f"shard_numel={self.shard_numel})")

    @property
    def _buf(self) -> FlatGroup:
        return _alive(self._ref)

    # -- layout ----------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The parameters' (and the flat buffer's) dtype."""
        return self._buf.flat.dtype

    @property
    def device(self) -> torch.device:
        """Where the parameters, and this rank's state for them, live."""
        return self._buf.flat.device

    @property
    def layout(self) -> FlatLayout:
        """Where each parameter, bucket and shard lies in the flat buffer (frozen; see ``_layout``)."""
        return self._buf.layout

    @property
    def numel(self) -> int:
        """Elements of the whole flat buffer, padding included (a multiple of the shard group size)."""
        return self._buf.layout.numel

    @property
    def param_numel(self) -> int:
        """Elements that belong to parameters (the buffer without its padding)."""
        return self._buf.layout.param_numel

    @property
    def shard_numel(self) -> int:
        """Elements of every rank's shard (all shards are equal)."""
        return self._buf.layout.shard_numel

    @property
    def shard_runs(self) -> tuple[tuple[Range, Range], ...]:
        """This rank's shard in the flat buffer: (local range, global range) of its piece of each
        bucket, in bucket order (see ``_layout`` [Note: alignment, padding and shards])."""
        return tuple(self._buf.shard.runs)

    @property
    def params(self) -> tuple[torch.nn.Parameter, ...]:
        """The parameters in buffer order (``layout.params[i]`` places ``params[i]``)."""
        return tuple(self._buf.flat.params)

    @property
    def names(self) -> tuple[str, ...]:
        """How messages name each parameter, in buffer order."""
        return tuple(r.name for r in self._buf.records)

    # -- weights -----------------------------------------------------------------------------
    @property
    def weights(self) -> Tensor:
        """The flat buffer itself (1-D, ``numel`` elements); every parameter is a view of it."""
        return self._buf.flat.data

    @property
    def shard_weights(self) -> Tensor:
        """This rank's shard of ``weights`` (1-D, ``shard_numel`` elements, its pieces one after
        another): a view when the shard is one piece (one bucket), else a copy."""
        return self._buf.shard.read()

    @property
    def master_weights(self) -> str:
        """The master-weight mode used (``"fp32"`` for fp32 parameters, whatever was asked)."""
        return self._buf.master.name

    @property
    def master_copy(self) -> Tensor | None:
        """The fp32 master copy of this rank's shard (1-D, ``shard_numel`` elements) when one is held
        apart from the weights: 16-bit parameters with ``master_weights="fp32"``; else None."""
        master = self._buf.master
        held = getattr(master, "owns_copy", False)  # only the fp32 strategy (or its pieces) holds one
        return cast(Tensor, cast("FP32Master | SplitMaster", master).master) if held else None

    @property
    def master_fp32(self) -> Tensor:
        """The master weights of this rank's shard as fp32 (1-D, ``shard_numel`` elements): the held
        tensor when there is one (fp32 master, or fp32 parameters), else a decoded copy."""
        return self._buf.master.fp32()

    @property
    def offload(self) -> str | None:
        """Where the master weights and moments live: None (beside the weights) or ``"cpu"`` (host memory)."""
        return self._buf.config.offload

    @property
    def host_buffer(self) -> Tensor | None:
        """``offload="cpu"``: the one host allocation (1-D uint8, bytes) the offloaded state and copies
        are carved from (each bucket's views are in ``buckets[i].host``); else None."""
        buffer = getattr(self._buf.placements[0], "buffer", None)
        return None if buffer is None else buffer.data

    @property
    def moments(self) -> str:
        """The moment format: ``"fp32"``, ``"bf16"`` or ``"8bit"``."""
        return self._buf.moments.name

    @property
    def rule(self) -> str:
        """The update rule of this buffer's parameters: ``"adamw"`` or ``"muon"``."""
        return self._buf.rule

    @property
    def muon_packing(self) -> MuonPacking | None:
        """For a Muon buffer, which rank owns each matrix (indexed as ``params``), the padding
        (elements) and the Newton-Schulz work per rank; None for AdamW."""
        return getattr(self._buf, "packing", None)

    @property
    def moment_tensors(self) -> Mapping[str, Tensor]:
        """The Adam moments of this rank's shard as stored, by name (``exp_avg``, ``exp_avg_sq``; for
        8-bit the codes and per-block scales)."""
        return types.MappingProxyType(self._buf.moments.tensors())

    # -- gradients ----------------------------------------------------------------------------
    @property
    def flat_grad(self) -> Tensor | None:
        """Stage 1: the whole flat gradient (1-D, ``numel`` elements; the ``.grad`` are views of
        it). Stage 2: None."""
        return self._buf.flat_grad

    @property
    def grad_shard(self) -> Tensor | None:
        """Stage 2: this rank's shard of the averaged gradient (1-D, ``shard_numel``). Stage 1: None."""
        return self._buf.grad_shard

    @property
    def local_grad(self) -> Tensor:
        """This rank's shard of the averaged gradient, either stage (1-D, ``shard_numel``). In stage
        2, after several rounds since ``zero_grad``, their fp32 sum rounded, as ``step`` reads it
        (a copy until the step rounds it into ``grad_shard``; reading changes nothing). Stage 1: its
        pieces of ``flat_grad``, a copy unless the shard is one piece."""
        return whole(self._buf.local_grad())

    # -- buckets and rounds -----------------------------------------------------------------
    @property
    def bucket_order(self) -> tuple[int, ...] | None:
        """Buckets in the launch order the ranks agreed on; None until the first backward pass."""
        order = self._buf.launch_order()
        return None if order is None else tuple(b.index for b in order)

    @property
    def forward_order(self) -> tuple[int, ...]:
        """Buckets in the order the forward pass uses them (the order ``step`` updates and gathers)."""
        return tuple(b.index for b in self._buf.forward_order)

    @property
    def may_nest(self) -> tuple[bool, ...]:
        """Per bucket: it holds a parameter used only inside reentrant checkpoints, so its reduction
        waits for the end of the outer backward pass."""
        return tuple(b.may_nest for b in self._buf.buckets)

    @property
    def records(self) -> tuple[ParamRecord, ...]:
        """One record per parameter, in buffer order: everything the optimizer keeps about it (see
        ``core._records`` [Note: the records]). The optimizer's own objects: read, never write."""
        return tuple(self._buf.records)

    @property
    def buckets(self) -> tuple[BucketRecord, ...]:
        """One record per bucket, in buffer order (``layout.buckets[i]`` is ``buckets[i]``)."""
        return tuple(self._buf.buckets)

    @property
    def param_states(self) -> tuple[ParamState, ...]:
        """Per parameter, in buffer order: where its gradient is in the open round."""
        return tuple(r.state for r in self._buf.records)


class OptimizerView:
    """A read-only view of one ``ShardedAdamW`` on this rank (see the module docstring). Any rank
    may read any property at any time: local, no collective."""

    __slots__ = ("_ref",)

    def __init__(self, optimizer: _Optimizer) -> None:  # a ShardedAdamW (one floor up)
        self._ref = weakref.ref(optimizer)

    def __repr__(self) -> str:
        opt = self._ref()
        if opt is None:
            return "OptimizerView(<collected>)"
        return (f"OptimizerView(rank={self.rank}, world_size={self.world_size}, stage={self.stage}, "
                f"buffers={self.buffers})")

    @property
    def _opt(self) -> _Optimizer:
        return _alive(self._ref)

    # -- ranks ---------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank in the optimizer's process group."""
        return self._opt.internals.comm.rank

    @property
    def world_size(self) -> int:
        """Ranks in the optimizer's process group (all data-parallel ranks)."""
        return self._opt.internals.comm.world_size

    @property
    def shard_rank(self) -> int:
        """This rank within its shard group (the ranks one copy of the state is split over)."""
        return self._opt.internals.comm.shard_rank

    @property
    def shard_size(self) -> int:
        """Ranks in a shard group (``world_size`` unless hybrid sharding)."""
        return self._opt.internals.comm.shard_size

    @property
    def replica(self) -> int:
        """Which copy of the state this rank's shard group holds (0 unless hybrid sharding)."""
        return self._opt.internals.comm.replica

    @property
    def replicas(self) -> int:
        """Copies of the state: shard groups (1 unless hybrid sharding)."""
        return self._opt.internals.comm.replicas

    # -- configuration and state -----------------------------------------------------------
    @property
    def stage(self) -> int:
        """1: gradients whole on every rank; 2: each rank keeps its shard of the gradient."""
        return self._opt.config.stage

    @property
    def buffers(self) -> tuple[BufferView, ...]:
        """One view per flat buffer (per parameter dtype and device), in the optimizer's order."""
        return tuple(BufferView(b) for b in self._opt.internals.buffers)

    @property
    def step_count(self) -> int:
        """Steps taken (skipped steps not counted)."""
        return self._opt.internals.progress.step

    @property
    def scaler_state(self) -> dict[str, Any]:
        """The loss scaler's ``state_dict()`` (a fresh dict: writing it changes nothing)."""
        return self._opt.internals.scaler.state_dict()

    @property
    def held_bytes(self) -> int:
        """Gradient and communication-buffer bytes this rank holds now, over every buffer."""
        return self._opt.internals.held.now()

    @property
    def gather_handles(self) -> tuple[Pending, ...]:
        """The weight all-gathers ``step`` started that were not waited for yet."""
        return tuple(self._opt.internals.gathers.handles())

    # -- rounds of gradient reductions -----------------------------------------------------
    @property
    def round_state(self) -> RoundState:
        """Where this rank's round of bucket reductions is (``IDLE`` between backward passes)."""
        return self._opt.internals.rounds.state

    @property
    def total_rounds(self) -> int:
        """Rounds of reductions completed since construction."""
        return self._opt.internals.rounds.total_rounds

    @property
    def lost_round(self) -> bool:
        """A backward pass raised inside a round since the last step (the round was finished later)."""
        return self._opt.internals.rounds.lost_round
