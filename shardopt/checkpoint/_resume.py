"""``resume``: the one place a load sets the optimizer's counters, whichever format it loads
(this rank's state dict, ``torch.optim.AdamW``'s, a healing replica's, a checkpoint)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from shardopt.checkpoint._sharded_optimizer import ShardedOptimizer
    from shardopt.core._records import ParamRecord
    from shardopt.group._flat_group import FlatGroup


def resume(opt: ShardedOptimizer, *, step: int, lag_of: Callable[[FlatGroup, ParamRecord], int],
           skipped_steps: int | None = None, seed: int | None = None,
           loss_scaler: dict[str, Any] | None = None) -> None:
    """Set ``opt``'s counters after the loaded master weights were gathered into the parameters:
    the step count, each parameter's lag (``lag_of(buffer, record)``: steps it was left out of, so
    its own step count is ``step`` minus that), the skipped steps and the loss scaler (None:
    kept), and the stochastic-rounding seed (None: kept; the saved one continues the same random
    stream). The parameters' values are then the loaded ones, not writes from outside. Every rank,
    each with its own shard."""
    inner = opt.internals
    inner.progress.step = int(step)
    for b in inner.buffers:
        for r in b.records:
            r.resume(lag_of(b, r))
    if skipped_steps is not None:
        opt.skipped_steps = int(skipped_steps)
    if loss_scaler is not None:
        inner.scaler.load_state_dict(loss_scaler)
    inner.rounds.resumed(inner.progress.step + opt.skipped_steps)  # what the round tags say from here (see group._rounds)
    if seed is not None and int(seed) != opt.config.seed:
        opt.config = dataclasses.replace(opt.config, seed=int(seed))
    for b in inner.buffers:
        b.master.seed = opt.config.seed
        b.binding.record()  # the loaded master weights are the authority, not what was written before
    opt.state.forget()  # what opt.state handed out before is no longer the state, as in torch
