"""What every rank must build and call alike, and how a difference is reported.

The construction check gathers one description per rank (an error, or the settings followed by
the parameters); ``raise_first_difference`` turns the first difference into a ValueError that
names it with rank 0's and the other rank's values, raised on every rank alike.
"""
from __future__ import annotations

from typing import Any

import torch

from shardopt.loss_scale import make_scaler

# [Note: ranks in different calls] clip_grad_norm_ and step each start with the same small
# all-reduce, so one rank in clip_grad_norm_ (say, to log the norm on rank 0 only) pairs with
# another rank's step: the norm and the clipping would silently mix the two. Each rank adds its
# call's code and its negative to that all-reduce; unless every rank is in the same call, the
# sum (or max) differs from what this rank expects, and every rank raises.
CALL_CODES = {"clip_grad_norm_": 1.0, "step": 1000.0}


def settings(opt: Any, loss_scale: object, dtypes: set[torch.dtype]) -> dict[str, object]:
    """What must be equal on every rank besides the parameters: the sharding settings, every
    group's hyperparameters and the loss scaler (each shapes the collectives or the math). Local."""
    c = opt.config
    scaler = make_scaler(loss_scale, dtypes)
    return {"stage": c.stage, "master_weights": c.master_weights, "bucket_cap_mb": c.bucket_cap_mb,
            "accumulate_dtype": str(c.accumulate_dtype), "reduce_dtype": str(c.reduce_dtype),
            "overlap_param_gather": c.overlap_param_gather, "seed": c.seed, "timeout": c.timeout,
            "loss_scale": (type(scaler).__name__, scaler.state_dict()),
            **{f"param group {gi} {k}": v for gi, g in enumerate(opt.param_groups)
               for k, v in sorted(g.items()) if k not in ("params", "param_names")}}


def raise_first_difference(every: list[list], rank: int) -> None:
    """Raise, on every rank alike, the first difference between rank 0's description and another
    rank's (``every``: each rank's ``[("settings", items), params..., ("frozen", params)]``, or
    ``[("error", kind, message)]``)."""
    for r, other in enumerate(every):
        if other and other[0][0] == "error":
            kind = TypeError if other[0][1] == "TypeError" else ValueError
            raise kind(other[0][2] if r == rank else f"on rank {r}: {other[0][2]}")
    for r, other in enumerate(every):
        ours, theirs = dict(every[0][0][1]), dict(other[0][1])
        for key in sorted(set(ours) | set(theirs)):
            if ours.get(key) != theirs.get(key):
                raise ValueError(f"ShardedAdamW settings differ across ranks: {key} is {ours.get(key)!r} on rank 0 "
                                 f"but {theirs.get(key)!r} on rank {r}; build the optimizer with the same "
                                 "arguments on every rank")
    every = [other[1:] for other in every]
    ref = every[0]
    for r, other in enumerate(every):
        if other == ref:
            continue
        for kind, mine, theirs in (("trainable", ref[:-1], other[:-1]), ("frozen", ref[-1][1], other[-1][1])):
            for i, (a, b) in enumerate(zip(mine, theirs)):
                if a != b:
                    raise ValueError(
                        f"parameter sets differ across ranks: {kind} parameter #{i} is (group, shape, dtype"
                        f"{', name' if len(a) > 3 else ''})={a} on rank 0 but {b} on rank {r}; build the same model "
                        "and pass the same parameters in the same order, with the same requires_grad, on every rank")
            if len(mine) != len(theirs):
                raise ValueError(f"parameter sets differ across ranks: rank 0 has {len(mine)} {kind} parameters, "
                                 f"rank {r} has {len(theirs)}; build the same model on every rank")
    raise AssertionError("unreachable: descriptions differ but no difference found")
