"""Where overlapped weight gathers are waited for (``overlap_param_gather=True``).

[Note: overlapped gather]
With overlap_param_gather=True, step() returns while the weights are still being all-gathered.
Each module that directly owns some of the optimizer's parameters gets a forward pre-hook of its
own that waits, before the module runs, for the buckets holding those parameters, so the gathers
of later layers overlap the compute of earlier ones (as FSDP2 and Megatron's
overlap_param_gather do). The optimizer is not given the model, so it finds those modules at the
first forward: a global forward pre-hook looks at each module the first time it is called, and
registers the hooks on every module under it that owns such parameters (for the outermost
module, the whole model at once); after that it does nothing for that module. Each such module
also gets a state-dict pre-hook and a load-state-dict pre-hook that wait for every gather, so
``model.state_dict()`` right after ``step()`` (to save weights) returns the updated weights and
``model.load_state_dict()`` is not overwritten by a gather landing after it. The handles are kept
(see core._ownership [Note: hooks of a freed optimizer]) and removed when the optimizer is
released. At interpreter exit the gathers still in flight are waited for, so no collective is
left running when torch tears the process group down.

[Note: reads of a weight outside a forward]
A weight read outside a forward, right after ``step()``, may still be in flight: an EMA or SWA
model averaging the weights (``AveragedModel.update_parameters``), a parent reading a child's
weight, logging, a write through the parameter. As with Megatron's overlap_param_gather and FSDP2,
the weights are current inside a forward, in ``model.state_dict()``/``load_state_dict()``, in
the optimizer's own calls (step, checkpoints) and after ``opt.finish_param_gather()``; any other
read calls ``opt.finish_param_gather()`` first. A write that raced a gather is found at the next
step (see step._usage_checks). Nothing wraps the parameters, so they stay plain
``nn.Parameter``s and no tensor op pays for the overlap.

[Note: compiled models]
Dynamo traces module hooks into the compiled forward. The hooks therefore do their work only when
run eagerly: ``torch.compile(model)`` runs the hooks of its wrapper eagerly, before the compiled
code starts. The global hook found the whole model under it at the first call (before dynamo
traced it) and gave the wrapper a hook that waits for every gather of the model, so the traced
hooks inside find nothing in flight and add no graph break. Where a hook is traced with gathers in
flight (a module compiled in place with ``module.compile()``, whose hooks all run traced), it calls
a function that dynamo does not trace and that waits for them: one graph break, and the weights
are right. Such a module is never seen eagerly, so it has no state-dict hooks: call
``opt.finish_param_gather()`` before its ``state_dict()``.
"""
from __future__ import annotations

import atexit
import weakref
from typing import Any, Callable

import torch

from shardopt.core._compat import compiled_inner
from shardopt.comm._gathers import WeightGathers
from shardopt.core._ownership import owned_hook

_in_flight = False  # some overlapped gather may be in flight (read by the traced hooks: a guard)
_optimizers: weakref.WeakSet = weakref.WeakSet()  # WeightGathers of optimizers with overlap_param_gather=True


def in_flight() -> None:
    """step() issued an overlapped gather. Local."""
    global _in_flight
    _in_flight = True


def landed() -> None:
    """A gather was waited for: whether any is still in flight. Local."""
    global _in_flight
    _in_flight = any(_optimizers)


@torch.compiler.disable
def _finish_all() -> None:
    for gathers in list(_optimizers):
        gathers.finish()
    landed()


class GatherWatch:
    """The hooks of the Notes above for one optimizer's ``gathers`` (held weakly). Local."""

    def __init__(self, gathers: WeightGathers) -> None:
        ref = weakref.ref(gathers)  # no hook may keep the optimizer's state alive
        _optimizers.add(gathers)
        handles: list = []  # every hook of this watch, for remove()
        seen: weakref.WeakSet = weakref.WeakSet()  # modules looked at (with everything under them)

        def hook(module: torch.nn.Module, args: Any) -> None:  # the global one: finds the modules
            if torch.compiler.is_compiling():  # see [Note: compiled models]
                if _in_flight:
                    _finish_all()
                return
            if module in seen:
                return
            o = ref()
            if o is None:
                return
            now = None
            for m in module.modules():
                if m not in seen:
                    seen.add(m)
                    new, forward = _hooks_of(m, o, ref)
                    handles.extend(owned_hook(h, ref) for h in new)
                    now = forward if m is module else now
            if now is not None:  # torch read this call's hooks before the new ones were registered
                now(module, args)

        handles.append(owned_hook(torch.nn.modules.module.register_module_forward_pre_hook(hook), ref))
        self._handles = handles
        atexit.register(_finish_at_exit, ref)

    def remove(self) -> None:
        """Remove every hook of this watch (the optimizer is released). Local."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _hooks_of(m: torch.nn.Module, o: WeightGathers, ref: weakref.ref) -> tuple[list, Callable | None]:
    """Register on ``m`` the hooks it needs: their handles, and its forward pre-hook (None if none)."""
    if compiled_inner(m) is not None:  # torch.compile's wrapper: everything before the compiled code
        if not any(id(p) in o.record_of for p in m.parameters()):
            return [], None
        forward = _finish(ref)
        return [m.register_forward_pre_hook(forward, prepend=True)], forward
    if not any(id(p) in o.record_of for p in m.parameters(recurse=False)):
        return [], None
    forward, finish = _wait_own(ref), _finish(ref)
    return [m.register_forward_pre_hook(forward, prepend=True),  # before the module's other hooks
            m.register_state_dict_pre_hook(lambda module, prefix, keep_vars: finish(module, None)),
            m.register_load_state_dict_pre_hook(lambda module, *args: finish(module, None))], forward


def _module_hook(ref: weakref.ref, work: Callable[[WeightGathers, torch.nn.Module], None]
                 ) -> Callable[[torch.nn.Module, Any], None]:
    """A module hook that runs ``work(gathers, module)`` eagerly while the gathers of ``ref`` are in
    flight, and inside traced code waits for every gather (see [Note: compiled models])."""
    def hook(module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            if _in_flight:
                _finish_all()
            return
        o = ref()
        if o:  # not freed, and something in flight
            work(o, module)
    return hook


def _wait_for_own(o: WeightGathers, module: torch.nn.Module) -> None:
    for p in module.parameters(recurse=False):
        r = o.record_of.get(id(p))
        if r is not None:
            o.wait(r.bucket)


def _wait_own(ref: weakref.ref) -> Callable[[torch.nn.Module, Any], None]:
    return _module_hook(ref, _wait_for_own)


def _finish(ref: weakref.ref) -> Callable[[torch.nn.Module, Any], None]:
    return _module_hook(ref, lambda o, module: o.finish())


def _finish_at_exit(ref: weakref.ref) -> None:
    gathers = ref()
    if gathers:
        gathers.finish()
