"""Validated, frozen settings of a ``ShardedAdamW``, the validation of its param groups, and which
of their parameters it shards (and how messages name them)."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

MASTER_MODES = ("fp32", "remainder", "stochastic", "none")  # master_weights=: one strategy each in update._master
MOMENT_FORMATS = ("fp32", "bf16", "8bit")  # moments=: one strategy each in update._moments
OFFLOAD_TARGETS = (None, "cpu")  # offload=: one placement each in update._offload


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    stage: int = 2
    master_weights: str = "fp32"
    moments: str = "fp32"  # how exp_avg and exp_avg_sq are stored (see shardopt.update._moments)
    bucket_cap_mb: float = 25.0
    alignment: int = 8
    accumulate_dtype: torch.dtype | None = None  # torch.dtype of the no_sync gradient sum for 16-bit params
    seed: int = 0  # stochastic rounding: random bits depend on (seed, step, element offset) only
    reduce_dtype: torch.dtype | None = None  # torch.dtype gradients are averaged in; None: the gradient dtype
    overlap_param_gather: bool = False
    timeout: float | None = None  # seconds a collective may take before every waiting rank raises
    max_consecutive_skips: int | None = 3  # inf/NaN steps in a row, with no dynamic loss scale, that raise
    offload: str | None = None  # where this rank's master weights, moments and gradient copy live (see update._offload)
    offload_fraction: float = 1.0  # the share of each rank's buckets offloaded (see update._split)

    def __post_init__(self) -> None:
        if self.stage not in (1, 2) or isinstance(self.stage, bool):
            raise ValueError(f"stage must be 1 (shard master weights and moments) or 2 (also shard "
                             f"gradients), got stage={self.stage!r}")
        if self.master_weights not in MASTER_MODES:
            raise ValueError(f"unknown master_weights={self.master_weights!r}; choose one of {sorted(MASTER_MODES)}")
        if self.moments not in MOMENT_FORMATS:
            raise ValueError(f"unknown moments={self.moments!r}; choose one of {sorted(MOMENT_FORMATS)}")
        if self.offload not in OFFLOAD_TARGETS or isinstance(self.offload, bool):
            raise ValueError(f"unknown offload={self.offload!r}; choose None (optimizer state on the parameters' "
                             "device) or 'cpu' (master weights, moments and the gradient shard in host memory, "
                             "updated there)")
        if isinstance(self.offload_fraction, bool) or not isinstance(self.offload_fraction, (int, float)) \
                or not 0 < self.offload_fraction <= 1:
            raise ValueError(f"offload_fraction must be a number in (0, 1] (the share of each rank's buckets kept in "
                             f"host memory), got {self.offload_fraction!r}")
        if self.offload_fraction != 1 and self.offload is None:
            raise ValueError(f"offload_fraction={self.offload_fraction!r} applies with offload='cpu'; pass "
                             "offload='cpu' too, or leave offload_fraction out")
        if not (isinstance(self.bucket_cap_mb, (int, float)) and self.bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be a positive number (MiB), got {self.bucket_cap_mb!r}")
        import torch

        if self.accumulate_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"accumulate_dtype must be torch.float32 (default), None (the parameter dtype), "
                             f"torch.bfloat16 or torch.float16; got {self.accumulate_dtype!r}")
        if self.reduce_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"reduce_dtype must be None (the gradient dtype) or a float dtype such as "
                             f"torch.float32; got {self.reduce_dtype!r}")
        if self.timeout is not None and not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"timeout must be None (the process group's own) or a positive number of seconds, "
                             f"got {self.timeout!r}")
        if self.max_consecutive_skips is not None and not (
                isinstance(self.max_consecutive_skips, int) and not isinstance(self.max_consecutive_skips, bool)
                and self.max_consecutive_skips >= 1):
            raise ValueError(f"max_consecutive_skips must be None (never raise) or an int >= 1 (steps), got "
                             f"{self.max_consecutive_skips!r}")
        if not (isinstance(self.alignment, int) and self.alignment >= 1):
            raise ValueError(f"alignment must be a positive int (elements), got {self.alignment!r}")

    def bucket_numel(self, element_size: int) -> int | None:
        """Bucket cap in elements of ``element_size`` bytes; None when it exceeds any real model."""
        n = self.bucket_cap_mb * 2**20 / element_size
        return None if math.isinf(n) else max(1, int(n))


# torch.optim.AdamW's flags and their defaults; every param group holds them, as torch's do. amsgrad
# and maximize change the update (both implemented); foreach and fused choose torch's implementation
# and are accepted and ignored (the update is always one fused pass, bit for bit torch's single-tensor
# step); differentiable=True is refused; capturable=True is refused off CUDA (see ShardedAdamW._check_params);
# decoupled_weight_decay=False (Adam's L2 penalty) is refused: ShardedAdamW is AdamW.
ADAMW_FLAGS: dict[str, Any] = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                               "differentiable": False, "fused": None, "decoupled_weight_decay": True}


def _check_flags(hp: dict[str, Any], index: int, who: str) -> None:
    """Raise ValueError for a torch.optim.AdamW flag optimizer ``who`` (its class name) cannot honour
    in param group ``index`` (with its defaults filled in). Local."""
    for key in ("amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay"):
        if key in hp and not isinstance(hp[key], bool):
            raise ValueError(f"param group {index} sets {key}={hp[key]!r}: pass True or False")
    for key in ("foreach", "fused"):
        if hp.get(key) is not None and not isinstance(hp[key], bool):
            raise ValueError(f"param group {index} sets {key}={hp[key]!r}: pass None, True or False")
    if hp.get("differentiable"):
        raise ValueError(f"differentiable=True (param group {index}): {who}'s step cannot be differentiated "
                         "through (it updates sharded state in place and exchanges it between ranks); use "
                         "torch.optim.AdamW(differentiable=True) for gradients through the optimizer step, or leave "
                         "differentiable out")
    if hp.get("decoupled_weight_decay") is False:
        raise ValueError(f"param group {index} sets decoupled_weight_decay=False, which {who} does not "
                         "implement (its AdamW update decouples the weight decay); remove the key from the group")


def check_param_group(param_group: object, index: int, defaults: dict[str, Any],
                      who: str = "ShardedAdamW") -> dict[str, Any]:
    """A copy of param group ``index`` whose ``params`` is a list (a generator is consumed once);
    raises TypeError/ValueError naming what optimizer ``who`` (its class name) cannot take."""
    from torch import Tensor

    if not isinstance(param_group, dict):
        raise TypeError(f"a param group must be a dict, got {type(param_group).__name__}")
    group = dict(param_group)
    params = group.get("params")
    if isinstance(params, Tensor):
        params = [params]
    elif isinstance(params, (set, frozenset)):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of "
                        "tensors in sets will change between runs. Please use a list instead.")
    elif params is not None:
        params = list(params)
    group["params"] = params
    if params is not None and len({id(_tensor(p)) for p in params}) != len(params):
        _drop_duplicates(group, index, who)
    hp = {**defaults, **group}
    _check_flags(hp, index, who)
    check_hyperparameters(hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"])
    for p in params or []:
        if isinstance(p, Tensor) and not p.is_leaf:
            raise ValueError(f"a non-leaf tensor of shape {tuple(p.shape)} (grad_fn={type(p.grad_fn).__name__}) "
                             "was passed as a parameter; pass the model's nn.Parameters, not results of ops on them")
    return group


def _drop_duplicates(group: dict[str, Any], index: int, who: str) -> None:
    """Keep the first occurrence of each parameter listed more than once in ``group`` (a tied
    weight collected twice), with torch's warning; torch.optim.AdamW would update it once per
    occurrence, a behaviour torch has deprecated."""
    keep, seen = [], set()
    for j, p in enumerate(group["params"]):
        if id(_tensor(p)) not in seen:
            seen.add(id(_tensor(p)))
            keep.append(j)
    names = group.get("param_names")
    params = group["params"]
    dropped = [repr(params[j][0]) if isinstance(params[j], tuple) else repr(names[j]) if names else f"#{j}"
               for j in range(len(params)) if j not in set(keep)]
    warnings.warn(f"optimizer contains a parameter group with duplicate parameters (param group {index}: "
                  f"repeated entries {', '.join(dropped)}); {who} keeps the first occurrence and updates "
                  "each parameter once per step (a torch.optim optimizer would update it once per occurrence, which "
                  "torch has deprecated); pass each parameter once, e.g. list(dict.fromkeys(params))", UserWarning,
                  stacklevel=5)
    group["params"] = [group["params"][j] for j in keep]
    if names:
        group["param_names"] = [names[j] for j in keep]


def _tensor(p: object) -> object:
    """The tensor of a ``params`` entry: a tensor, or a (name, tensor) pair of named_parameters()."""
    return p[1] if isinstance(p, tuple) and len(p) == 2 else p


def check_lr(lr: object) -> None:
    """Raise ValueError for a learning rate given as a tensor of more than one element (torch.optim
    takes a 1-element tensor, see kernels.reference [Note: a tensor learning rate])."""
    import torch

    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"lr as a tensor must hold one element, as torch.optim takes it (e.g. torch.tensor(1e-3)); "
                         f"got a tensor of shape {tuple(lr.shape)}")


def check_hyperparameters(lr: object, betas: object, eps: object, weight_decay: object) -> None:
    """Raise ValueError naming the first invalid AdamW hyperparameter."""
    check_lr(lr)
    if isinstance(betas, (tuple, list)) and any(isinstance(b, torch.Tensor) for b in betas):
        raise ValueError(f"betas as tensors are not supported (betas={tuple(betas)!r}): shardopt's AdamW update "
                         "computes its per-step factors from float betas; pass floats, e.g. betas=(0.9, 0.95)")
    if not (_is_number(lr) and float(lr) >= 0):
        raise ValueError(f"invalid learning rate lr={lr!r}: need a number >= 0")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_is_number(b) for b in betas)):
        raise ValueError(f"invalid betas={betas!r}: need a pair of numbers in [0, 1)")
    for i, b in enumerate(betas):
        if not 0.0 <= float(b) < 1.0:
            raise ValueError(f"invalid beta parameter at index {i}: betas={tuple(betas)!r}, each must be in [0, 1)")
    if not (_is_number(eps) and float(eps) >= 0):
        raise ValueError(f"invalid epsilon value eps={eps!r}: need a number >= 0")
    if not (_is_number(weight_decay) and float(weight_decay) >= 0):
        raise ValueError(f"invalid weight_decay={weight_decay!r}: need a number >= 0")


def _is_number(x: object) -> TypeGuard[float | torch.Tensor]:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() == 1 and not bool(torch.isnan(x))
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def param_names(param_groups: list[dict[str, Any]]) -> dict[int, str]:
    """How messages name each parameter (by ``id``): its name when named parameters were given,
    else its position in param-group order and its shape."""
    names: dict[int, str] = {}
    k = 0
    for gi, g in enumerate(param_groups):
        given = g.get("param_names")
        for j, p in enumerate(g["params"]):
            names.setdefault(id(p), repr(given[j]) if given else f"#{k} (param group {gi}, shape {tuple(p.shape)})")
            k += 1
    return names


def trainable_params(param_groups: list[dict[str, Any]],
                     who: str = "ShardedAdamW") -> list[tuple[torch.nn.Parameter, int]]:
    """(parameter, param-group index) of every parameter that requires grad; a clear error, naming
    optimizer ``who`` (its class name), for one it cannot shard (non-leaf, meta, unsupported dtype,
    sparse, on several devices). Local."""
    out, devices = [], set()
    for gi, group in enumerate(param_groups):
        for p in group["params"]:
            if not p.is_leaf:
                raise ValueError(f"a non-leaf tensor of shape {tuple(p.shape)} was passed as a parameter "
                                 f"(param group {gi}); pass the model's nn.Parameters, not results of ops on them")
            if not p.requires_grad:
                continue
            if p.device.type == "meta":
                raise ValueError(f"parameter of shape {tuple(p.shape)} is on the meta device (no values yet); "
                                 f"materialise the model before building {who}, e.g. "
                                 "model.to_empty(device=...) followed by its initialisation")
            if p.dtype not in _SUPPORTED_DTYPES:
                raise TypeError(f"parameter of shape {tuple(p.shape)} has dtype {p.dtype}; {who} "
                                f"supports {[str(d) for d in _SUPPORTED_DTYPES]}: convert the model first")
            if p.is_sparse:
                raise TypeError(f"parameter of shape {tuple(p.shape)} is sparse; {who} needs dense parameters")
            devices.add(p.device)
            out.append((p, gi))
    if not out:
        given = [p for group in param_groups for p in group["params"]]
        if not given:
            raise ValueError(f"{who} got an empty parameter list: pass the model's parameters, e.g. "
                             "model.parameters()")
        shapes = ", ".join(f"{tuple(p.shape)} {p.dtype}" for p in given[:4]) + (", ..." if len(given) > 4 else "")
        raise ValueError(f"{who} got {len(given)} parameters ({shapes}) and none with requires_grad=True, "
                         "so it has nothing to train: pass parameters that require gradients (frozen ones may be "
                         "passed too; they are left untouched)")
    if len(devices) > 1:
        raise ValueError(f"parameters are on different devices {sorted(map(str, devices))}; "
                         "move the whole model to one device (e.g. model.to(f'cuda:{local_rank}'))")
    return out
