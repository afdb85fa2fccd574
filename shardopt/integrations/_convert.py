"""Turn freshly built torch optimizers into one sharded optimizer with the same groups.

Frameworks let users return a plain ``torch.optim.AdamW``, or a ``torch.optim.Muon`` with an
AdamW for the parameters Muon does not take, from their configuration hook; this is how such
optimizers become one sharded optimizer before they have taken a step, and how the LR schedulers
built on them (composite ones included) are pointed at it.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Mapping, Sequence, cast

import torch

from shardopt.muon import ShardedMuon
from shardopt.optimizer import ShardedAdamW

_KEPT = ("lr", "betas", "eps", "weight_decay")
_MUON_KEPT = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")
_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


def is_torch_pair_member(opt: object) -> bool:
    """Whether ``opt`` is a plain ``torch.optim.AdamW`` or ``torch.optim.Muon`` (what can be converted)."""
    return type(opt) in (torch.optim.AdamW, torch.optim.Muon)


def _merge_order(opts: Sequence[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """The order the merged optimizer holds their param groups in: the Muon's, then the AdamW's."""
    return sorted(opts, key=lambda o: type(o) is not torch.optim.Muon)


def _check_fresh(opt: torch.optim.Optimizer) -> None:
    if not is_torch_pair_member(opt):
        raise TypeError(f"shardopt can take over a torch.optim.AdamW, or a torch.optim.Muon with an AdamW for the "
                        f"other parameters, got {type(opt).__module__}.{type(opt).__qualname__}; build "
                        "shardopt.ShardedAdamW or ShardedMuon yourself for other optimizers")
    if any(len(s) for s in opt.state.values()):
        raise ValueError(f"this {type(opt).__name__} has already stepped (it has state); convert it before training, "
                         "or save its state_dict and load it into the sharded optimizer with load_state_dict")


def _adamw_groups(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    adamw_only = set(torch.optim.AdamW([torch.zeros(1)]).defaults) - set(_KEPT)
    groups = []
    for i, g in enumerate(opt.param_groups):
        for flag in _FLAGS:
            if g.get(flag):
                raise ValueError(f"param group {i} of the AdamW has {flag}=True, which ShardedAdamW does not implement")
        groups.append({k: v for k, v in g.items() if k not in adamw_only})
    return groups


def from_torch_adamw(opt: torch.optim.Optimizer, **shardopt_kwargs: Any) -> ShardedAdamW:
    """A ShardedAdamW over ``opt``'s param groups with their ``lr``/``betas``/``eps``/``weight_decay``
    (and any extra keys, as schedulers add them). ``opt`` must be a ``torch.optim.AdamW`` (or a
    ShardedAdamW, returned as is) that has not stepped. Every rank, with the same parameters."""
    if isinstance(opt, ShardedAdamW):
        return opt
    if type(opt) is torch.optim.Muon:
        raise TypeError("from_torch_adamw takes a torch.optim.AdamW; a torch.optim.Muon (with its AdamW) goes "
                        "through shardopt.integrations.from_torch([muon, adamw])")
    _check_fresh(opt)
    return ShardedAdamW(_adamw_groups(opt), **{k: opt.defaults[k] for k in _KEPT}, **shardopt_kwargs)


def from_torch(optimizers: Sequence[torch.optim.Optimizer], **shardopt_kwargs: Any) -> ShardedAdamW:
    """One sharded optimizer that trains what ``optimizers`` would: a ``torch.optim.AdamW`` alone
    becomes a ShardedAdamW; a ``torch.optim.Muon``, alone or with one ``torch.optim.AdamW`` for the
    other parameters, becomes a ShardedMuon whose first param groups are the Muon's (with their
    Muon keys) and whose last ones are the AdamW's (``"use_muon": False``, with their AdamW keys).
    None may have stepped. Every rank, with the same parameters."""
    opts = list(optimizers)
    for opt in opts:
        _check_fresh(opt)
    muons = [o for o in opts if type(o) is torch.optim.Muon]
    adamws = [o for o in opts if type(o) is torch.optim.AdamW]
    if len(muons) > 1 or len(adamws) > 1 or not opts:
        raise ValueError(f"shardopt merges one torch.optim.Muon and one torch.optim.AdamW into one optimizer, got "
                         f"{len(muons)} Muon and {len(adamws)} AdamW; put all matrices in one Muon and the rest in one "
                         "AdamW (param groups may differ in their hyperparameters)")
    if not muons:
        return from_torch_adamw(adamws[0], **shardopt_kwargs)
    groups = []
    for o in _merge_order(opts):  # the order replacements() relies on
        if type(o) is torch.optim.Muon:
            groups += [{k: v for k, v in g.items() if k != "use_muon"} for g in o.param_groups]
        else:
            groups += [{**g, "use_muon": False} for g in _adamw_groups(o)]
    return ShardedMuon(groups, **{k: muons[0].defaults[k] for k in _MUON_KEPT}, **shardopt_kwargs)


class GroupView:
    """The param groups of one torch optimizer that was merged into a sharded one, for the LR
    schedulers built on it: they read and write those groups (the same dicts, so the sharded
    optimizer uses the learning rates they set) and see the sharded optimizer's steps."""

    def __init__(self, sharded: ShardedAdamW, param_groups: list[dict[str, Any]]) -> None:
        self.sharded = sharded
        self.param_groups = param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.sharded.defaults

    @property
    def step(self) -> Any:
        return self.sharded.step

    @property
    def _opt_called(self) -> bool:  # what LRScheduler reads to tell whether the optimizer stepped first
        return bool(getattr(self.sharded, "_opt_called", False))

    @_opt_called.setter
    def _opt_called(self, value: bool) -> None:
        self.sharded._opt_called = value  # type: ignore[attr-defined]


Replacement = torch.optim.Optimizer | GroupView  # what a converted torch optimizer's schedulers drive instead


def replacements(optimizers: Sequence[torch.optim.Optimizer], sharded: ShardedAdamW) -> dict[int, Replacement]:
    """What each of ``optimizers`` (all converted into ``sharded`` by ``from_torch``) is replaced by
    for the schedulers built on it: the sharded optimizer itself for a lone optimizer, otherwise a
    ``GroupView`` of its own param groups (the Muon's come first, then the AdamW's)."""
    if len(optimizers) <= 1:
        return {id(o): sharded for o in optimizers}
    out: dict[int, Replacement] = {}
    at = 0
    for o in _merge_order(optimizers):
        n = len(o.param_groups)
        out[id(o)] = GroupView(sharded, sharded.param_groups[at:at + n])
        at += n
    return out


def retarget_scheduler(scheduler: Any, replaced: Mapping[int, Replacement]) -> None:
    """Point ``scheduler`` (and the schedulers a SequentialLR / ChainedScheduler holds) at what
    replaced its optimizer (see ``replacements``). The converted param groups carry the scheduler's
    ``initial_lr`` and current ``lr``, so the schedule continues unchanged."""
    new = replaced.get(id(getattr(scheduler, "optimizer", None)))
    if new is not None:
        scheduler.optimizer = new
        _track_step_called(new.sharded if isinstance(new, GroupView) else new)
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
        target = cast(torch.optim.Optimizer, ref())  # alive while anything steps it
        target._opt_called = True  # type: ignore[attr-defined]  # what torch's LRScheduler reads
        return step(target, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = wrapper  # type: ignore[method-assign]
