"""Where overlapped weight gathers are waited for (``overlap_param_gather=True``).

[Note: overlapped gather]
With overlap_param_gather=True, step() returns while the weights are still being all-gathered.
A global forward pre-hook waits, before any module runs, for the buckets holding that module's
own parameters, so the gathers of later layers overlap the compute of earlier ones. The first
time the hook sees a module that owns such parameters, it also gives it a state-dict pre-hook
that waits for every gather, so ``model.state_dict()`` right after ``step()`` (to save weights)
returns the updated weights. At interpreter exit the gathers still in flight are waited for, so
no collective is left running when torch tears the process group down.

[Note: reads of a weight still in flight]
A weight can be read outside its module's forward: an EMA or SWA model averaging the weights
right after ``step()`` (``AveragedModel.update_parameters``), a parent reading a child's weight,
logging. So while its bucket's gather is in flight, a parameter's class is an in-flight subclass
of its own class whose ``__torch_function__`` first waits for that gather (and turns the
parameter back into its own class), then runs the call as torch would. Reading ``p.grad``,
``p.shape`` and the like does not read the weight and does not wait, so ``model.zero_grad()``
between ``step()`` and the next forward keeps the overlap. The cost falls only on calls that
take such a parameter; every other tensor op is untouched.

[Note: compiled models]
Dynamo traces global module hooks into the compiled forward. The hook therefore does its work
only when run eagerly: ``torch.compile(model)`` runs it eagerly once for the compiled wrapper,
which waits for every gather of the model before the compiled code starts, so the traced hooks
inside find nothing in flight and add no graph break. Where the hook is traced with gathers in
flight (a module compiled in place with ``module.compile()``), it calls a function that dynamo
does not trace and that waits for them: one graph break, and the weights are right.
"""
from __future__ import annotations

import atexit
import weakref
from typing import Any, Callable, Iterable

import torch

from shardopt.core._compat import compiled_inner, disable_torch_function_subclass
from shardopt.comm._gathers import WeightGathers
from shardopt.core._records import BucketRecord
from shardopt.core._ownership import owned_hook

_in_flight = False  # some parameter's gather is in flight (read by the traced hook: a guard)
_landing: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(param) -> (its WeightGathers, its bucket), weakly
_restore: dict[type, type] = {}  # in-flight class -> the parameter's own class
_in_flight_class: dict[type, type] = {}  # the parameter's own class -> its in-flight class
_optimizers: "weakref.WeakSet" = weakref.WeakSet()  # WeightGathers of optimizers with overlap_param_gather=True

# Calls that read no weight values: they never wait (see [Note: reads of a weight still in flight]).
_NO_WAIT = {torch.Tensor.grad.__get__, torch.Tensor.grad.__set__, torch.Tensor.grad.__delete__,
            torch.Tensor.requires_grad.__get__, torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__,
            torch.Tensor.device.__get__, torch.Tensor.is_leaf.__get__, torch.Tensor.grad_fn.__get__,
            torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.data_ptr,
            torch.Tensor.element_size, torch.Tensor.stride, torch.Tensor.is_contiguous}


def _torch_function(cls: type, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    kwargs = kwargs or {}
    if func in _NO_WAIT:
        with disable_torch_function_subclass():
            return func(*args, **kwargs)
    for t in _leaves((args, kwargs)):
        if type(t) in _restore:
            _land(t)
    return func(*args, **kwargs)  # the parameters are of their own class again: torch's own dispatch


def _leaves(x: Any) -> Iterable:
    """The tensors (and other leaves) of a torch call's arguments: lists, tuples and dicts opened."""
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _leaves(y)
    else:
        yield x


def _class_in_flight(cls: type) -> type:
    sub = _in_flight_class.get(cls)
    if sub is None:
        sub = type(f"InFlight{cls.__name__}", (cls,), {"__torch_function__": classmethod(_torch_function),
                                                        "__module__": __name__})
        _in_flight_class[cls], _restore[sub] = sub, cls
    return sub


def _land(p: torch.Tensor) -> None:
    ref, bucket_ref = _landing.get(id(p), (None, None))
    gathers = ref() if ref is not None else None
    bucket = bucket_ref() if bucket_ref is not None else None
    if gathers is None or bucket is None or not gathers.wait(bucket):  # waiting calls landed() for the bucket's parameters
        landed([p])


def in_flight(gathers: WeightGathers, bucket: BucketRecord) -> None:
    """The gather of ``bucket`` (of ``gathers``) was issued. Local."""
    global _in_flight
    ref, bucket_ref = weakref.ref(gathers), weakref.ref(bucket)
    for r in bucket.params:
        p = r.param
        _landing[id(p)] = (ref, bucket_ref)
        p.__class__ = _class_in_flight(type(p))
    _in_flight = True


def landed(params: Iterable[torch.nn.Parameter]) -> None:
    """The gather holding ``params`` was waited for: they are of their own class again. Local."""
    global _in_flight
    for p in params:
        _landing.pop(id(p), None)
        own = _restore.get(type(p))
        if own is not None:
            p.__class__ = own
    _in_flight = bool(_landing)


@torch.compiler.disable
def _finish_all() -> None:
    for gathers in list(_optimizers):
        gathers.finish()


def watch_gathers(gathers: WeightGathers) -> "torch.utils.hooks.RemovableHandle":
    """Install the hooks of the Notes above for one optimizer's ``gathers`` (held weakly); returns
    the forward hook's handle, which the optimizer removes when it is released. Local."""
    ref = weakref.ref(gathers)  # the global hook must not keep the optimizer's state alive
    seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> it holds some of its parameters
    _optimizers.add(gathers)

    def hook(module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():  # see [Note: compiled models]
            if _in_flight:
                _finish_all()
            return
        o = ref()
        if o is None:
            return
        if module not in seen:  # once per module
            seen[module] = any(id(p) in o.record_of for p in module.parameters())
            if any(id(p) in o.record_of for p in module.parameters(recurse=False)):
                module.register_state_dict_pre_hook(_finish_before_state_dict(ref))
        if not o:
            return
        if compiled_inner(module) is not None:  # torch.compile's wrapper: everything before the compiled code
            if seen[module]:
                o.finish()
            return
        for p in module.parameters(recurse=False):
            r = o.record_of.get(id(p))
            if r is not None:
                o.wait(r.bucket)

    atexit.register(_finish_at_exit, ref)
    return torch.nn.modules.module.register_module_forward_pre_hook(owned_hook(hook, ref))


def _finish_before_state_dict(ref: "weakref.ref") -> Callable[..., None]:
    def hook(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        gathers = ref()
        if gathers is not None:
            gathers.finish()
    return hook


def _finish_at_exit(ref: "weakref.ref") -> None:
    gathers = ref()
    if gathers:
        gathers.finish()
