"""What checkpoints and state dicts read of a ``ShardedAdamW``: the type of every ``opt`` in ``checkpoint/``.

``ShardedAdamW`` lives a layer up (``optimizer.py``), which this folder may not import, not even for
the type checker (setup.cfg's contracts count type-only imports), so the optimizer is named by
what is used of it: a ``Protocol``, which ``ShardedAdamW`` (and ``ShardedMuon``) meets by having
these attributes. Its public ones only: the parts of the optimizer that are no part of torch's
API (the flat groups, the comm, the step count, ...) are read through ``internals``
(``step._internals.Internals``). Nothing here runs.
"""
from __future__ import annotations

from typing import Any, Protocol

from shardopt.checkpoint._torch_state import ParamStateView
from shardopt.core._config import ShardConfig
from shardopt.step._internals import Internals


class ShardedOptimizer(Protocol):
    """A ``ShardedAdamW`` as checkpoint code sees it (see the module docstring)."""

    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    config: ShardConfig
    state: ParamStateView
    skipped_steps: int
    internals: Internals

    def finish_param_gather(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...
