"""The reference step functions compiled by ``torch.compile`` into one fused pass per shard.

On CPU inductor emits vectorised C++ (OpenMP), on GPU Triton. ``dynamic=None`` lets the first
call compile for its exact shape and a second shape switch to a shape-generic kernel, so the
segments of a shard (one per param group) cost at most two compiles per mode and dtype.
On CPU, :mod:`shardopt.kernels._cpu_codegen` vectorises the codecs' bitcasts and, for these
kernels only, runs two vectors per loop iteration with fast 8-bit moves and conversions.
Compilation is lazy; if it fails, :func:`shardopt.kernels.select` falls back to the reference.
"""
from __future__ import annotations

import functools

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
