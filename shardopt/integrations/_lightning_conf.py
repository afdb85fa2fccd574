"""``configure_optimizers``' output with a ``torch.optim.Muon`` + ``torch.optim.AdamW`` pair merged
into one ShardedMuon, for ``ShardedStrategy``: Lightning trains only one optimizer in automatic
optimization, and shardopt trains the pair as one. Knows Lightning's output forms, not Lightning.
"""
from __future__ import annotations

from typing import Any

import torch

from shardopt.integrations._convert import Replacement, from_torch, is_torch_pair_member, replacements, retarget_scheduler


def _split(conf: Any) -> tuple[list, list] | None:
    """(optimizers, LR scheduler configs) of the forms that can hold several optimizers: a list,
    two lists, or one dict per optimizer (its top-level ``monitor`` moved into its scheduler's
    config); None for the others."""
    if not isinstance(conf, (list, tuple)):
        return None
    if len(conf) == 2 and isinstance(conf[0], list):
        return list(conf[0]), list(conf[1])
    if conf and all(isinstance(c, dict) for c in conf):
        scheds = []
        for c in conf:
            sched = c.get("lr_scheduler")
            if sched is not None:
                sched = dict(sched) if isinstance(sched, dict) else {"scheduler": sched}
                scheds.append({**({"monitor": c["monitor"]} if "monitor" in c else {}), **sched})
        return [c["optimizer"] for c in conf], scheds
    return list(conf), []


def merge_torch_pair(conf: Any, views: dict[int, Replacement], **shardopt_options: Any) -> Any:
    """``conf`` with a torch Muon + AdamW pair replaced by one ShardedMuon, in Lightning's two-lists
    form; any other output as it was. Every scheduler points at the ShardedMuon while Lightning
    checks that the returned schedulers belong to returned optimizers; ``views`` gets, by scheduler
    id, what it drives afterwards (its own optimizer's groups). Every rank."""
    split = _split(conf)
    if split is None or not any(type(o) is torch.optim.Muon for o in split[0]):
        return conf
    opts, scheds = split
    others = [f"{type(o).__module__}.{type(o).__qualname__}" for o in opts if not is_torch_pair_member(o)]
    if others:
        raise TypeError(f"configure_optimizers returned a torch.optim.Muon with {others}: ShardedStrategy merges a "
                        "Muon and an AdamW into one ShardedMuon; return those two (or build a ShardedMuon)")
    merged = from_torch(opts, **shardopt_options)
    replaced = replacements(opts, merged)
    for s in scheds:
        scheduler = s["scheduler"] if isinstance(s, dict) else s
        retarget_scheduler(scheduler, replaced)
        views[id(scheduler)] = scheduler.optimizer
        scheduler.optimizer = merged
    return [merged], scheds
