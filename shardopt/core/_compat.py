"""The torch internals shardopt relies on, each in one place with what happens where it is missing.

Tested on torch 2.9 and 2.13 (what CI runs; ``setup.cfg``). Each function names the internal it
wraps and its fallback; ``tests/test_compat.py`` removes each internal on the pinned torch and
checks the fallback. Inductor's code generator is patched in ``kernels/_cpu_codegen`` (checked
there, and by the kernels' self-check); docs/design.md ("Torch internals") lists every one.
"""
from __future__ import annotations

import datetime
from typing import Any, Callable, Iterable

import operator

import torch

TESTED = "2.9 to 2.13"  # the torch releases CI tests these internals on (the floor and the pin)


def will_execute_each(nodes: Iterable[object]) -> list[bool]:
    """Whether the running backward pass will reach each of autograd ``nodes`` (parameters'
    gradient accumulators), in one pass: ``torch._C._will_engine_execute_node``. Where it is
    missing every parameter counts as reached: a bucket with a parameter the pass skips then waits
    for the end-of-backward flush instead of being reduced as soon as the rest arrived. Same
    results, less overlap."""
    fn = getattr(torch._C, "_will_engine_execute_node", None)
    return [True for _ in nodes] if fn is None else list(map(bool, map(fn, nodes)))


def graph_task_id() -> int:
    """The id of the backward pass running now: ``torch._C._current_graph_task_id``. It tells a new
    backward pass (a new round) from a pass nested in it; there is no fallback, see :func:`require`."""
    return torch._C._current_graph_task_id()


def queue_at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass ends (as DDP does):
    ``Variable._execution_engine.queue_callback``; no fallback, see :func:`require`."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


version = operator.attrgetter("_version")  # a tensor's version counter, moved by every in-place write; see require()
# Where one of these is missing the name is None and require() raises at construction.
make_wrapper_subclass: Any = getattr(torch.Tensor, "_make_wrapper_subclass", None)  # a tensor without storage (the placeholder)
disabled_torch_function: Any = getattr(torch._C, "_disabled_torch_function_impl", None)  # it handles __torch_dispatch__ only


def compiled_inner(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) wraps, ``_orig_mod``; None for any
    other module. No fallback: :func:`require` checks the wrapper still sets it."""
    return getattr(module, "_orig_mod", None)


def _wrapper_sets_orig_mod() -> bool:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return False
    return "_orig_mod" in OptimizedModule.__init__.__code__.co_names


# This thread's stack of torch function modes, as torch.utils._device.DeviceContext reaches it to keep
# itself at the bottom: its length, one mode by position, a pop and a push. See function_modes_missing().
_MODE_STACK = ("_len_torch_function_stack", "_get_function_stack_at", "_pop_torch_function_stack",
               "_push_on_torch_function_stack")


def function_modes_missing() -> list[str]:
    """The torch internals of :func:`insert_function_mode`/:func:`remove_function_mode` that this
    torch lacks (empty on the tested versions); no fallback: ``overlap_param_gather=True`` is
    refused where one is missing (group._gather_wait)."""
    return [f"torch._C.{name}" for name in _MODE_STACK if not hasattr(torch._C, name)]


def insert_function_mode(mode: Any) -> None:
    """Put ``mode`` at the bottom of this thread's torch function mode stack, so that every mode
    there leaves with its own ``__exit__`` (a mode's ``__exit__``, and ``with torch.device(...)``'s,
    pops the top one). Above the mode of ``torch.set_default_device`` alone, which must be at the
    bottom when it leaves: torch keeps it in ``torch._GLOBAL_DEVICE_CONTEXT.device_context``;
    where that is missing, a ``DeviceContext`` at the bottom counts as it."""
    kept = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())][::-1]
    if kept and _is_default_device_mode(kept[0]):
        kept.insert(1, mode)
    else:
        kept.insert(0, mode)
    for m in kept:
        torch._C._push_on_torch_function_stack(m)


def _is_default_device_mode(m: Any) -> bool:
    from torch.utils._device import DeviceContext

    if not isinstance(m, DeviceContext):
        return False
    tls = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)
    return tls is None or getattr(tls, "device_context", None) is m


def remove_function_mode(mode: Any) -> bool:
    """Take ``mode`` out of this thread's torch function mode stack wherever it is, the others kept
    in their order; False if it is not there (also while its own ``__torch_function__`` runs, when
    torch holds it off the stack)."""
    n = torch._C._len_torch_function_stack()
    if not any(torch._C._get_function_stack_at(i) is mode for i in range(n)):
        return False
    above = []
    while (top := torch._C._pop_torch_function_stack()) is not mode:
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)
    return True


def mesh_flattener(mesh: Any) -> Callable[[], Any] | None:
    """``DeviceMesh._flatten`` of ``mesh`` (a sub-mesh of a larger one, flattened to one dimension
    whose group holds all its ranks), or None where torch lacks it: ``_collectives`` then builds
    that group with ``all_gather_object`` and ``new_group``."""
    return getattr(mesh, "_flatten", None)


def require(overlap_param_gather: bool = False) -> None:
    """At construction, on every rank: the internals without a fallback exist in this torch, else
    a clear error naming the torch versions shardopt is tested with; with ``overlap_param_gather``
    also the mode-stack functions its read guard needs (:func:`function_modes_missing`). Local."""
    missing_modes = function_modes_missing() if overlap_param_gather else []
    if missing_modes:
        raise RuntimeError(f"overlap_param_gather=True needs {', '.join(missing_modes)}, which torch "
                           f"{torch.__version__} does not have: every read of a weight right after step() waits for its "
                           "gather through a torch function mode placed beneath the others on that stack (see "
                           f"group._gather_wait); leave overlap_param_gather off, or install torch {TESTED}")
    missing = [name for name, ok in (
        ("torch._C._current_graph_task_id", hasattr(torch._C, "_current_graph_task_id")),
        ("torch.autograd.Variable._execution_engine.queue_callback",
         hasattr(getattr(torch.autograd.Variable, "_execution_engine", None), "queue_callback")),
        # the stage-2 gradient placeholder (see _grad_placeholder); its class is built at import
        ("torch.Tensor._make_wrapper_subclass", callable(getattr(torch.Tensor, "_make_wrapper_subclass", None))),
        ("torch._C._disabled_torch_function_impl", hasattr(torch._C, "_disabled_torch_function_impl")),
        # a parameter's version counter: writes to parameters from outside the optimizer (see _binding)
        ("Tensor._version", isinstance(getattr(torch.empty(0), "_version", None), int)),
        # torch.compile's module wrapper: the DDP check and the gather wait look inside it
        ("torch._dynamo.eval_frame.OptimizedModule._orig_mod", _wrapper_sets_orig_mod()),
    ) if not ok]
    if missing:
        raise RuntimeError(f"shardopt needs {', '.join(missing)}, which torch {torch.__version__} does not have; "
                           f"install torch {TESTED} (the versions shardopt is tested with, see setup.cfg)")


def group_timeout(group: Any) -> datetime.timedelta:
    """The timeout ``group`` was made with, for shardopt's control group over the same ranks: its
    backend's ``options._timeout`` (gloo's or NCCL's). Where that is missing, torch's documented
    default of 30 minutes: the control group's messages then wait that long before torch gives up."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return datetime.timedelta(minutes=30)


def default_store() -> Any:
    """The default group's store, from which shardopt makes its control group under a prefix of its
    own: ``torch.distributed.distributed_c10d._get_default_store``. Where it is missing (None),
    the control group comes from ``new_group(use_local_synchronization=True)``, which names a
    group by how many groups each rank holds: ranks of one optimizer that belong to different
    numbers of other groups (subgroups made on some ranks only) would then wait for each other."""
    import torch.distributed.distributed_c10d as c10d

    get = getattr(c10d, "_get_default_store", None)
    return None if get is None else get()
