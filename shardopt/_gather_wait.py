"""Where overlapped weight gathers are waited for (``overlap_param_gather=True``).

[Note: overlapped gather]
With overlap_param_gather=True, step() returns while the weights are still being all-gathered.
A global forward pre-hook waits, before any module runs, for the buckets holding that module's
own parameters, so the gathers of later layers overlap the compute of earlier ones. The first
time the hook sees a module that owns such parameters, it also gives it a state-dict pre-hook
that waits for every gather, so ``model.state_dict()`` right after ``step()`` (to save weights)
returns the updated weights. At interpreter exit the gathers still in flight are waited for, so
no collective is left running when torch tears the process group down. Weights read any other
way outside a forward (``p.data``, a parent reading a child's weight directly) need
``opt.finish_param_gather()`` first; ``step()``, ``opt.state_dict()`` and checkpoints call it.
"""
from __future__ import annotations

import atexit
import weakref
from typing import Any, Callable

import torch


def watch_gathers(opt: Any) -> "torch.utils.hooks.RemovableHandle":
    """Install the hooks of the Note above for ``opt`` (held weakly); returns the forward hook's
    handle, which the optimizer removes when it is released. Local."""
    ref = weakref.ref(opt)  # the global hook must not keep the optimizer alive
    seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # modules the hook has looked at

    def hook(module: torch.nn.Module, args: Any) -> None:
        o = ref()
        if o is None:
            return
        if module not in seen:  # once per module
            seen[module] = None
            if any(id(p) in o._bucket_of for p in module.parameters(recurse=False)):
                module.register_state_dict_pre_hook(_finish_before_state_dict(ref))
        if not o._gathers:
            return
        for p in module.parameters(recurse=False):
            key = o._bucket_of.get(id(p))
            if key is not None and key in o._gathers:
                o._gathers.pop(key).wait()
                o._gathered(*key)

    atexit.register(_finish_at_exit, ref)
    return torch.nn.modules.module.register_module_forward_pre_hook(hook)


def _finish_before_state_dict(ref: "weakref.ref") -> Callable[..., None]:
    def hook(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        opt = ref()
        if opt is not None:
            opt.finish_param_gather()
    return hook


def _finish_at_exit(ref: "weakref.ref") -> None:
    opt = ref()
    if opt is not None and opt.__dict__.get("_gathers"):
        opt.finish_param_gather()
