"""The reference step functions compiled by ``torch.compile`` into one fused pass per shard.

On CPU inductor emits vectorised C++ (OpenMP), on GPU Triton. On CPU,
:mod:`shardopt.kernels._cpu_codegen` vectorises the codecs' bitcasts and, for these kernels only,
runs two vectors per loop iteration with fast 8-bit moves and conversions. Compilation is lazy: a
kernel compiles on its first call.

[Note: one compile per variant] Dynamo keeps the graphs it compiled for a function on the
function's code object, and refuses a further one past ``torch._dynamo.config.recompile_limit``
(8) graphs per code object: under ``fullgraph=True`` by raising ``FailOnRecompileLimitHit``. One
process easily asks more of one step function than that: each weight dtype, moments format,
amsgrad's running maximum or none, the 16-bit weight written or not, is a graph of its own, and a
dozen optimizers over such variants reached the limit at the ninth. So each *variant* of a call
gets its own compiled function (:func:`_compiled`), over its own copy of the reference
function's code object (:func:`_own_code`), and with it its own count: a variant is what dynamo
would guard on other than sizes (:func:`variant`: each tensor's dtype, device, number of
dimensions and ``requires_grad``, which operands are tuples or None, the values of plain
numbers), as torchao compiles one function per variant of its optimizer step. Sizes are left to
dynamo's automatic dynamic shapes (``dynamic=None``): a variant's first call compiles for its
exact size, and a second size compiles a kernel for any size (a length of 1 is a graph of its
own), so the segments of a shard (one per param group) cost at most two or three compiles per
variant, far under the limit. Should the limit still be met (lowered by the user, say), that is
a failure to compile like any other: the reference runs the call (see [Note: compile failure]).

[Note: compile failure] Whether the compiler works shows only when it first runs (no C++ compiler,
no Triton, an unsupported torch, the recompile limit). A :class:`shardopt.kernels.Kernels` that
chose the fused path therefore holds each fused function through :func:`with_fallback`, which
tells a failure to compile from a failure of the compiled code by whether the compiled code had
started: dynamo traces and compiles before it runs anything, and the backend here
(:class:`_Inductor`, inductor with the options of :func:`compile_options`) marks the call as
started at the top of the compiled graph, before its first write.

- Any error raised before the compiled graph started (``BackendCompilerFailed``,
  ``InductorError``, ``FailOnRecompileLimitHit``, whatever its type): the tensors the kernel would
  write are untouched. It goes to the object's ``on_failure`` (which warns once, naming the
  error, and rebinds every function of the object to the reference, or re-raises under
  ``SHARDOPT_KERNEL=fused``), and the reference runs the call, once. The wrapper remembers the
  failure, so a caller that kept it runs the reference from then on too. The step goes on on
  this rank as on the others (each rank updates its own shard, with no collective inside), so
  a rank that falls back never leaves the others waiting.
- An error raised once the compiled graph started (out of memory, a fault in the generated code)
  is raised where it happened, with a note naming the kernel and what it may have written: a
  step kernel updates the shard's weights, master weights and moments in place, so after such
  an error they may be partly written, and the step is not run a second time over them (that
  would apply it twice). The statistics kernels write nothing.
"""
from __future__ import annotations

import contextvars
import functools
import hashlib
import sys
import types
from typing import Any, Callable

import torch

from shardopt.kernels import _cpu_codegen, reference

# [Note: modes around a kernel]
# A fused kernel runs with torch functions off (torch._C.DisableTorchFunction): the torch function
# modes on the stack when step() or clip_grad_norm_ calls it are not traced into its graph. They
# are the caller's (a user's mode entered around the loop, or the read guard another optimizer's
# overlapped step left in this thread, see group._gather_wait), and a kernel reads and writes the
# optimizer's own buffers only, which no such mode has a reason to see: traced, a mode would make
# the kernel's compile depend on it (the read guard's wait is a graph break, which the kernel's
# fullgraph=True compile refuses), and the reference kernel would be taken for good.
_started = contextvars.ContextVar("shardopt_fused_started", default=False)  # see [Note: compile failure]


def compile_options() -> dict:
    """The inductor options every fused kernel (and the self-check) compiles with; installs the
    code-generator additions first (see _cpu_codegen [Note: vector bitcast])."""
    _cpu_codegen.install()
    # emulate_precision_casts: the fp16 remainder needs x - float(fp16(x)) computed as written, not
    # simplified to x - x by keeping the rounded value in fp32.
    return {"emulate_precision_casts": True, **_cpu_codegen.compile_options()}


class _Inductor:
    """A torch.compile backend: inductor with ``options`` (as ``torch.compile(options=...)`` passes
    them), whose compiled graphs mark the call as started before they run (see [Note: compile failure])."""

    compiler_name = __name__ = "inductor"  # what dynamo's messages and debugging tools call it

    def __init__(self, options: dict) -> None:
        self.options = options

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        patches = {**self.options, **(kwargs.pop("config_patches", None) or {})}
        graph: Callable = compile_fx(gm, example_inputs, config_patches=patches, **kwargs)  # type: ignore[assignment]

        def started(*args: Any) -> Any:
            _started.set(True)
            return graph(*args)
        return started


def variant(args: tuple, kwargs: dict) -> tuple:
    """What a call's compiled graph depends on besides sizes (see [Note: one compile per variant])."""
    return tuple(_form(a) for a in args), tuple(sorted((k, _form(v)) for k, v in kwargs.items()))


def _form(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return str(x.dtype), str(x.device), x.dim(), x.requires_grad
    if isinstance(x, (tuple, list)):
        return tuple(_form(y) for y in x)
    return type(x).__name__, x if x is None or isinstance(x, (bool, int, float, str)) else None


def _own_code(fn: Callable, tag: str) -> Callable:
    """``fn`` over a copy of its code object named ``<name>_<tag>``: a function whose graphs dynamo
    counts apart from every other copy's (see [Note: one compile per variant])."""
    name = f"{fn.__name__}_{tag}"
    code = fn.__code__.replace(co_name=name)
    if sys.version_info >= (3, 11):
        code = code.replace(co_qualname=name)
    copy = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else None
    copy.__module__, copy.__qualname__, copy.__doc__ = fn.__module__, name, fn.__doc__
    return copy


@functools.cache
def _compiled(name: str, form: tuple) -> Callable:
    """The fused function ``name`` for the calls of variant ``form``, compiled at its first call."""
    tag = hashlib.sha1(repr(form).encode()).hexdigest()[:12]  # the same in every process (dynamo's logs, profiles)
    return torch.compile(_own_code(getattr(reference, name), tag), fullgraph=True, dynamic=None,
                         backend=_Inductor(compile_options()))


def _run(kernel: Callable, args: tuple, kwargs: dict):  # noqa: ANN202 - the kernel's own result
    # torch functions off: see [Note: modes around a kernel]
    with _cpu_codegen.fused_kernels(), torch._C.DisableTorchFunction():  # see [Note: wide tiling], [Note: wide bytes]
        return kernel(*args, **kwargs)


def _call(name: str, args: tuple, kwargs: dict):  # noqa: ANN202 - the kernel's own result
    return _run(_compiled(name, variant(args, kwargs)), args, kwargs)


def step_fp32(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
    _call("step_fp32", args, kwargs)


def step_remainder(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
    _call("step_remainder", args, kwargs)


def step_stochastic(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
    _call("step_stochastic", args, kwargs)


def step_none(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
    _call("step_none", args, kwargs)


def moment8_scan(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    return _call("moment8_scan", args, kwargs)


def grad_nonfinite(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    return _call("grad_nonfinite", args, kwargs)


def grad_max(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    return _call("grad_max", args, kwargs)


def grad_norm_power(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    return _call("grad_norm_power", args, kwargs)


# What a step kernel updates in place; the statistics kernels (moment8_scan, grad_*) write nothing.
_WRITES = {"step_fp32", "step_remainder", "step_stochastic", "step_none"}


def _ran_and_failed(name: str, error: Exception) -> None:
    """Add to ``error`` (raised by the compiled kernel ``name`` while it ran) what it may have written."""
    if name in _WRITES:
        state = ("it updates this rank's shard of the weights, master weights and moments in place, so they may be "
                 "partly written: the step was not run again over them. Load the last checkpoint "
                 "(shardopt.load_checkpoint) before training on; SHARDOPT_KERNEL=reference runs the eager kernels")
    else:
        state = "it writes nothing (a gradient statistic), so the optimizer's state is as it was before the call"
    if sys.version_info >= (3, 11):  # exceptions take notes from 3.11 on; 3.10 raises the error without it
        error.add_note(f"shardopt: raised by the fused kernel {name} while it ran (after compiling); {state}")


def with_fallback(name: str, on_failure: Callable[[Exception], None]) -> Callable:
    """The fused function ``name`` (one of ``shardopt.kernels.STEP_NAMES``), compiled per variant of
    its calls (see [Note: one compile per variant]): a failure to compile calls
    ``on_failure(error)`` and runs the reference, for good; an error of the compiled code
    propagates with a note on what it may have written (see [Note: compile failure])."""
    reference_fn = getattr(reference, name)
    failed = False

    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the kernel's own signature and result
        nonlocal failed
        if failed:
            return reference_fn(*args, **kwargs)
        token = _started.set(False)
        try:
            return _call(name, args, kwargs)
        except Exception as e:  # sorted by whether the compiled code had started (a re-raise or a fallback)
            if _started.get():
                _ran_and_failed(name, e)
                raise
            failure = e  # compiling (or the recompile limit): nothing ran, nothing was written
        finally:
            _started.reset(token)
        on_failure(failure)
        failed = True
        return reference_fn(*args, **kwargs)

    run.__name__ = name
    run.__doc__ = reference_fn.__doc__
    return run
