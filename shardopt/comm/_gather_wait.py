"""Where overlapped weight gathers are waited for (``overlap_param_gather=True``).

[Note: overlapped gather]
With overlap_param_gather=True, step() returns while the weights are still being all-gathered.
Each module that directly owns some of the optimizer's parameters gets a forward pre-hook of its
own that waits, before the module runs, for the buckets holding those parameters, so the gathers
of later layers overlap the compute of earlier ones (as FSDP2 and Megatron's
overlap_param_gather do). The optimizer is not given the model, so it finds those modules at the
first forward: a global forward pre-hook looks at each module the first time it is called, and
registers the hooks on every module under it that owns such parameters (for the outermost
module, the whole model at once); after that it does nothing for that module. That outermost
module also gets a forward hook that, once its forward is over, waits for the gathers of every
parameter under it that the forward did not use (they have had the whole forward to land), so
that nothing is left in flight into the backward pass. Each module that owns parameters also
gets a state-dict pre-hook and a load-state-dict pre-hook that wait for every gather, so
``model.state_dict()`` and ``model.load_state_dict()`` are right from any thread. Every other
read or write of a weight still in flight waits through the read guard ([Note: reads of a weight
in flight]). The handles are kept (see core._ownership [Note: hooks of a freed optimizer]) and
removed when the optimizer is released. At interpreter exit the gathers still in flight are
waited for, so no collective is left running when torch tears the process group down.

[Note: reads of a weight in flight]
A weight can be read or written right after ``step()`` outside the module that owns it: an EMA by
hand or ``AveragedModel.update_parameters``, ``{n: p.detach().clone()}``, an evaluation that reads
``model.head.weight`` functionally, a tied input embedding ``F.embedding(idx, head.weight)`` at
the start of a forward whose ``head`` runs last, ``copy.deepcopy(model)``, ``torch.save``,
``p.add_()``. Module hooks cannot see those, so while a gather is in flight the thread that called
``step()`` has a ``torch.overrides.TorchFunctionMode`` (``InFlightReads``) on its mode stack.
Every torch function and ``Tensor`` method or property called in that thread goes through it; for
each tensor among the arguments (lists, tuples and dicts opened) it waits, before the call runs,
for the buckets in flight that the tensor's memory overlaps (``WeightGathers.touching``): a trained
parameter through the optimizer's index, any other view of a flat buffer (``p.data``,
``p.detach()``, a slice taken before ``step()``) by its address range, and every bucket in flight
for a tensor without a data pointer of its own (a wrapper subclass). ``p.data``, ``p.tolist()``,
``.numpy()``, ``copy.deepcopy`` and pickling all go through a torch call on the parameter or an
alias. Calls that read no value do not wait (``_NO_WAIT``: ``p.grad``, ``p.shape``,
``p.requires_grad``, hashing, ...), so ``model.zero_grad()`` between ``step()`` and the next
forward keeps the overlap. A write waits like a read, so it lands after the gather and is kept.
``torch.no_grad()`` and ``torch.inference_mode()`` change nothing: the mode sees calls under both.

The mode goes onto the stack at the end of ``step()`` (also of one that raised after starting some
gather; never earlier, so step's own update of the later buckets does not go through it), at the
bottom of the stack: a mode the user entered before ``step()`` (their own, a ``with
torch.device(...)`` block) still leaves with its own ``__exit__``, which pops the top one, and modes
entered after it (``FlopCounterMode``, another ``torch.device`` block) sit above it and see every
call first. Only ``torch.set_default_device``'s mode stays beneath it: torch keeps that one at the
bottom and checks it is there when it leaves. The mode is taken off the stack, wherever it is then,
as soon as nothing is in flight: by the wait that landed the last gather, or, when that wait ran
inside the mode's own ``__torch_function__`` (torch holds a mode off the stack while it runs), by
the next module call, optimizer construction or ``finish_param_gather()`` in that thread (also
the first of those after the optimizer that put it there was collected, which waited quietly).
Placing and taking it off reach the mode stack through the ``torch._C`` stack functions torch's
own ``DeviceContext`` uses (core._compat); ``overlap_param_gather=True`` is refused where they are
missing.

[Note: the cost of the read guard]
While the mode is on the stack, every torch call in that thread pays a Python call (the mode's
``__torch_function__``: about 2-3 microseconds on a CPU) and, while gathers are in flight, a look
at each tensor argument (a dict lookup by ``id``, ``data_ptr()`` and one comparison per flat
buffer: about 2 microseconds each). In the usual loop that is the forward up to the module that
waits for the last bucket (the outermost module's forward hook waits for any bucket the forward
did not use), after which the mode is gone: the backward pass, the next ``step()`` and whatever
runs until then pay nothing, and the optimizer's own update in ``step()`` never runs under it.

[Note: other threads]
A ``TorchFunctionMode`` is thread-local: the guard covers the thread that called ``step()``.
Module calls (the forward pre-hooks), ``state_dict()`` and ``load_state_dict()`` wait from any
thread, and ``WeightGathers`` waits under a lock, a bucket counting as in flight until its gather
has landed, so a thread that asks for a bucket another is waiting for returns once it has landed.
A raw read of a parameter in another thread (a tensor op on it, without a module call) is not seen
by any torch mechanism short of changing the parameter's class (which breaks ``type(p) is
nn.Parameter``, pickling and dynamo's guards, and still misses every alias), nor is memory reached
outside torch (a NumPy array over the weights made before ``step()``): another thread gets the
weights after ``opt.finish_param_gather()``, as with any data a thread writes for another. A write
from another thread that races a gather is found at the next step (see step._usage_checks) and
raises there on every rank.

[Note: compiled models]
Dynamo traces module hooks and the modes on the stack into the compiled code. The hooks and the
mode therefore do their work only when run eagerly: ``torch.compile(model)`` runs the hooks of
its wrapper eagerly, before the compiled code starts. The global hook found the whole model under
it at the first call (before dynamo traced it) and gave the wrapper a hook that waits for every
gather of the model (the last landing takes the mode away), so the compiled forward starts with
nothing in flight and no mode. Where a hook or the mode is traced with gathers in flight (a module
compiled in place with ``module.compile()``, whose hooks all run traced; a compiled function that
reads weights right after ``step()``), it calls a function that dynamo does not trace and that
waits for every gather: one graph break, and the weights are right; the compiled code does not
change from one step to the next. A module compiled
in place is never seen eagerly, so it has no state-dict hooks; its ``state_dict()`` in the
stepping thread waits through the mode, and in another thread after ``opt.finish_param_gather()``.
"""
from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any, Callable

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from shardopt.core._compat import compiled_inner, insert_function_mode, remove_function_mode
from shardopt.comm._gathers import WeightGathers
from shardopt.core._ownership import owned_hook
from shardopt.core._records import BucketRecord

_in_flight = False  # some overlapped gather may be in flight (read by the traced hooks and mode: a guard)
_optimizers: weakref.WeakSet = weakref.WeakSet()  # WeightGathers of optimizers with overlap_param_gather=True
_flying: tuple[WeightGathers, ...] = ()  # those with a gather in flight, as of the last step() or landing
_local = threading.local()  # .mode: this thread's InFlightReads while it may be on the stack (else absent or None)

# Calls that read no weight values: they never wait (see [Note: reads of a weight in flight]). A
# property reaches a mode as its descriptor's __get__/__set__ (``_T``: Tensor, typed as the class).
_T: Any = Tensor
_NO_WAIT = frozenset({
    _T.grad.__get__, _T.grad.__set__, _T.grad.__delete__, _T.requires_grad.__get__, _T.requires_grad.__set__,
    _T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.layout.__get__, _T.ndim.__get__, _T.is_leaf.__get__,
    _T.grad_fn.__get__, _T._version.__get__, Tensor.requires_grad_, Tensor.size, Tensor.dim, Tensor.numel,
    Tensor.stride, Tensor.element_size, Tensor.is_contiguous, Tensor.is_floating_point, Tensor.__hash__,
    Tensor.__len__, Tensor.register_hook, Tensor.register_post_accumulate_grad_hook, Tensor.retain_grad,
})


class InFlightReads(TorchFunctionMode):
    """The read guard of one thread while overlapped gathers are in flight: each torch call waits
    first for the buckets in flight that its tensor arguments overlap (see [Note: reads of a weight
    in flight]). Local."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if _in_flight:
            if torch.compiler.is_compiling():  # see [Note: compiled models]
                _finish_all()
            elif func not in _NO_WAIT:
                _wait_for(args, kwargs)
        return func(*args, **kwargs)


def _wait_for(args: tuple, kwargs: dict) -> None:
    """Wait for the buckets in flight that the tensors among ``args`` and ``kwargs`` (lists, tuples
    and dicts opened) overlap."""
    for x in args:
        _wait_touching(x)
    for x in kwargs.values():
        _wait_touching(x)


def _wait_touching(x: Any) -> None:
    if isinstance(x, Tensor):
        for gathers in _flying:
            for bucket in gathers.touching(x):
                gathers.wait(bucket)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _wait_touching(y)
    elif isinstance(x, dict):
        for y in x.values():
            _wait_touching(y)


def in_flight() -> None:
    """step() issued overlapped gathers (call once they are all started, or once step() raised
    after starting some): the thread that called it gets the read guard. Local."""
    global _in_flight, _flying
    _flying = tuple(g for g in list(_optimizers) if g)
    _in_flight = bool(_flying)
    if not _in_flight:
        return
    mode = getattr(_local, "mode", None)
    if mode is not None:  # left from the last step (or taken off by someone else): a new one, at the bottom
        remove_function_mode(mode)
    _local.mode = InFlightReads()
    insert_function_mode(_local.mode)


def landed() -> None:
    """A gather was waited for (or an optimizer built): whether any is still in flight; once none
    is, this thread's read guard leaves the mode stack. Local; outside compiled code."""
    global _in_flight, _flying
    _flying = tuple(g for g in _flying if g)
    _in_flight = bool(_flying)
    if not _in_flight:
        _retire()


def _retire() -> None:
    mode = getattr(_local, "mode", None)
    if mode is not None and remove_function_mode(mode):  # not there while its own __torch_function__ runs
        _local.mode = None


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
            if getattr(_local, "mode", None) is not None:
                landed()  # the last gather may have landed inside the mode's own call, or its optimizer is gone
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
            after = _after_forward(ref, module, o) if compiled_inner(module) is None else None
            if after is not None:  # the outermost module of this forward, over some of the parameters
                handles.append(owned_hook(module.register_forward_hook(after), ref))
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


def _after_forward(ref: weakref.ref, module: torch.nn.Module, o: WeightGathers
                   ) -> Callable[[torch.nn.Module, Any, Any], None] | None:
    """The outermost module's forward hook: waits for the buckets under it that its forward left in
    flight. None when no parameter under it is the optimizer's."""
    buckets: dict[int, BucketRecord] = {}
    for p in module.parameters():
        r = o.record_of.get(id(p))
        if r is not None:
            buckets.setdefault(id(r.bucket), r.bucket)
    if not buckets:
        return None

    def wait_left(gathers: WeightGathers, m: torch.nn.Module) -> None:
        for b in buckets.values():
            gathers.wait(b)

    wait = _module_hook(ref, wait_left)

    def hook(m: torch.nn.Module, args: Any, output: Any) -> None:
        wait(m, args)
    return hook


def _finish_at_exit(ref: weakref.ref) -> None:
    gathers = ref()
    if gathers:
        gathers.finish()
