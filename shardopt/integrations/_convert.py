"""Turn a freshly built ``torch.optim.AdamW`` into a ShardedAdamW with the same groups.

Frameworks let users return a plain AdamW from their configuration hook; this is how such an
optimizer becomes a sharded one before it has taken a step, and how the LR schedulers built on
it (composite ones included) are pointed at the sharded one.
"""
from __future__ import annotations

import functools
import weakref
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


def retarget_scheduler(scheduler: Any, replaced: dict[int, ShardedAdamW]) -> None:
    """Point ``scheduler`` (and the schedulers a SequentialLR / ChainedScheduler holds) at the
    ShardedAdamW that replaced its optimizer. The converted param groups carry the scheduler's
    ``initial_lr`` and current ``lr``, so the schedule continues unchanged."""
    new = replaced.get(id(getattr(scheduler, "optimizer", None)))
    if new is not None:
        scheduler.optimizer = new
        _track_step_called(new)
    for inner in getattr(scheduler, "_schedulers", ()):
        retarget_scheduler(inner, replaced)


def _track_step_called(opt: torch.optim.Optimizer) -> None:
    """What ``LRScheduler.__init__`` does to its optimizer so that its first ``step`` can tell
    whether ``optimizer.step()`` ran before it (otherwise it warns that the order is wrong)."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(opt)
    step = type(opt).step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        target._opt_called = True  # type: ignore[union-attr]
        return step(target, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = wrapper  # type: ignore[method-assign]
