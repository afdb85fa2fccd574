"""``ShardedMuon``: torch.optim.Muon for the hidden matrices and AdamW for the rest, in one sharded optimizer.

Every Muon matrix is owned whole by one rank of the shard group (see _muon_packing): stage 2's
reduce-scatter delivers its averaged gradient to that rank only, which runs Newton-Schulz on it
(``kernels.muon_reference``, operation for operation torch's) and updates the fp32 master; the
weights are then all-gathered as for AdamW. Parameters in param groups with ``"use_muon": False``
are updated with AdamW from flat shards, exactly as ``ShardedAdamW`` does.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor

from shardopt.core._config import ADAMW_FLAGS, check_lr, check_param_group
from shardopt.kernels.muon_reference import NS_COEFFICIENTS
from shardopt.update._moments import MUON_MOMENTS
from shardopt.optimizer import ShardedAdamW

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
# A use_muon=False group's keys, when it does not set them: torch.optim.AdamW's defaults.
ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, **ADAMW_FLAGS}
_MUON_ONLY = ("momentum", "nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn")


_MUON_CHECKS = (  # (key, valid, what it needs)
    ("lr", lambda v: float(v) >= 0, "a number >= 0"),
    ("weight_decay", lambda v: float(v) >= 0, "a number >= 0"),
    ("momentum", lambda v: 0 <= float(v) < 1, "a number in [0, 1)"),
    ("eps", lambda v: float(v) >= 0, "a number >= 0"),
    ("ns_steps", lambda v: isinstance(v, int) and 0 < v < 100, "an int in [1, 100)"),
    ("ns_coefficients", lambda v: len(tuple(v)) == 3, "three numbers (a, b, c)"),
    ("adjust_lr_fn", lambda v: v in ADJUST_LR_FNS, f"one of {ADJUST_LR_FNS}"),
)


def check_muon_hyperparameters(group: dict[str, Any], index: int) -> None:
    """Raise a ValueError naming param group ``index``'s first Muon hyperparameter out of range
    (``index`` -1: the constructor's arguments). Local."""
    check_lr(group["lr"])
    for key, valid, need in _MUON_CHECKS:
        if not valid(group[key]):
            raise ValueError(f"invalid Muon hyperparameter in param group {index}: {key}={group[key]!r}, need {need}")


class ShardedMuon(ShardedAdamW):
    """Muon (momentum orthogonalised by Newton-Schulz) for 2-D matrices and AdamW for the rest,
    sharded over data-parallel ranks: ``torch.optim.Muon``'s arguments and defaults, then
    ``ShardedAdamW``'s keyword arguments (``stage``, ``process_group``, ``device_mesh``, ...).

    Param groups without ``"use_muon": False`` are Muon groups and must hold 2-D parameters only;
    a group with ``"use_muon": False`` is updated with AdamW and takes AdamW's keys (``lr``,
    ``betas``, ``eps``, ``weight_decay``; ``torch.optim.AdamW``'s defaults where absent). One step,
    one ``clip_grad_norm_`` (over both rules' gradients) and one loss scale cover both rules.

    Each Muon matrix is owned whole by one rank, which runs torch.optim.Muon's step on the full fp32
    averaged gradient (the result is single-process Muon's, at any world size); the momentum
    buffer is fp32, 4 bytes per owned element; every ``master_weights`` mode applies to the Muon
    matrices as to the AdamW parameters. ``moments="bf16"`` stores both rules' moments in bf16
    (Muon's momentum rounded to nearest after each step, 2 bytes per owned element); ``"8bit"``
    is AdamW's only and raises.
    Checkpoints and state dicts are ``ShardedAdamW``'s, with a Muon parameter's state as
    ``torch.optim.Muon``'s (``momentum_buffer``). Build it on every rank, as ``ShardedAdamW``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        **kwargs: Any,
    ) -> None:
        for key in set(kwargs) & set(ADAMW_FLAGS):
            raise TypeError(f"ShardedMuon() got an unexpected keyword argument {key!r}: torch.optim.Muon takes no such "
                            f"argument; for the AdamW parameters set it in their param group, e.g. "
                            f"{{\"params\": rest, \"use_muon\": False, {key!r}: ...}}")
        if kwargs.get("moments", "fp32") not in MUON_MOMENTS:
            raise ValueError(f"ShardedMuon stores its moments in fp32 or bf16 (moments='fp32' or 'bf16'), got "
                             f"moments={kwargs['moments']!r}")
        self._muon_defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                   ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                                   adjust_lr_fn=adjust_lr_fn)
        check_muon_hyperparameters(self._muon_defaults, -1)
        super().__init__(params, lr=lr, eps=eps, weight_decay=weight_decay, **kwargs)

    def _defaults(self, lr: float, betas: tuple[float, ...], eps: float, weight_decay: float,
                  flags: dict[str, Any]) -> dict[str, Any]:
        return dict(self._muon_defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_built", False):
            raise RuntimeError("ShardedMuon lays out all parameters in flat buffers at construction; "
                               "pass every param group to the constructor instead of add_param_group")
        index = len(self.param_groups)
        if isinstance(param_group, dict) and param_group.get("use_muon", True) is False:
            group = check_param_group({**ADAMW_DEFAULTS, **param_group}, index, ADAMW_DEFAULTS, type(self).__name__)
            group["betas"] = tuple(group["betas"])
        else:
            group = check_param_group(param_group, index, {**self.defaults, "betas": (0.9, 0.999)},
                                      type(self).__name__)
            group.setdefault("use_muon", True)
            check_muon_hyperparameters({**self.defaults, **group}, index)
        torch.optim.Optimizer.add_param_group(self, group)  # fills every default key in
        if group["use_muon"] is False:  # an AdamW group keeps AdamW's keys only
            for key in _MUON_ONLY:
                group.pop(key, None)

    def _rule_of(self, group: dict[str, Any]) -> str:
        return "adamw" if group.get("use_muon", True) is False else "muon"

    def _check_params(self) -> None:
        """Every parameter of a Muon group, frozen ones too (as torch.optim.Muon checks them), is a
        real 2-D matrix. Runs inside the construction's agreement: raises on every rank alike."""
        super()._check_params()
        k = 0  # the position in param-group order, as param_names numbers unnamed parameters
        for gi, g in enumerate(self.param_groups):
            for j, p in enumerate(g["params"]):
                if g.get("use_muon", True) is not False:
                    # named here, not by self._names, whose name of an unnamed one holds its group and shape too
                    label = repr(g["param_names"][j]) if g.get("param_names") else f"#{k}"
                    if p.is_complex():
                        raise TypeError(f"ShardedMuon: {label} (param group {gi}) is complex ({p.dtype}); Muon "
                                        "updates real matrices only, as torch.optim.Muon does: keep it as a real "
                                        "parameter (its real and imaginary parts as two), or leave it out of the "
                                        "optimizer")
                    if p.dim() != 2:
                        raise ValueError(f"ShardedMuon: {label} (param group {gi}) has shape {tuple(p.shape)}; "
                                         "Muon updates 2-D matrices only: put it in a param group "
                                         "with \"use_muon\": False (AdamW)")
                k += 1
