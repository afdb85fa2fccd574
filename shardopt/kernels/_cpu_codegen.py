"""One addition to inductor's CPU code generator: a vectorised 32-bit bitcast.

[Note: vector bitcast] Inductor's vectorised C++ has no vector form of ``to_dtype_bitcast``
(``Tensor.view(torch.int32)`` on fp32 values inside a compiled graph, and back): it stores the
vector, bit-casts lane by lane in a scalar loop and reloads. Every codec here is written with
such bitcasts (the bf16 cast, the remainder, stochastic rounding, the 8-bit block scales), and
the scalar loops made those fused kernels compute-bound: on one AVX-512 core the bf16 remainder
step took 72 ms per 16M elements against 26 ms with a register reinterpretation, the ``none``
step 47 against 23 (``benchmarks/bench_kernels.py``). ``at::vec::cast`` is exactly that
reinterpretation (``_mm512_castps_si512`` and friends; "without changing the bits
representation", ATen's ``vec_base.h``), so fp32 <-> int32 bitcasts are emitted as it, one
``cast`` per vector of a ``VectorizedN``. Every other bitcast keeps inductor's own code.

The change is semantics-preserving for any program (a bitcast is a bitcast), so it is
installed process-wide, once, before the first fused kernel compiles. On a torch whose code
generator is laid out differently it is not installed and the kernels stay correct, only
slower; :func:`installed` tells which. The fused kernels are tested bit for bit against the
reference either way.
"""
from __future__ import annotations

import torch

_state = {"tried": False, "installed": False}
_VERSION = 1  # bump when the generated code changes
_PAIRS = {(torch.float32, torch.int32), (torch.int32, torch.float32)}


def install() -> bool:
    """Install the vector bitcast (idempotent); True if it is in place. Call on any rank."""
    if _state["tried"]:
        return _state["installed"]
    _state["tried"] = True
    try:
        from torch._inductor.codegen import cpp
        from torch._inductor.codegen.cpp_utils import DTYPE_TO_CPP
        overrides, kernel_type = cpp.CppVecOverrides, cpp.CppVecKernel
        original = overrides.__dict__["to_dtype_bitcast"].__func__
        virtualized = cpp.V
    except (ImportError, AttributeError, KeyError):
        return False

    def to_dtype_bitcast(x, dtype, src_dtype):  # noqa: ANN001, ANN202 - inductor's override signature
        kernel = virtualized.kernel
        if (dtype, src_dtype) in _PAIRS and isinstance(kernel, kernel_type) and getattr(x, "is_vec", False):
            n_vec = kernel._get_num_vectors(src_dtype)
            dst = DTYPE_TO_CPP[dtype]
            if n_vec == 1:
                return f"at::vec::cast<{dst}>({x})"
            if n_vec == 2:  # VectorizedN's widest constructor from vectors
                parts = ", ".join(f"at::vec::cast<{dst}>({x}[{i}])" for i in range(n_vec))
                return f"at::vec::VectorizedN<{dst}, {n_vec}>({parts})"
        return original(x, dtype, src_dtype)

    to_dtype_bitcast.__wrapped__ = original  # type: ignore[attr-defined]
    overrides.to_dtype_bitcast = staticmethod(to_dtype_bitcast)
    _state["installed"] = True
    return True


def installed() -> bool:
    """Whether the vector bitcast is in place in this process."""
    return _state["installed"]


def compile_options() -> dict:
    """Options for ``torch.compile`` of a fused kernel: a no-op post-grad pass whose ``uuid``
    names this code generator, so that inductor's on-disk graph cache, whose key holds the
    compile options but not a code generator's methods, never serves a kernel generated
    without the vector bitcast to a process that has it (or the reverse)."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:
        return {}

    class _CodegenTag(CustomGraphPass):
        def __call__(self, graph) -> None:  # noqa: ANN001 - torch.fx.Graph; changes nothing
            return None

        def uuid(self) -> str:
            return f"shardopt-vector-bitcast-{int(installed())}-{_VERSION}"

    return {"post_grad_custom_post_pass": _CodegenTag()}
