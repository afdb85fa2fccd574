"""The torch internals the gradient path relies on, each in one place with what happens where it is missing.

Tested on torch 2.12 and 2.13 (what CI runs; ``setup.cfg``). Each function names the internal it
wraps and its fallback; ``tests/test_compat.py`` removes each internal on the pinned torch and
checks the fallback. The other internals shardopt touches are listed in docs/design.md
("Torch internals").
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

TESTED = "2.12 and 2.13"  # the torch releases CI tests these internals on


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


def flat_mesh_group(mesh: Any) -> dist.ProcessGroup:
    """The process group of every rank of ``mesh``, a sub-mesh of a larger device mesh (tensor
    parallelism beside data parallelism): ``DeviceMesh._flatten()``. Where it is missing, each rank
    shares its sub-mesh's ranks (one ``all_gather_object`` over the world) and every rank creates
    a group for each distinct sub-mesh, in the same order (``dist.new_group``). Call on every rank
    of the world."""
    flatten = getattr(mesh, "_flatten", None)
    if flatten is not None:
        return flatten().get_group()
    mine = tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    groups = {ranks: dist.new_group(list(ranks)) for ranks in sorted(set(every))}
    return groups[mine]


def require() -> None:
    """At construction, on every rank: the internals without a fallback exist in this torch, else
    a clear error naming the torch versions shardopt is tested with. Local."""
    missing = [name for name, ok in (
        ("torch._C._current_graph_task_id", hasattr(torch._C, "_current_graph_task_id")),
        ("torch.autograd.Variable._execution_engine.queue_callback",
         hasattr(getattr(torch.autograd.Variable, "_execution_engine", None), "queue_callback")),
        # the stage-2 gradient placeholder (see _grad_placeholder); its class is built at import
        ("torch.Tensor._make_wrapper_subclass", callable(getattr(torch.Tensor, "_make_wrapper_subclass", None))),
        # a parameter's version counter: writes to parameters from outside the optimizer (see _binding)
        ("Tensor._version", isinstance(getattr(torch.empty(0), "_version", None), int)),
    ) if not ok]
    if missing:
        raise RuntimeError(f"shardopt needs {', '.join(missing)}, which torch {torch.__version__} does not have; "
                           f"install torch {TESTED} (the versions shardopt is tested with, see setup.cfg)")
