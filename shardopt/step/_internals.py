"""``Internals``: the parts of a ``ShardedAdamW`` that the package's own checkpoint and inspection
code reads (``opt.internals``), named in one place.

The optimizer lives in ``optimizer.py``, above ``checkpoint/`` and ``view.py``, which may not
import it (setup.cfg's layers), so they name it by a ``Protocol`` of what they use. That Protocol
names public members only: ``internals``, this record, instead of the optimizer's private
attributes. ``step/`` is the lowest folder that can name every part's type (the flat groups, the
comm, the model's parts, the rounds, the gathers, the loss scaler, the usage checks).

The optimizer builds each part in its ``__init__`` and keeps it under its own private name (its
methods use those; a half-built optimizer's teardown finds what was built); at the end of the
``__init__`` it puts the same objects here, once. None of them is rebound afterwards, so the
record is frozen and its two names for a part never disagree. What does change is one mutable
object, ``Progress``, which owns the step count: the optimizer and a resume both write it there.
Not a stable API: ``opt.inspect()`` (``shardopt.view``) is the public view.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardopt.comm._collectives import Comm
    from shardopt.comm._model_parts import ModelParts
    from shardopt.group._flat_group import FlatGroup
    from shardopt.group._gather_wait import WeightGathers
    from shardopt.group._held_bytes import HeldTotal
    from shardopt.group._rounds import Rounds
    from shardopt.step._loss_scale import LossScaler
    from shardopt.step._usage_checks import UsageChecks


@dataclasses.dataclass(eq=False)
class Progress:
    """What a step advances and a load sets: the one mutable part of ``Internals``."""

    step: int = 0  # steps taken, skipped ones not counted; a parameter's own count is this minus its lag


@dataclasses.dataclass(frozen=True, eq=False)
class Internals:
    """One ``ShardedAdamW``'s parts, the same objects it holds (see the module docstring). Holds no
    reference to the optimizer itself, so keeping the optimizer alive stays the caller's choice."""

    buffers: list[FlatGroup]  # one flat group per flat buffer, in the optimizer's order
    comm: Comm  # the data-parallel ranks: collectives, the control group, a call's entry
    parts: ModelParts  # which ranks hold which part of the model (tensor, pipeline, expert parallelism)
    scaler: LossScaler  # the loss scale
    checks: UsageChecks  # what the step checks of how the optimizer was used, and the gradient scale
    rounds: Rounds  # the rounds of gradient reductions over every flat group, and the Join notice
    gathers: WeightGathers  # the weight all-gathers still in flight
    held: HeldTotal  # gradient and buffer bytes held, over every flat group
    state_lock: Any  # threading.RLock: held by step() and by reads of the state from another thread
    progress: Progress  # the step count
