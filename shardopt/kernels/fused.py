"""The reference step functions compiled by ``torch.compile`` into one fused pass per shard.

On CPU inductor emits vectorised C++ (OpenMP), on GPU Triton. ``dynamic=None`` lets the first
call compile for its exact shape and a second shape switch to a shape-generic kernel, so the
segments of a shard (one per param group) cost at most two compiles per mode and dtype.
On CPU, :mod:`shardopt.kernels._cpu_codegen` vectorises the codecs' bitcasts and, for these
kernels only, runs two vectors per loop iteration with fast 8-bit moves and conversions.
Compilation is lazy: a kernel compiles on its first call.

[Note: compile failure] Whether the compiler works shows only when it first runs (no C++ compiler,
no Triton, an unsupported torch). A :class:`shardopt.kernels.Kernels` that chose the fused path
therefore holds each fused function through :func:`with_fallback`, which tells a failure to
compile from a failure of the compiled code:

- torch.compile compiles a kernel before it runs it, tracing on fake tensors, and raises a
  ``TorchDynamoException`` (``BackendCompilerFailed``, ``InductorError``, ...) from there: the
  tensors the kernel would write are untouched. Such an error goes to the object's
  ``on_failure`` (which warns once and rebinds every function of the object to the reference, or
  re-raises under ``SHARDOPT_KERNEL=fused``), and the reference runs the call, once. The wrapper
  remembers the failure, so a caller that kept it runs the reference from then on too.
- Any other error (out of memory, a fault in the generated code) is raised where it happened,
  with a note naming the kernel and what it may have written: a step kernel updates the shard's
  weights, master weights and moments in place, so after such an error they may be partly
  written, and the step is not run a second time over them (that would apply it twice). The
  statistics kernels write nothing.
"""
from __future__ import annotations

import functools
import sys
from typing import Callable

import torch
from torch._dynamo.exc import TorchDynamoException  # what torch.compile raises while compiling

from shardopt.kernels import _cpu_codegen, reference


def compile_options() -> dict:
    """The inductor options every fused kernel (and the self-check) compiles with; installs the
    code-generator additions first (see _cpu_codegen [Note: vector bitcast])."""
    _cpu_codegen.install()
    # emulate_precision_casts: the fp16 remainder needs x - float(fp16(x)) computed as written, not
    # simplified to x - x by keeping the rounded value in fp32.
    return {"emulate_precision_casts": True, **_cpu_codegen.compile_options()}


@functools.cache
def _compiled(name: str):  # noqa: ANN202 - returns a compiled callable
    return torch.compile(getattr(reference, name), fullgraph=True, dynamic=None, options=compile_options())


def _run(kernel: Callable, args: tuple, kwargs: dict):  # noqa: ANN202 - the kernel's own result
    with _cpu_codegen.fused_kernels():  # see [Note: wide tiling], [Note: wide bytes]
        return kernel(*args, **kwargs)


def _call(name: str, args: tuple, kwargs: dict):  # noqa: ANN202 - the kernel's own result
    return _run(_compiled(name), args, kwargs)


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
    """The fused function ``name`` (one of ``shardopt.kernels.STEP_NAMES``): a failure to compile
    calls ``on_failure(error)`` and runs the reference, for good; an error of the compiled code
    propagates with a note on what it may have written (see [Note: compile failure])."""
    reference_fn = getattr(reference, name)
    failed = False

    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the kernel's own signature and result
        nonlocal failed
        if failed:
            return reference_fn(*args, **kwargs)
        try:
            compiled = _compiled(name)
        except Exception as e:  # noqa: BLE001 - torch.compile itself unusable: nothing ran
            failure = e
        else:
            try:
                return _run(compiled, args, kwargs)
            except TorchDynamoException as e:  # compiling (BackendCompilerFailed, InductorError, ...): nothing ran
                failure = e
            except Exception as e:
                _ran_and_failed(name, e)
                raise
        on_failure(failure)
        failed = True
        return reference_fn(*args, **kwargs)

    run.__name__ = name
    run.__doc__ = reference_fn.__doc__
    return run
