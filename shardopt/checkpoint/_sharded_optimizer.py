"""What checkpoints and state dicts read of a ``ShardedAdamW``: the type of every ``opt`` in ``checkpoint/``.

``ShardedAdamW`` lives a layer up (``optimizer.py``), which this folder may not import, not even for
the type checker (setup.cfg's contracts count type-only imports), so the optimizer is named by
what is used of it: a ``Protocol``, which ``ShardedAdamW`` (and ``ShardedMuon``) meets by having
these attributes. Nothing here runs.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from shardopt.checkpoint._torch_state import ParamStateView
from shardopt.comm._collectives import Comm
from shardopt.comm._model_parts import ModelParts
from shardopt.core._config import ShardConfig
from shardopt.core._records import ParamRecord
from shardopt.group._rounds import Rounds
from shardopt.step._loss_scale import LossScaler
from shardopt.step._usage_checks import UsageChecks
from shardopt.group._flat_group import FlatGroup


class ShardedOptimizer(Protocol):
    """A ``ShardedAdamW`` as checkpoint code sees it (see the module docstring)."""

    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    config: ShardConfig
    state: ParamStateView
    skipped_steps: int
    _buffers: list[FlatGroup]
    _comm: Comm
    _parts: ModelParts
    _scaler: LossScaler
    _checks: UsageChecks
    _step: int
    _consolidated: dict[str, Any] | None
    _rounds: Rounds
    _state_lock: Any  # threading.RLock: held by step() and by reads of the state from another thread

    def finish_param_gather(self) -> None: ...

    def _notice_join(self) -> None: ...

    def _resume(self, *, step: int, lag_of: Callable[[FlatGroup, ParamRecord], int],
                skipped_steps: int | None = None, seed: int | None = None,
                loss_scaler: dict[str, Any] | None = None) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...
