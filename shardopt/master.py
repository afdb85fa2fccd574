"""Master-weight strategies: how this rank keeps the high-precision weights of its shard.

Each strategy wraps this rank's shard of a flat parameter buffer (``param_shard``, a 1-D view
of the model's weights) and offers one interface: ``update_`` runs AdamW on a local range and
writes the new weights into ``param_shard``; ``state_tensors`` lists what a checkpoint keeps.

``fp32``: an fp32 copy of the shard (for fp32 parameters the shard itself is the master, no copy).
``none``: no master; fp32 is recomputed from the 16-bit weights and rounded back every step
(fairseq's memory-efficient optimizer). Updates below half an ulp of a weight are lost: offered
for comparison only.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from shardopt._layout import Range
from shardopt.kernels import adamw_update_, round_to_dtype

UpdateFn = Callable[..., None]


class MasterWeights:
    """Base: the interface every strategy implements."""

    name = ""

    def __init__(self, param_shard: Tensor, update_fn: UpdateFn = adamw_update_) -> None:
        self.param_shard = param_shard  # 1D, param dtype, view of the flat param buffer (this rank's shard)
        self.update_fn = update_fn

    def update_(self, r: Range, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, **hp: float) -> None:
        """AdamW over local range ``r`` (``grad``/moments are already sliced to ``r``)."""
        raise NotImplementedError

    def fp32(self) -> Tensor:
        """The master weights of the whole shard as fp32 (a view when one is held, else a copy)."""
        raise NotImplementedError

    def state_tensors(self) -> dict[str, Tensor]:
        """Tensors a checkpoint must keep to resume exactly (1-D, shard length)."""
        return {"master": self.fp32()}

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        """Restore from ``state_tensors`` output and write the weights into ``param_shard``."""
        raise NotImplementedError

    @property
    def master_bytes(self) -> int:
        return 0

    @property
    def extra_bytes(self) -> int:
        return 0


class FP32Master(MasterWeights):
    name = "fp32"

    def __init__(self, param_shard: Tensor, update_fn: UpdateFn = adamw_update_) -> None:
        super().__init__(param_shard, update_fn)
        self.owns_copy = param_shard.dtype != torch.float32
        # 1D fp32: this rank's master shard; aliases param_shard for fp32 parameters.
        self.master = param_shard.float().clone() if self.owns_copy else param_shard

    def update_(self, r: Range, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, **hp: float) -> None:
        out = self.param_shard[r.as_slice()] if self.owns_copy else None
        self.update_fn(self.master[r.as_slice()], grad, exp_avg, exp_avg_sq, param_out=out, **hp)

    def fp32(self) -> Tensor:
        return self.master

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        self.master.copy_(tensors["master"])
        if self.owns_copy:
            self.param_shard.copy_(round_to_dtype(self.master, self.param_shard.dtype))

    @property
    def master_bytes(self) -> int:
        return self.master.numel() * 4 if self.owns_copy else 0


class NoMaster(MasterWeights):
    name = "none"

    def update_(self, r: Range, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, **hp: float) -> None:
        out = self.param_shard[r.as_slice()]
        work = out.float()  # recomputed fp32 "master", rounded back below: small updates are lost
        self.update_fn(work, grad, exp_avg, exp_avg_sq, param_out=out if out.dtype != torch.float32 else None, **hp)
        if out.dtype == torch.float32:
            out.copy_(work)

    def fp32(self) -> Tensor:
        return self.param_shard.float()

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        self.param_shard.copy_(round_to_dtype(tensors["master"].float(), self.param_shard.dtype))


STRATEGIES: dict[str, type[MasterWeights]] = {"fp32": FP32Master, "none": NoMaster}


def make_master(name: str, param_shard: Tensor, update_fn: UpdateFn = adamw_update_) -> MasterWeights:
    """The strategy called ``name`` over ``param_shard``."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown master_weights={name!r}; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[name](param_shard, update_fn)
