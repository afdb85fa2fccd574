"""The reference step functions compiled by ``torch.compile`` into one fused pass per shard.

On CPU inductor emits vectorised C++ (OpenMP), on GPU Triton. ``dynamic=None`` lets the first
call compile for its exact shape and a second shape switch to a shape-generic kernel, so the
segments of a shard (one per param group) cost at most two compiles per mode and dtype.
On CPU, :mod:`shardopt.kernels._cpu_codegen` vectorises the codecs' bitcasts and, for these
kernels only, runs two vectors per loop iteration with fast 8-bit moves and conversions.
Compilation is lazy: a kernel compiles on its first call.

[Note: compile failure] Whether the compiler works shows only when it first runs (no C++ compiler,
no Triton, an unsupported torch). A :class:`shardopt.kernels.Kernels` that chose the fused path
therefore holds each fused function through :func:`with_fallback`: a plain function that calls the
compiled kernel and, if that raises, hands the error to the object's ``on_failure`` (which warns
once and rebinds every function of the object to the reference, or re-raises under
``SHARDOPT_KERNEL=fused``) and returns the reference's result. The wrapper remembers the failure,
so a caller that kept it runs the reference from then on too, without compiling again.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from shardopt.kernels import _cpu_codegen, reference


def compile_options() -> dict:
    """The inductor options every fused kernel (and the self-check) compiles with; installs the
    code-generator additions first (see _cpu_codegen [Note: vector bitcast])."""
    _cpu_codegen.install()
    # emulate_precision_casts: the fp16 remainder needs x - float(fp16(x)) computed as written, not
    # simplified to x - x by keeping the rounded value in fp32.
    return {"emulate_precision_casts": True, **_cpu_codegen.compile_options()}


@functools.lru_cache(maxsize=None)
def _compiled(name: str):  # noqa: ANN202 - returns a compiled callable
    return torch.compile(getattr(reference, name), fullgraph=True, dynamic=None, options=compile_options())


def _call(name: str, args: tuple, kwargs: dict):  # noqa: ANN202 - the kernel's own result
    with _cpu_codegen.fused_kernels():  # see [Note: wide tiling], [Note: wide bytes]
        return _compiled(name)(*args, **kwargs)


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


def with_fallback(name: str, on_failure: Callable[[Exception], None]) -> Callable:
    """The fused function ``name`` (one of ``shardopt.kernels.STEP_NAMES``), run as the reference
    for good once it has raised, after ``on_failure(error)`` (see [Note: compile failure])."""
    fused_fn, reference_fn = globals()[name], getattr(reference, name)
    failed = False

    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the kernel's own signature and result
        nonlocal failed
        if not failed:
            try:
                return fused_fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - any compiler failure means: use the reference
                on_failure(e)
                failed = True
        return reference_fn(*args, **kwargs)

    run.__name__ = name
    run.__doc__ = reference_fn.__doc__
    return run
