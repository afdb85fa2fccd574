"""Where overlapped weight gathers are waited for (``overlap_param_gather=True``).

[Note: overlapped gather]
With overlap_param_gather=True, step() returns while the weights are still being all-gathered.
Before each module runs, the buckets holding the parameters it owns directly are waited for, so
the gathers of later layers overlap the compute of earlier ones (as FSDP2 and Megatron's
overlap_param_gather do). The optimizer is not given the model, so the waits run in two global
module hooks of its own (``register_module_forward_pre_hook`` and
``register_module_forward_hook``), which look at the module being called: its parameters are
looked up in the optimizer's index, by identity, as the module runs (see [Note: hooks on the
user's modules] for why nothing is registered on the modules themselves for this). The first
module of a forward over some of the optimizer's parameters (the outermost one, usually the
model) also waits, once its forward is over, for the gathers of every parameter under it that
the forward did not use (they have had the whole forward to land), so that nothing is left in
flight into the backward pass. A module whose submodules run where no Python hook reaches them
waits, before it runs: torch.compile's wrapper for every gather in flight, of every optimizer
(see [Note: compiled models]), and a TorchScript module for every bucket under it (``torch.jit.script``/``trace``, whose submodules run inside
the TorchScript interpreter). Each module that owns parameters (but a TorchScript one, which takes
no such hook) also gets a state-dict pre-hook and a load-state-dict pre-hook that wait for every
gather, so ``model.state_dict()`` and ``model.load_state_dict()`` are right from any thread: those
modules are found by looking at every module under each module called, from the optimizer's
construction until its first overlapped step, and then at each module called while gathers are in
flight. Every other read or write of a weight still in flight waits through the read guard
([Note: reads of a weight in flight]). The handles are kept (see core._ownership [Note: hooks of a
freed optimizer]) and removed when the optimizer is released. At interpreter exit the gathers
still in flight are waited for, so no collective is left running when torch tears the process
group down (one callback for every optimizer of the process, registered once).

[Note: hooks on the user's modules]
The user pickles their model (``torch.save(model)``), deep-copies it (an EMA copy, a reference
model) and compiles it; shardopt's hooks must not get in the way. Module hooks are part of a
module's pickled state (``Module.__getstate__`` keeps its hook dicts), and a closure or lambda
does not pickle; ``copy.deepcopy`` copies a function by reference, so a copy would keep hooks
working for the original's optimizer. So the forward waits are global hooks (above), which are
not part of any module: a copy of the model is a model the optimizer does not train, whose
parameters the index does not hold, and nothing waits for it. ``state_dict()`` has no global
hook, so its pre-hooks sit on the modules, as objects of a module-level class (``_WaitAll``)
holding the optimizer weakly, whose pickled and deep-copied form is ``"".format``: a builtin that
takes any arguments and does nothing, so a saved model loads without shardopt installed, and a
copy's ``state_dict()`` waits for nothing.

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

Memory reached without a torch call is not seen: ``bytes(p.untyped_storage())`` (the storage's
``__getitem__``/buffer protocol; its ``untyped_storage()`` call waits for the parameter's own
bucket only, while the storage is the whole flat buffer, other buckets included), or a NumPy array
(``p.detach().numpy()``, ``memoryview``, DLPack) made before ``step()``, read with NumPy after it:
both read the flat buffer's bytes as they are, so take them after ``opt.finish_param_gather()``.
Calls inside TorchScript code are not torch calls of the thread either: a TorchScript module
waits for every bucket under it before it runs (above), but a TorchScript function given a weight
right after ``step()`` does not.

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
runs until then pay nothing, and the optimizer's own update in ``step()`` never runs under it
(see [Note: the optimizer's own update]).
Shardopt's own work when a gather lands (its profiler range, the check of its parameters'
version counters, see step._usage_checks) runs with torch functions off (group._gathers), and
looks at that bucket's parameters only, so a landing costs the same whatever the number of
buckets. The global module hooks cost every module call one Python call each that reads a
module-level flag and returns while nothing is in flight (and the optimizer has taken its first
overlapped step). Most of what a forward with nothing in flight pays is torch's: while any global
module hook is registered, every module call takes the slower path of ``Module._call_impl``
(about 1.5 microseconds a call on a CPU). The hooks stay registered for the optimizer's life all
the same: dynamo guards on the lengths of the hook dicts, so adding and removing them at every
step would recompile a compiled model at every step.

[Note: the optimizer's own update]
The update of ``step()`` reads and writes the optimizer's own buffers only, which the gathers of
no other optimizer touch, so no read guard has a reason to see it. Yet the guard of another
optimizer can be on the stack when it runs: ``for opt in optimizers: opt.step()`` with the first
overlapped (two models, or one model split between two optimizers). ``step()`` takes this
thread's guard off the stack for its update (``outside_read_guard``) and puts it back at the
bottom after, and every fused kernel runs with torch functions off (kernels.fused [Note: modes
around a kernel]), also in ``clip_grad_norm_`` and in the gradient check before the update:
traced, the guard's wait would be a graph break inside the kernel's ``fullgraph=True`` compile,
which fails, and the optimizer would take the reference kernel for good.

[Note: other threads]
A ``TorchFunctionMode`` is thread-local: the guard covers the thread that called ``step()``.
Module calls (the global hooks), ``state_dict()`` and ``load_state_dict()`` wait from any
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
mode therefore do their work only when run eagerly, and what they run eagerly is never compiled
(``torch.compiler.disable``): a module called eagerly inside compiled code after a graph break
(a submodule compiled apart, ``torch.compile(model.body)``, runs its hooks inside the wrapper's
compile context) would otherwise have dynamo compile the hooks' own frames, which look at the
optimizer's sets of modules. ``torch.compile(module)`` runs the hooks of its wrapper eagerly,
before the compiled code starts, and the wrapper waits there for every gather in flight, of
every optimizer, so its compiled code starts with nothing in flight and no mode, and nothing
traced waits: the whole model compiled, a part of it compiled apart and called from an eager
forward (the rest of that forward's buckets land before the part runs, not during it), or a
model compiled beside another one whose optimizer's gathers are in flight, all with
``fullgraph=True`` too. Where a hook or the mode is traced with gathers in flight, it calls
``_finish_all``, which dynamo does not trace and which waits for every gather: one graph break,
and the weights are right; the compiled code does not change from one step to the next. A traced
hook waits at every module call (a module compiled in place with ``module.compile()``, whose
hooks all run traced, or a module called from a compiled function); the traced mode waits at a
call with a tensor argument of the dtype of some overlapped optimizer's weights (``_weight_dtypes``,
on which dynamo guards, as on each input's dtype). It cannot look at a tensor's memory there (the
traced tensors are fakes), and a tensor of another dtype is not a weight (nor a view of one but
the kind below), so a
compiled function that reads no weight (an augmentation of the integer batch, a metric) runs
without waiting; one that takes a tensor of the weights' dtype waits, be it a weight or not. A
view of the weights as another dtype (``p.view(torch.int16)``) made before ``step()`` and handed
to compiled code right after it is not seen, like a NumPy array made before ``step()``. Under
``fullgraph=True`` a graph break is an error, and nothing else can wait there: no Python runs
between the call of a compiled function and its compiled code but torch's, and an operator put
into the graph to wait would not be ordered before the graph's reads of the weights (custom
operators and ``leaf_function`` are ordered only by their data). Dynamo's error then carries the
reason of the wait (``_FULLGRAPH_MODULE`` for a hook, ``_FULLGRAPH_READ`` for the mode), which
says what to do: call ``opt.finish_param_gather()`` first, or, for a module, compile it with
``torch.compile(model, fullgraph=True)`` (whose wrapper waits eagerly, as above). A module
compiled in place is never seen eagerly, so it has no state-dict hooks; its ``state_dict()`` in
the stepping thread waits through the mode, and in another thread after
``opt.finish_param_gather()``.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, cast

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from shardopt.core._compat import compiled_inner, insert_function_mode, remove_function_mode
from shardopt.core._ownership import owned_hook
from shardopt.comm._collectives import Pending
from shardopt.core._records import BucketRecord, ParamRecord

if TYPE_CHECKING:
    from shardopt.group._flat_group import FlatGroup

# Module-level flags, read first by every hook (also in traced code, where dynamo guards on them):
_in_flight = False  # some overlapped gather may be in flight
_left = False  # some thread's read guard may still be on its stack with nothing in flight (see _retire)
_looking = False  # some optimizer has not taken its first overlapped step: module calls are looked at (GatherWatch)
_generation = 0  # overlapped steps taken so far: which forward a module call belongs to (GatherWatch.before)
_left_in: set[int] = set()  # the threads (by ident) whose read guard is left on their stack
_watches: weakref.WeakSet = weakref.WeakSet()  # the GatherWatch of every optimizer with overlap_param_gather=True
# The WeightGathers with a gather in flight, as of the last step() or landing. Held weakly: an
# optimizer dropped with gathers in flight is freed at once (its __del__ waits for them).
_flying: tuple[weakref.ref, ...] = ()
_exit_hook = False  # _finish_at_exit is registered with atexit (once per process)
_weight_dtypes: frozenset[torch.dtype] = frozenset()  # the dtypes of every watch's flat buffers (read when traced)


# [Note: storage torch will not show]
# ``WeightGathers.touching`` and ``touching_storage`` look at a tensor's memory. A tensor without
# storage (sparse, MKL-DNN, a ``torch.vmap`` batched tensor, a ``torch.func`` wrapper) is told by
# ``torch._C._has_storage`` and waits for every bucket in flight. Some tensors have storage whose
# address torch refuses to hand out, and torch has no question to ask first, so the refusal is
# caught: a FunctionalTensor or FakeTensor while tracing, an output of a CUDA graph that a later
# replay overwrote, and, for ``untyped_storage()``, a wrapper subclass (DTensor, the stage-2
# gradient placeholder: a storage of some bytes without data). They wait for every bucket too.


class WeightGathers:
    """One optimizer's weight all-gathers in flight, over its flat groups: each group starts, holds
    and waits its own (``FlatGroup.start_gather``, ``wait_gather``; the bucket record holds the
    handle); this is what the forward's hooks and the read guard look through. step() starts one
    gather per bucket as soon as that bucket's part of the shard is updated. Without
    ``overlap_param_gather`` it waits for all of them before it returns; with it, the next
    forward, or the first torch call that reads or writes a weight still in flight, waits bucket
    by bucket. Either way each gather is waited for exactly once, under its group's lock: a thread
    that asks for a bucket another thread is waiting for returns once it has landed. Local: the
    collectives were issued by step() on every rank; waiting is each rank's own, from any thread."""

    def __init__(self, groups: Sequence[FlatGroup], record_of: dict[int, ParamRecord], overlap: bool) -> None:
        self.groups = list(groups)
        self.record_of = record_of  # id(param) -> its record, for every trained parameter (the optimizer's one index)
        self.overlap = overlap  # the read guard follows what is in flight (overlap_param_gather)
        # Each flat buffer's bytes (first, one past the last), by group index: the memory the gathers
        # write, for touching(). A flat buffer is allocated once and never moves.
        self._memory = [(g.flat.data.data_ptr(), g.flat.data.data_ptr() + g.flat.data.nbytes) for g in self.groups]
        self.dtypes = frozenset(g.flat.dtype for g in self.groups)  # the weights' dtypes (see [Note: compiled models])

    def wait(self, bucket: BucketRecord) -> bool:
        """Wait for the gather of ``bucket`` if it is in flight (``FlatGroup.wait_gather``); True if
        it was. Then, with the read guard, whether any gather is still in flight."""
        if bucket.gather is None:  # landed already (a thread waiting for it holds it until it has)
            return False
        waited = ended = False
        try:
            waited = self.groups[bucket.buffer].wait_gather(bucket)
            ended = True
        finally:  # also when the wait raised
            if self.overlap and (waited or not ended):
                landed()
        return waited

    def finish(self) -> None:
        """Wait for every gather in flight, group by group in the order they were started
        (``FlatGroup.finish_gathers``); then, with the read guard, that none is in flight."""
        try:
            for g in self.groups:
                g.finish_gathers()
        finally:  # also when a wait raised
            if self.overlap:
                landed()

    def wait_quietly(self) -> None:
        """Wait for every gather without looking at what landed (an optimizer being collected)."""
        for g in self.groups:
            g.drop_gathers()

    def touching(self, t: Tensor) -> list[BucketRecord]:
        """The buckets in flight whose memory ``t`` may read or write: the bucket of a trained
        parameter, or those a view of a flat buffer overlaps (``p.data``, ``p.detach()``, a slice,
        ``flat[a:b]``); every bucket in flight for a tensor without a data pointer (a wrapper
        subclass: it may hold one). A question. Local."""
        r = self.record_of.get(id(t))
        if r is not None:
            return [r.bucket] if r.bucket.gather is not None else []
        if not torch._C._has_storage(t):  # no storage of its own to look at (sparse, MKL-DNN, vmap's, torch.func's)
            return list(self)
        try:
            first = t.data_ptr()
        except (RuntimeError, NotImplementedError):  # see [Note: storage torch will not show]
            return list(self)
        for g, (lo, hi) in zip(self.groups, self._memory):
            if lo <= first < hi and t.numel():  # a view of this flat buffer (no view starts before its storage)
                end = first + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
                return g.touching(first, end)
        return []

    def touching_storage(self, t: Tensor) -> list[BucketRecord]:
        """The buckets in flight in the whole storage of ``t`` (what ``t.untyped_storage()`` hands
        out: for a weight, its whole flat buffer); as ``touching`` for a tensor without one. A
        question. Local."""
        if not torch._C._has_storage(t):  # as in touching
            return list(self)
        try:
            storage = t.untyped_storage()
            first = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # see [Note: storage torch will not show]
            return list(self)
        for g, (lo, hi) in zip(self.groups, self._memory):
            if lo <= first < hi:  # this flat buffer's storage (a flat buffer is an allocation of its own)
                return g.touching(first, first + storage.nbytes())
        return []

    def handles(self) -> list[Pending]:
        """The handles in flight (for tests that check they were waited for)."""
        return [cast(Pending, b.gather) for b in self]  # each started bucket holds its Pending

    def __iter__(self) -> Iterator[BucketRecord]:
        return (b for g in self.groups for b in g.gathers_in_flight)

    def __bool__(self) -> bool:
        return any(g.gathers_in_flight for g in self.groups)


class _Local(threading.local):
    mode: InFlightReads | None = None  # this thread's read guard while it may be on the stack


_local = _Local()

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
# Calls that hand out a tensor's whole storage, which for a weight is its whole flat buffer: they
# wait for every bucket of it in flight, not only for the tensor's own elements.
_STORAGE = frozenset({Tensor.untyped_storage, Tensor.storage})

# Why a wait is not traced; dynamo puts it into its error under fullgraph=True (see [Note: compiled models]).
_FULLGRAPH_MODULE = (
    "shardopt: a module runs inside code compiled with fullgraph=True (a module compiled in place with "
    "module.compile, or called from a compiled function) while the weights that step() updated are still being "
    "gathered (overlap_param_gather=True); its wait for them is a graph break, which fullgraph=True refuses. "
    "Compile the module as torch.compile(model, fullgraph=True) instead, whose wrapper waits for every gather "
    "before its compiled code starts, call opt.finish_param_gather() before calling it right after step(), or "
    "leave overlap_param_gather off")
_FULLGRAPH_READ = (
    "shardopt: code compiled with fullgraph=True and called right after step() takes a tensor of the weights' "
    "dtype (a weight, or a tensor that may view the weights) while the weights that step() updated are still "
    "being gathered (overlap_param_gather=True); waiting for them is a graph break, which fullgraph=True refuses. "
    "Call opt.finish_param_gather() before calling it, or leave overlap_param_gather off")


class InFlightReads(TorchFunctionMode):
    """The read guard of one thread while overlapped gathers are in flight: each torch call waits
    first for the buckets in flight that its tensor arguments overlap (see [Note: reads of a weight
    in flight]). Local."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if _in_flight:
            if torch.compiler.is_compiling():  # see [Note: compiled models]
                if _of_weight_dtype(args) or _of_weight_dtype(kwargs):
                    _finish_all_for_read()
            elif func in _STORAGE:
                _wait_for_storage(args[0])
            elif func not in _NO_WAIT:
                _wait_for(args, kwargs)
        return func(*args, **kwargs)


def _of_weight_dtype(x: Any) -> bool:
    """Whether a tensor among ``x`` (lists, tuples and dicts opened) has the dtype of some weights
    an optimizer gathers with overlap: traced, in place of the look at its memory (see [Note:
    compiled models])."""
    if isinstance(x, Tensor):
        return x.dtype in _weight_dtypes
    if isinstance(x, (list, tuple)):
        return any(_of_weight_dtype(y) for y in x)
    if isinstance(x, dict):
        return any(_of_weight_dtype(y) for y in x.values())
    return False


def _wait_for(args: tuple, kwargs: dict) -> None:
    """Wait for the buckets in flight that the tensors among ``args`` and ``kwargs`` (lists, tuples
    and dicts opened) overlap."""
    for x in args:
        _wait_touching(x)
    for x in kwargs.values():
        _wait_touching(x)


def _wait_touching(x: Any) -> None:
    if isinstance(x, Tensor):
        _wait_buckets(lambda gathers: gathers.touching(x))
    elif isinstance(x, (list, tuple)):
        for y in x:
            _wait_touching(y)
    elif isinstance(x, dict):
        for y in x.values():
            _wait_touching(y)


def _wait_for_storage(t: Any) -> None:
    if isinstance(t, Tensor):
        _wait_buckets(lambda gathers: gathers.touching_storage(t))


def _wait_buckets(named: Callable[[Any], list]) -> None:
    """Wait, in every optimizer's gathers in flight, for the buckets ``named(gathers)`` lists."""
    for ref in _flying:
        gathers = ref()
        if gathers is not None:
            for bucket in named(gathers):
                gathers.wait(bucket)


def in_flight() -> None:
    """step() issued overlapped gathers (call once they are all started, or once step() raised
    after starting some): the thread that called it gets the read guard. Local."""
    global _in_flight, _flying, _generation, _looking
    watches = list(_watches)
    for w in watches:
        if w.gathers:
            w.looking = False
    _looking = any(w.looking for w in watches)
    _flying = tuple(weakref.ref(w.gathers) for w in watches if w.gathers)
    _in_flight = bool(_flying)
    if not _in_flight:
        return
    _generation += 1
    mode = _local.mode
    if mode is not None:  # left from the last step (or taken off by someone else): a new one, at the bottom
        remove_function_mode(mode)
    _local.mode = InFlightReads()
    insert_function_mode(_local.mode)
    _note_left(False)


@contextlib.contextmanager
def outside_read_guard() -> Iterator[None]:
    """This thread's read guard off the mode stack while step() updates its own buffers (see
    [Note: the optimizer's own update]), back at the bottom afterwards if gathers are still in
    flight. Local."""
    mode = _local.mode
    if mode is None or not remove_function_mode(mode):
        yield
        return
    try:
        yield
    finally:
        if _local.mode is mode:  # not replaced meanwhile
            if _in_flight:
                insert_function_mode(mode)
            else:  # the last gather landed meanwhile
                _local.mode = None
                _note_left(False)


def landed() -> None:
    """A gather was waited for (or an optimizer built): whether any is still in flight; once none
    is, this thread's read guard leaves the mode stack. Local; outside compiled code."""
    global _in_flight, _flying
    _flying = tuple(r for r in _flying if (g := r()) is not None and g)
    _in_flight = bool(_flying)
    if not _in_flight:
        _retire()


def _retire() -> None:
    mode = _local.mode
    if mode is None:
        return
    if remove_function_mode(mode):
        _local.mode = None
        _note_left(False)
    else:  # its own __torch_function__ runs: the next module call in this thread takes it off
        _note_left(True)


def _note_left(left: bool) -> None:
    """Whether this thread's read guard is left on its stack with nothing in flight."""
    global _left
    (_left_in.add if left else _left_in.discard)(threading.get_ident())
    _left = bool(_left_in)


def _finish_all() -> None:
    """Wait for every gather in flight, of every optimizer. Local; outside compiled code."""
    for w in list(_watches):
        w.gathers.finish()
    landed()


# Where traced code must wait: never traced, so a graph break (see [Note: compiled models])
_finish_all_for_module = torch.compiler.disable(_finish_all, reason=_FULLGRAPH_MODULE)
_finish_all_for_read = torch.compiler.disable(_finish_all, reason=_FULLGRAPH_READ)


class _Outer(threading.local):
    """A thread's outermost module call over some of one optimizer's parameters, in the forward of
    one step (see GatherWatch.before)."""

    module: weakref.ref | None = None  # None: none running
    generation = -1  # the value of _generation when it started


class GatherWatch:
    """The hooks of the Notes above for one optimizer's ``gathers``. Held by the optimizer only:
    the hooks hold it weakly. Local."""

    def __init__(self, gathers: WeightGathers) -> None:
        global _looking, _exit_hook, _weight_dtypes
        self.gathers = gathers
        if not gathers.dtypes <= _weight_dtypes:  # a new object only when it changes: dynamo guards on it
            _weight_dtypes = _weight_dtypes | gathers.dtypes
        self.looking = True  # until its first overlapped step: every module call is looked at
        _looking = True
        self._seen: weakref.WeakSet = weakref.WeakSet()  # modules looked at (with everything under them)
        self._under: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> buckets of its parameters
        self._outer = _Outer()
        _watches.add(self)
        ref = weakref.ref(self)
        self._ref = ref
        hooks = torch.nn.modules.module
        self._handles = [  # every hook of this watch, for remove()
            owned_hook(hooks.register_module_forward_pre_hook(functools.partial(_before_call, ref)), ref),
            owned_hook(hooks.register_module_forward_hook(functools.partial(_after_call, ref)), ref)]
        if not _exit_hook:  # one for every watch: it waits for the gathers of each one alive then
            atexit.register(_finish_at_exit)
            _exit_hook = True

    def remove(self) -> None:
        """Remove every hook of this watch (the optimizer is released). Local."""
        global _looking
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.looking = False
        _looking = any(w.looking for w in list(_watches))

    def before(self, module: torch.nn.Module) -> None:
        """``module`` is about to run (eagerly): look at it, wait for the buckets it needs, and
        note whether it is the outermost module of this forward."""
        if (self.looking or _in_flight) and module not in self._seen:  # everything under a seen one was seen
            self._look(module)
        gathers = self.gathers
        if not gathers:
            return
        unhooked = _runs_unhooked(module)
        if unhooked == "compiled":  # its compiled code starts with nothing in flight (see [Note: compiled models])
            _finish_all()
            return
        if unhooked:
            for b in self._buckets_under(module):  # its submodules run where no hook of ours reaches
                gathers.wait(b)
        else:
            record_of = gathers.record_of
            for p in module._parameters.values():
                r = record_of.get(id(p))
                if r is not None:
                    gathers.wait(r.bucket)
        outer = self._outer
        if (outer.module is None or outer.generation != _generation) and gathers and self._buckets_under(module):
            outer.module, outer.generation = weakref.ref(module), _generation

    def after(self, module: torch.nn.Module) -> None:
        """``module`` ran (eagerly): if it is the outermost module of this forward, wait for the
        buckets under it that its forward left in flight."""
        outer = self._outer
        if outer.module is None or outer.module() is not module or outer.generation != _generation:
            return
        outer.module = None
        for b in self._buckets_under(module):
            self.gathers.wait(b)

    def _buckets_under(self, module: torch.nn.Module) -> tuple[BucketRecord, ...]:
        """The buckets of this optimizer's parameters under ``module`` (found once per module)."""
        found = self._under.get(module)
        if found is None:
            record_of = self.gathers.record_of
            buckets: dict[int, BucketRecord] = {}
            for p in module.parameters():
                r = record_of.get(id(p))
                if r is not None:
                    buckets.setdefault(id(r.bucket), r.bucket)
            found = self._under[module] = tuple(buckets.values())
        return found

    def _look(self, module: torch.nn.Module) -> None:
        """Give every module under ``module`` that owns some of the parameters its state-dict hooks."""
        record_of, wait_all = self.gathers.record_of, None
        for m in module.modules():
            if m in self._seen:
                continue
            self._seen.add(m)
            if isinstance(m, torch.jit.ScriptModule) or not any(id(p) in record_of for p in m._parameters.values()):
                continue  # a TorchScript module takes no state-dict hook (its parent's waits for everything)
            wait_all = wait_all or _WaitAll(self._ref)
            self._handles += [owned_hook(m.register_state_dict_pre_hook(wait_all), self._ref),
                              owned_hook(m.register_load_state_dict_pre_hook(wait_all), self._ref)]


_UNHOOKED: dict[type, str] = {}  # by module class: _runs_unhooked (looked up at every module call)


def _runs_unhooked(module: torch.nn.Module) -> str:
    """Whether the submodules of ``module`` run where no Python hook reaches them: "compiled" for
    torch.compile's wrapper (before its compiled code), "script" for a TorchScript module (see
    [Note: overlapped gather]), "" otherwise."""
    kind = type(module)
    unhooked = _UNHOOKED.get(kind)
    if unhooked is None:
        unhooked = _UNHOOKED[kind] = ("compiled" if compiled_inner(module) is not None else
                                      "script" if isinstance(module, torch.jit.ScriptModule) else "")
    return unhooked


def _before_call(ref: weakref.ref, module: torch.nn.Module, args: Any) -> None:
    """The global forward pre-hook of the GatherWatch behind ``ref``."""
    if not (_in_flight or _left or _looking):  # the usual module call: nothing to do
        return
    if torch.compiler.is_compiling():  # see [Note: compiled models]
        if _in_flight:
            _finish_all_for_module()
        return
    _before_eagerly(ref, module)


@torch.compiler.disable
def _before_eagerly(ref: weakref.ref, module: torch.nn.Module) -> None:
    """The eager work of _before_call: never compiled as frames of their own (see [Note: compiled models])."""
    if _local.mode is not None:
        landed()  # the last gather may have landed inside the mode's own call, or its optimizer is gone
    watch = ref()
    if watch is not None:
        watch.before(module)


def _after_call(ref: weakref.ref, module: torch.nn.Module, args: Any, output: Any) -> None:
    """The global forward hook of the GatherWatch behind ``ref``."""
    if not _in_flight or torch.compiler.is_compiling():  # traced: its pre-hook waited for every gather
        return
    _after_eagerly(ref, module)


@torch.compiler.disable
def _after_eagerly(ref: weakref.ref, module: torch.nn.Module) -> None:
    watch = ref()
    if watch is not None:
        watch.after(module)


class _WaitAll:
    """The state-dict and load-state-dict pre-hook of the modules that own parameters: waits for
    every gather of the optimizer behind ``watch`` (see [Note: hooks on the user's modules])."""

    __slots__ = ("watch",)

    def __init__(self, watch: weakref.ref) -> None:
        self.watch = watch

    def __call__(self, module: torch.nn.Module, *args: Any) -> None:
        if torch.compiler.is_compiling():  # see [Note: compiled models]
            if _in_flight:
                _finish_all_for_module()
            return
        _finish_eagerly(self.watch)

    def __reduce__(self) -> tuple:
        return getattr, ("", "format")  # pickled and deep-copied: a builtin that takes anything and does nothing


@torch.compiler.disable
def _finish_eagerly(ref: weakref.ref) -> None:
    watch = ref()
    if watch is not None and watch.gathers:
        watch.gathers.finish()


def _finish_at_exit() -> None:
    for w in list(_watches):
        w.gathers.finish()
