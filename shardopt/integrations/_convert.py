"""Turn a freshly built ``torch.optim.AdamW`` into a ShardedAdamW with the same groups.

Frameworks let users return a plain AdamW from their configuration hook; this is how such an
optimizer becomes a sharded one before it has taken a step.
"""
from __future__ import annotations

from typing import Any

import torch

from shardopt.optimizer import ShardedAdamW

_KEPT = ("lr", "betas", "eps", "weight_decay")


def from_torch_adamw(opt: torch.optim.Optimizer, **shardopt_kwargs: Any) -> ShardedAdamW:
    """A ShardedAdamW over ``opt``'s param groups with their ``lr``/``betas``/``eps``/``weight_decay``
    (and any extra keys, as schedulers add them). ``opt`` must be a ``torch.optim.AdamW`` (or a
    ShardedAdamW, returned as is) that has not stepped. Every rank, with the same parameters."""
    if isinstance(opt, ShardedAdamW):
        return opt
    if type(opt) is not torch.optim.AdamW:
        raise TypeError(f"shardopt can take over a torch.optim.AdamW, got {type(opt).__module__}."
                        f"{type(opt).__qualname__}; build shardopt.ShardedAdamW yourself for other optimizers")
    if any(len(s) for s in opt.state.values()):
        raise ValueError("this AdamW has already stepped (it has state); convert it before training, or save its "
                         "state_dict and load it into the ShardedAdamW with load_state_dict")
    defaults = {k: opt.defaults[k] for k in _KEPT}
    adamw_only = set(torch.optim.AdamW([torch.zeros(1)]).defaults) - set(_KEPT)
    groups = []
    for i, g in enumerate(opt.param_groups):
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if g.get(flag):
                raise ValueError(f"param group {i} of the AdamW has {flag}=True, which ShardedAdamW does not implement")
        groups.append({k: v for k, v in g.items() if k not in adamw_only})
    return ShardedAdamW(groups, **defaults, **shardopt_kwargs)
