"""Master-weight strategies: how this rank keeps the high-precision weights of its shard.

Each strategy wraps this rank's shard of a flat parameter buffer (``param_shard``: the model's
weights, a ``core._flat.ShardView`` of its pieces, or, offloaded, a 1-D host copy) behind one interface: ``update_`` runs AdamW on a local range and writes
the new weights into ``param_shard``; ``fp32`` returns the master as fp32; ``state_tensors`` and
``load_state_tensors`` checkpoint it (always as the decoded fp32 master, so a checkpoint loads
into any mode). Extra bytes per element, sharded (16-bit parameters):

``fp32``        4  an fp32 copy (for fp32 parameters the shard itself is the master, no copy)
``remainder``   2  a 16-bit remainder beside the 16-bit weight rebuilds the fp32 master exactly
                   (bf16: bit for bit; fp16: for 2**-16 <= |w| <= 65504, see kernels.codecs)
``stochastic``  0  no master; the fp32 result is rounded stochastically (unbiased) into 16 bits
``none``        0  no master; rounded to nearest every step, so updates below half an ulp of a
                   weight are lost (fairseq's memory-efficient optimizer); for comparison only

With fp32 parameters every mode is ``fp32``: the weights already are the master.
"""
from __future__ import annotations

import abc
import warnings
from typing import Any, Callable, cast

import torch
from torch import Tensor

from shardopt.core._config import MASTER_MODES
from shardopt.core._flat import ShardView, whole
from shardopt.core._layout import Range
from shardopt.kernels import Kernels, codecs, select
from shardopt.kernels.codecs import round_to_dtype
from shardopt.kernels.reference import Scalars
from shardopt.update._moments import Moment


class MasterWeights(abc.ABC):
    """Base: the interface every strategy implements."""

    name = ""

    def __init__(self, param_shard: Tensor | ShardView, *, logical: Callable[[int], int] = lambda local: local,
                 kernels: Kernels | None = None, seed: int = 0,
                 empty: Callable[[int, torch.dtype], Tensor] | None = None) -> None:
        # param dtype, shard_numel elements: this rank's shard of the weights, its pieces of the flat param
        # buffer (or, offloaded, its host copy: see update._offload); a local range within one bucket's
        # piece is a 1-D view
        self.param_shard = param_shard
        # how this strategy allocates its own tensors: (elements, dtype) -> 1D tensor beside param_shard
        self.empty = empty or (lambda n, dtype: torch.empty(n, dtype=dtype, device=param_shard.device))
        # local element -> its logical offset, the random bits' key (see core._layout [Note: logical offsets])
        self.logical = logical
        # The buffer's kernels (see kernels.select); made here from what this strategy knows when not
        # given, with the moments format unknown (so checked for every format).
        self.kernels = kernels if kernels is not None else select(dtype=param_shard.dtype, master=self.name,
                                                                  device=param_shard.device)
        self.seed = seed

    @abc.abstractmethod
    def update_(self, r: Range, grad: Tensor, exp_avg: Moment, exp_avg_sq: Moment, s: Scalars, step: int,
                vmax: Tensor | None = None) -> None:
        """AdamW over local range ``r`` (``grad`` and the moments' operands, see ``shardopt.update._moments``,
        are already sliced to ``r``; ``vmax``: amsgrad's running maximum of ``exp_avg_sq`` there, or None)."""

    def kernels_for(self, r: Range) -> Kernels:
        """The kernels that update local range ``r`` (one strategy: its own; see update._split)."""
        return self.kernels

    def _key(self, r: Range, step: int) -> codecs.Key:
        """The random-bit key of local range ``r`` (within one bucket's piece) at ``step`` (from the
        seed, the step and the range's logical offset, see kernels.codecs.make_key)."""
        return codecs.make_key(self.seed, step, self.logical(r.start), self.param_shard.device)

    def _moment_key(self, r: Range, step: int, exp_avg: Moment) -> codecs.Key | None:
        """The key, when the moments are rounded stochastically (not fp32)."""
        dense32 = isinstance(exp_avg, Tensor) and exp_avg.dtype == torch.float32
        return None if dense32 else self._key(r, step)

    def fp32(self) -> Tensor:
        """The master weights of the whole shard as fp32 (a view when one is held, else a copy)."""
        return whole(self.param_shard).float()

    def refresh_(self, r: Range) -> None:  # noqa: B027 - a default, not abstract: most strategies keep it
        """The weights over local range ``r`` were written from outside the optimizer (e.g.
        ``model.load_state_dict``): make them the master there. Default: the weight is the master."""

    def read_fp32(self, r: Range) -> Tensor:
        """The master weights over local range ``r`` as fp32, for an update rule computed outside the
        fused AdamW kernels (Muon): a view where an fp32 master is held, else a decoded copy."""
        return self.param_shard[r.as_slice()].float()

    def write_fp32_(self, r: Range, values: Tensor, step: int) -> None:
        """Store updated fp32 master weights over local range ``r`` (what ``read_fp32`` returned,
        updated) and the weights they encode to. Default: the weight, with shardopt's 16-bit cast."""
        self.param_shard[r.as_slice()].copy_(round_to_dtype(values, self.param_shard.dtype))

    def state_tensors(self) -> dict[str, Tensor]:
        """Tensors a checkpoint must keep to resume exactly (1-D, shard length)."""
        return {"master": self.fp32()}

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        """Restore from ``state_tensors`` output (any mode's) and write the weights into ``param_shard``."""
        self.param_shard.copy_(round_to_dtype(tensors["master"].float(), self.param_shard.dtype))

    @property
    def master_bytes(self) -> int:
        return 0

    @property
    def extra_bytes(self) -> int:
        return 0


class FP32Master(MasterWeights):
    name = "fp32"

    def __init__(self, param_shard: Tensor | ShardView, **kw: Any) -> None:
        super().__init__(param_shard, **kw)
        self.owns_copy = param_shard.dtype != torch.float32
        # 1D fp32; aliases param_shard for fp32 params
        self.master: Tensor | ShardView = self.empty(param_shard.numel(), torch.float32).copy_(whole(param_shard)) \
            if self.owns_copy else param_shard

    def update_(self, r: Range, grad: Tensor, exp_avg: Moment, exp_avg_sq: Moment, s: Scalars, step: int,
                vmax: Tensor | None = None) -> None:
        out = self.param_shard[r.as_slice()] if self.owns_copy else None
        self.kernels.step_fp32(self.master[r.as_slice()], grad, exp_avg, exp_avg_sq, s, out,
                               self._moment_key(r, step, exp_avg), **_max_arg(vmax))

    def fp32(self) -> Tensor:
        return whole(self.master)

    def read_fp32(self, r: Range) -> Tensor:
        return self.master[r.as_slice()]

    def write_fp32_(self, r: Range, values: Tensor, step: int) -> None:
        master = self.master[r.as_slice()]
        if values.data_ptr() != master.data_ptr():
            master.copy_(values)
        if self.owns_copy:  # shardopt's cast, as the fused kernels write it (see kernels.codecs)
            self.param_shard[r.as_slice()].copy_(round_to_dtype(master, self.param_shard.dtype))

    def refresh_(self, r: Range) -> None:
        if self.owns_copy:  # keep the exact master wherever the weight is still its rounding
            m, w = self.master[r.as_slice()], self.param_shard[r.as_slice()]
            m.copy_(torch.where(round_to_dtype(m, w.dtype) == w, m, w.float()))

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        self.master.copy_(tensors["master"])
        if self.owns_copy:
            self.param_shard.copy_(round_to_dtype(cast(Tensor, self.master), self.param_shard.dtype))

    @property
    def master_bytes(self) -> int:
        return self.master.numel() * 4 if self.owns_copy else 0


class RemainderMaster(MasterWeights):
    name = "remainder"

    def __init__(self, param_shard: Tensor | ShardView, **kw: Any) -> None:
        super().__init__(param_shard, **kw)
        # The 16-bit remainder of each element as two int8 planes, low and high byte (see
        # kernels.codecs [Note: remainder planes]); 1D, this rank's shard.
        self.rem_lo: Tensor = self.empty(param_shard.numel(), torch.int8).zero_()
        self.rem_hi: Tensor = self.empty(param_shard.numel(), torch.int8).zero_()
        self.load_state_tensors({"master": param_shard.float()})

    @property
    def remainder(self) -> Tensor:
        """The remainders as one int16 tensor (a copy)."""
        return codecs.join_remainder((self.rem_lo, self.rem_hi)).to(torch.int16)

    def _codec(self) -> tuple:
        if self.param_shard.dtype == torch.bfloat16:
            return codecs.encode_bf16, codecs.decode_bf16
        return codecs.encode_fp16, codecs.decode_fp16

    def update_(self, r: Range, grad: Tensor, exp_avg: Moment, exp_avg_sq: Moment, s: Scalars, step: int,
                vmax: Tensor | None = None) -> None:
        sl = r.as_slice()
        planes = (self.rem_lo[sl], self.rem_hi[sl])
        self.kernels.step_remainder(self.param_shard[sl], planes, grad, exp_avg, exp_avg_sq, s,
                                    self._moment_key(r, step, exp_avg), **_max_arg(vmax))

    def fp32(self) -> Tensor:
        return self._codec()[1](whole(self.param_shard), codecs.join_remainder((self.rem_lo, self.rem_hi)))

    def read_fp32(self, r: Range) -> Tensor:
        sl = r.as_slice()
        return self._codec()[1](self.param_shard[sl], codecs.join_remainder((self.rem_lo[sl], self.rem_hi[sl])))

    def write_fp32_(self, r: Range, values: Tensor, step: int) -> None:
        sl = r.as_slice()
        hi, lo = self._codec()[0](values.contiguous())
        self.param_shard[sl].copy_(hi)
        codecs.split_remainder_((self.rem_lo[sl], self.rem_hi[sl]), lo.to(torch.int32))

    def refresh_(self, r: Range) -> None:
        # [Note: remainder under a written weight] The old weight is gone, so keep a remainder only
        # where it still decodes, with the new weight, to a master that encodes back to that weight:
        # weights written with their own values (a resume that loads the optimizer first) keep the
        # exact master; other written weights get a master that rounds to them, within half a ulp.
        sl = r.as_slice()
        encode, decode = self._codec()
        w, planes = self.param_shard[sl], (self.rem_lo[sl], self.rem_hi[sl])
        lo = codecs.join_remainder(planes)
        m = decode(w, lo)
        hi, lo2 = encode(m)
        codecs.split_remainder_(planes, torch.where(torch.isfinite(m) & (hi == w) & (lo2.to(torch.int32) == lo), lo,
                                                       torch.zeros_like(lo)))

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        hi, lo = self._codec()[0](tensors["master"].float().contiguous())
        self.param_shard.copy_(hi)
        codecs.split_remainder_((self.rem_lo, self.rem_hi), lo.to(torch.int32))

    @property
    def extra_bytes(self) -> int:
        return self.rem_lo.numel() + self.rem_hi.numel()


class StochasticMaster(MasterWeights):
    name = "stochastic"

    def update_(self, r: Range, grad: Tensor, exp_avg: Moment, exp_avg_sq: Moment, s: Scalars, step: int,
                vmax: Tensor | None = None) -> None:
        self.kernels.step_stochastic(self.param_shard[r.as_slice()], grad, exp_avg, exp_avg_sq, s, self._key(r, step),
                                     **_max_arg(vmax))

    def write_fp32_(self, r: Range, values: Tensor, step: int) -> None:
        bits = codecs.random_bits16(self._key(r, step), values.numel())  # keyed by global offset: any world size
        self.param_shard[r.as_slice()].copy_(codecs.stochastic_round(values.contiguous(), self.param_shard.dtype, bits))


class NoMaster(MasterWeights):
    name = "none"

    def update_(self, r: Range, grad: Tensor, exp_avg: Moment, exp_avg_sq: Moment, s: Scalars, step: int,
                vmax: Tensor | None = None) -> None:
        self.kernels.step_none(self.param_shard[r.as_slice()], grad, exp_avg, exp_avg_sq, s,
                               self._moment_key(r, step, exp_avg), **_max_arg(vmax))


def _max_arg(vmax: Tensor | None) -> dict[str, Tensor]:
    """The kernels' ``vmax`` keyword only with amsgrad, so that a step without it calls (and
    compiles) the kernel it always did."""
    return {} if vmax is None else {"vmax": vmax}


STRATEGIES: dict[str, type[MasterWeights]] = {
    "fp32": FP32Master, "remainder": RemainderMaster, "stochastic": StochasticMaster, "none": NoMaster,
}
if tuple(STRATEGIES) != MASTER_MODES:  # checked at import, also under python -O
    raise AssertionError(f"one master-weight strategy per mode core._config accepts: {tuple(STRATEGIES)} against "
                         f"{MASTER_MODES}")


def make_master(name: str, param_shard: Tensor | ShardView, **kw: Any) -> MasterWeights:
    """The strategy called ``name`` over ``param_shard`` (``fp32`` for fp32 parameters, with a warning
    when another mode was asked for)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown master_weights={name!r}; choose one of {sorted(STRATEGIES)}")
    if param_shard.dtype == torch.float32 and name != "fp32":
        warnings.warn(f"master_weights={name!r} applies to 16-bit parameters; fp32 parameters are their own "
                      "master and are updated exactly", UserWarning, stacklevel=3)
        name = "fp32"
    return STRATEGIES[name](param_shard, **kw)
