"""The torch internals the gradient path relies on, each in one place with what happens where it is missing.

Tested on torch 2.13 (the version CI runs; ``setup.cfg``). Each function names the internal it
wraps and its fallback; ``tests/test_compat.py`` removes each internal on the pinned torch and
checks the fallback. The other internals shardopt touches are listed in docs/design.md
("Torch internals").
"""
from __future__ import annotations

import torch

TESTED = "2.13"  # the torch release these internals were tested on


def will_execute(node: object) -> bool:
    """Whether the running backward pass will reach autograd ``node`` (a parameter's gradient
    accumulator): ``torch._C._will_engine_execute_node``. Where it is missing every parameter
    counts as reached: a bucket with a parameter the pass skips then waits for the end-of-backward
    flush instead of being reduced as soon as the rest arrived. Same results, less overlap."""
    fn = getattr(torch._C, "_will_engine_execute_node", None)
    return True if fn is None else bool(fn(node))


def graph_task_id() -> int:
    """The id of the backward pass running now: ``torch._C._current_graph_task_id``. It tells a new
    backward pass (a new round) from a pass nested in it; there is no fallback, see :func:`require`."""
    return torch._C._current_graph_task_id()


def queue_at_end_of_backward(callback: object) -> None:
    """Run ``callback`` when the running backward pass ends (as DDP does):
    ``Variable._execution_engine.queue_callback``; no fallback, see :func:`require`."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def require() -> None:
    """At construction, on every rank: the internals without a fallback exist in this torch, else
    a clear error naming the torch version shardopt was tested with. Local."""
    missing = [name for name, ok in (
        ("torch._C._current_graph_task_id", hasattr(torch._C, "_current_graph_task_id")),
        ("torch.autograd.Variable._execution_engine.queue_callback",
         hasattr(getattr(torch.autograd.Variable, "_execution_engine", None), "queue_callback")),
    ) if not ok]
    if missing:
        raise RuntimeError(f"shardopt needs {', '.join(missing)}, which torch {torch.__version__} does not have; "
                           f"install torch {TESTED} (the version shardopt is tested with, see setup.cfg)")
