"""Two additions to inductor's CPU code generator: a vectorised 32-bit bitcast, and wider loops
for the fused kernels that hash random bits.

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

[Note: wide tiling] Inductor vectorises a loop by one vector of fp32 (16 lanes on AVX-512) as
soon as one of the fused stores is fp32, and by two when every store is 16-bit. A kernel that
hashes its random bits (stochastic rounding of the weights or of bf16 moments) runs a chain of
two dependent 32-bit multiplies per vector; with one vector per iteration that chain, not memory,
set the time (16M elements on one core: the stochastic step 38 ms, fp32 master with bf16 moments
40 ms), with two independent vectors per iteration 23 and 24 ms, at the speed of the kernels
without a hash. So, inside :func:`fused_kernels` only, a loop of one fp32 vector is widened to
two unless it touches 8-bit integers (the remainder planes and the 8-bit moments), whose
conversions measured slower wide (the remainder step 25 -> 52 ms).

The bitcast is semantics-preserving for any program (a bitcast is a bitcast), so it is
installed process-wide, once, before the first fused kernel compiles; the wide tiling applies
only while a fused kernel of shardopt compiles. On a torch whose code generator is laid out
differently neither is installed and the kernels stay correct, only slower; :func:`installed`
tells which. The fused kernels are tested bit for bit against the reference either way.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_wide = contextvars.ContextVar("shardopt_wide_tiling", default=False)
_state = {"tried": False, "installed": False, "wide": False}
_VERSION = 2  # bump when the generated code changes
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
    _install_wide_tiling(cpp)
    return True


def _install_wide_tiling(cpp) -> None:  # noqa: ANN001 - inductor's cpp codegen module
    """See [Note: wide tiling]; left out on a torch laid out otherwise."""
    try:
        tiling = cpp.TilingSelect
        original = tiling.__dict__["select_tiling"]
        loop_dtypes, loop_bodies = cpp._get_dtype_from_loopbodies, cpp._get_loop_body
        isa = cpp.cpu_vec_isa.pick_vec_isa()
        fp32_lanes = isa.nelements(dtype=torch.float) if isa else 0
    except (AttributeError, KeyError, TypeError):
        return

    def select_tiling(self, fn_list, var_sizes_list):  # noqa: ANN001, ANN202 - inductor's signature
        factors, indices, stats = original(self, fn_list, var_sizes_list)
        if _wide.get() and fp32_lanes and factors == [fp32_lanes]:
            if not loop_dtypes(loop_bodies(fn_list)) & {torch.int8, torch.uint8}:
                factors = [2 * fp32_lanes]
        return factors, indices, stats

    select_tiling.__wrapped__ = original  # type: ignore[attr-defined]
    tiling.select_tiling = select_tiling
    _state["wide"] = True


@contextlib.contextmanager
def fused_kernels() -> Iterator[None]:
    """Around a call of a fused kernel: code generated inside (its first call, a recompile) gets
    the wide tiling of [Note: wide tiling]."""
    token = _wide.set(True)
    try:
        yield
    finally:
        _wide.reset(token)


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
            return f"shardopt-vector-bitcast-{int(installed())}-wide-{int(_state['wide'])}-{_VERSION}"

    return {"post_grad_custom_post_pass": _CodegenTag()}
