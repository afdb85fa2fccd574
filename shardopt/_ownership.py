"""Which ShardedAdamW trains a parameter.

[Note: one optimizer per parameter] A ShardedAdamW hooks every parameter it trains (its reducer
takes each gradient as autograd produces it, stage 2 leaving a placeholder in ``p.grad``). A
second optimizer built over the same parameters, as frameworks do on every ``fit`` or after a
learning-rate finder, must not find the first one still taking the gradients: building it takes
the parameters over, and the first is released (hooks removed, its last gathers waited for) and
refuses further steps. The registry holds weak references only, and nothing is stored on the
parameters themselves, so models still pickle and deep-copy.
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable

from torch import Tensor

# id(parameter) -> (weak parameter, weak optimizer); keyed by id because tensors compare elementwise.
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def take_over(opt: Any, params: Iterable[Tensor]) -> None:
    """Make ``opt`` the optimizer of ``params``, releasing any other ShardedAdamW that trained
    one of them. Local (every rank builds its optimizers the same way)."""
    previous: dict[int, Any] = {}
    for key in [k for k, (p, o) in _OWNERS.items() if p() is None or o() is None]:
        del _OWNERS[key]  # parameters or optimizers gone
    for p in params:
        entry = _OWNERS.get(id(p))
        old = entry[1]() if entry is not None and entry[0]() is p else None
        if old is not None and old is not opt:
            previous[id(old)] = old
        _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(opt))
    for old in previous.values():
        old._release("superseded: a newer ShardedAdamW was built over the same parameters and trains them now")
