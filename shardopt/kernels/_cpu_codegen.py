"""Five additions to inductor's CPU code generator: a vectorised 32-bit bitcast, wider loops for
shardopt's fused kernels, fast 8-bit moves and conversions in those loops, a cheap counter, and
the fused multiply-adds that make the kernels round as eager ``torch.addcmul`` and ``torch.lerp`` do.

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
without a hash. Widening pays without a hash too: at one fp32 vector per iteration the 16-bit
loads and stores are half vectors, AVX-512 masked moves (see [Note: wide bytes]), and the
``none`` step took 16.5 ms per 16M elements one vector wide against 6.8 ms two wide. So, inside
:func:`fused_kernels` only, a loop of one fp32 vector is widened to two. A loop that touches
8-bit integers (the remainder planes, the 8-bit moments) is widened too where :data:`_BYTE_OPS`
knows the ISA (AVX-512, AVX2), with the code of [Note: wide bytes].

[Note: wide bytes] Widened, a loop holds half an 8-bit vector per iteration (32 of AVX-512's 64
lanes), and ATen serves three things there slowly: the load and the store of half a vector (an
AVX-512 masked move, which on this CPU stalls the next access to the same cache line; on AVX2 a
copy through a stack buffer), the conversion between one 8-bit and two int32 vectors, and the
conversion between two float and two int32 vectors (both ATen's generic ``VecConvert``, a scalar
loop over the lanes). Inside :func:`fused_kernels` they are emitted as a plain 256-bit (AVX2:
128-bit) move, a sign or zero extension of each quarter (AVX2: eighth) and a truncating
narrowing (a C cast's wrap-around, as eager ``.to(torch.int8)``; on AVX2 a byte shuffle, see
[Note: byte planes and the bf16 weight]), and one ``convert`` per vector. Per 16M elements
on one AVX-512 core (``benchmarks/bench_kernels.py``): the bf16 remainder step 19.3 -> 9.5 ms,
the fp16 remainder 27.5 -> 11.5 ms, the fp16 stochastic step (its float <-> int32 pairs) 12.0 ->
8.5 ms, the 8-bit steps 39-58 -> 27-35 ms; on AVX2 code (``ATEN_CPU_CAPABILITY=avx2``, built
there with 32 registers: see [Note: byte planes and the bf16 weight]) the bf16 remainder 21.2 ->
13.2 ms. Before, widening the remainder made it slower (25 -> 52 ms), so 8-bit loops were left
one vector wide.

[Note: counter vector] The random bits hash each element's global index, which inductor
builds per vector as ``Vectorized<int32_t>::arange(x0, 1)``: ATen's ``arange`` passes sixteen
scalars to a constructor, and the compiler assembles them lane by lane (``vpinsrd`` chains) on
every iteration. Inside :func:`fused_kernels` an integer counter is emitted as the broadcast index
plus ``arange(0, stride)``, whose lanes are constants the compiler folds into one vector: the
same lanes (two's-complement wrap-around either way), one broadcast and one add. Per 16M
elements on one AVX-512 core, the bf16 stochastic step with bf16 moments 11.0 -> 10.1 ms.

[Note: fused multiply-add] torch.optim.AdamW's CPU step rounds its moments once per fused
multiply-add: ATen's CPU kernels of ``addcmul`` and ``lerp`` (the AVX2 and AVX-512 builds) compute
``self + value * t1 * t2`` as ``fma(value * t1, t2, self)`` and ``start + w * (end - start)`` as
``fma(w, end - start, start)`` (``fma(w - 1, end - start, end)`` for ``|w| >= 0.5``), in the
vector body and the scalar tail alike (measured). Inductor's CPU code rounds the product and the
sum apart: it compiles C++ with ``-ffp-contract=off``; torch 2.13 lowers ``addcmul`` (and ``lerp``,
decomposed into it) to a multiply and an add on CPU (to a fused multiply-add on GPUs only), and
torch 2.9 decomposes both ops into multiplies and adds before lowering. Each of those is an ulp off torch's ``exp_avg`` or
``exp_avg_sq`` now and then, and within six steps 1-2 ulps off its weights. So, inside
:func:`fused_kernels`, for fp32 on CPU: inductor's decompositions of ``aten.addcmul`` and
``aten.lerp.Tensor`` step aside (``NotImplemented``), and the two ops lower to ``ops.fma`` in
eager's order, which inductor's CPU code already emits as ``std::fma`` (scalar) and
``at::vec::fmadd`` (one instruction per vector on AVX2 and AVX-512). This is for exactness, not
speed, so it is installed on its own (a torch laid out otherwise for the other additions may
still take it); where it is not in place, the self-check finds the moments differ from eager and
the kernels fall back to the reference (_self_check [Note: self-check]). The compiled sqrt is
the CPU's correctly rounded instruction, which eager's need not be (MKL's): see
docs/semantics.md for what is bit for bit with torch.optim.AdamW.

[Note: scoped to shardopt's kernels] The methods are replaced once, before the first fused
kernel compiles, but every replacement emits its own code only while a fused kernel of shardopt
compiles (the context variable :func:`fused_kernels` sets) and calls inductor's own method
otherwise: a user's ``torch.compile`` generates the same code with shardopt imported or not
(tested). On a torch whose code generator is laid out differently nothing is installed and the
kernels stay correct, only slower; :func:`installed` tells which. The fused kernels are tested
bit for bit against the reference either way.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

_ours = contextvars.ContextVar("shardopt_fused_kernel", default=False)  # see [Note: scoped to shardopt's kernels]
_state: dict[str, Any] = {"tried": False, "installed": False, "wide": False, "bytes": "", "counter": False, "fma": None}
_VERSION = 7  # bump when the generated code changes
_PAIRS = {(torch.float32, torch.int32), (torch.int32, torch.float32)}


def install() -> bool:
    """Install the additions (idempotent); True if the vector bitcast is in place. Call on any rank."""
    if _state["fma"] is None:
        _state["fma"] = _install_fma()
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
        if (_ours.get() and (dtype, src_dtype) in _PAIRS and isinstance(kernel, kernel_type)
                and getattr(x, "is_vec", False)):
            n_vec = kernel._get_num_vectors(src_dtype)
            dst = DTYPE_TO_CPP[dtype]
            if n_vec == 1:
                return f"at::vec::cast<{dst}>({x})"
            if n_vec == 2:
                return _per_vector("cast", dst, x)
        return original(x, dtype, src_dtype)

    to_dtype_bitcast.__wrapped__ = original  # type: ignore[attr-defined]
    overrides.to_dtype_bitcast = staticmethod(to_dtype_bitcast)  # type: ignore[method-assign]  # patching inductor
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

    isa_name = _isa_name(isa) if fp32_lanes else ""
    byte_ops = _BYTE_OPS.get(isa_name)
    if byte_ops is not None and not _install_wide_bytes(cpp, byte_ops, 2 * fp32_lanes):
        byte_ops = None

    def select_tiling(self, fn_list, var_sizes_list):  # noqa: ANN001, ANN202 - inductor's signature
        factors, indices, *rest = original(self, fn_list, var_sizes_list)  # torch 2.13 adds op statistics
        if _ours.get() and fp32_lanes and factors == [fp32_lanes] and (
                byte_ops is not None or not loop_dtypes(loop_bodies(fn_list)) & set(_BYTES)):
            factors = [2 * fp32_lanes]
        return (factors, indices, *rest)

    select_tiling.__wrapped__ = original  # type: ignore[attr-defined]
    tiling.select_tiling = select_tiling
    _install_counter(cpp)
    _state["wide"] = True
    _state["bytes"] = isa_name if byte_ops is not None else ""


def _methods(owner: type, expected: dict[str, list[str]]) -> dict | None:
    """The methods ``owner`` defines itself under ``expected``'s names, if each takes exactly the
    listed parameters (the code generator these additions were written against); else None."""
    try:
        found = {name: owner.__dict__[name] for name in expected}
        if all(list(inspect.signature(found[name]).parameters) == params for name, params in expected.items()):
            return found
    except (KeyError, TypeError, ValueError):
        pass
    return None


def _replace(owner: type, wrappers: dict, originals: dict) -> None:
    """Install each wrapper over the method of its name, keeping the original as ``__wrapped__``."""
    for name, fn in wrappers.items():
        fn.__wrapped__ = originals[name]
        setattr(owner, name, fn)


def _install_counter(cpp) -> None:  # noqa: ANN001 - inductor's cpp codegen module
    """See [Note: counter vector]; left out on a torch laid out otherwise."""
    kernel_type: Any = getattr(cpp, "CppVecKernel", None)  # inductor's class
    originals = _methods(kernel_type, {"arange": ["self", "index", "stride"]}) if kernel_type else None
    if originals is None:
        return
    original = originals["arange"]

    def arange(self, index, stride):  # noqa: ANN001, ANN202 - inductor's signature
        if not (_ours.get() and type(self) is kernel_type and index.dtype in (torch.int32, torch.int64)):
            return original(self, index, stride)
        vec = self._get_vec_type(index.dtype)
        var = self.cse.generate(self.compute, f"({vec}({index}) + {vec}::arange(0, {stride}))")
        var.dtype, var.is_vec = index.dtype, True
        return var

    _replace(kernel_type, {"arange": arange}, originals)
    _state["counter"] = True


def _install_fma() -> bool:
    """See [Note: fused multiply-add]; False (nothing installed) on a torch laid out otherwise."""
    try:
        from torch._inductor import decomposition, lowering
        from torch._inductor.codegen import cpp
        from torch._inductor.ir import Pointwise
        from torch._inductor.virtualized import ops
        from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND

        tables = (decomposition.decompositions, decomposition.select_decomp_table())
        transform_args, fallback, lowerings = lowering.transform_args, lowering.fallback_handler, lowering.lowerings
        if not all("fma" in t.__dict__ for t in (cpp.CppOverrides, cpp.CppVecOverrides)):
            return False  # ops.fma would be a multiply and an add
    except (ImportError, AttributeError):
        return False
    aten = torch.ops.aten
    promote = ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT

    def ours(*tensors) -> bool:  # noqa: ANN002 - fake tensors (decomposing) or IR nodes (lowering)
        def cpu_fp32(t) -> bool:  # noqa: ANN001
            if isinstance(t, torch.Tensor):
                return t.device.type == "cpu" and t.dtype == torch.float32
            device = getattr(t, "get_device", lambda: None)()
            return device is not None and device.type == "cpu" and t.get_dtype() == torch.float32
        return _ours.get() and all(cpu_fp32(t) for t in tensors)

    def step_aside(original):  # noqa: ANN001, ANN202 - a decomposition
        def decompose(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return NotImplemented if ours(*args[:3]) else original(*args, **kwargs)
        decompose.__wrapped__ = original  # type: ignore[attr-defined]
        return decompose

    def pointwise(args: list, body):  # noqa: ANN001, ANN202 - three fp32 IR nodes, broadcast together
        args, _ = transform_args(args, {}, True, promote, False)
        loaders = [a.make_loader() for a in args]
        return Pointwise.create(device=args[0].get_device(), dtype=args[0].get_dtype(), ranges=args[0].get_size(),
                                inner_fn=lambda idx: body(*(load(idx) for load in loaders)))

    def addcmul(self, tensor1, tensor2, *, value=1):  # noqa: ANN001, ANN202 - aten.addcmul's signature
        if not (ours(self, tensor1, tensor2) and isinstance(value, (int, float))):
            return originals[aten.addcmul.default](self, tensor1, tensor2, value=value)

        def body(a, t1, t2):  # noqa: ANN001, ANN202 - eager: (value * t1) * t2 + a, one rounding
            return ops.fma(t1 if value == 1 else ops.mul(ops.constant(value, torch.float32), t1), t2, a)
        return pointwise([self, tensor1, tensor2], body)

    def lerp(start, end, weight):  # noqa: ANN001, ANN202 - aten.lerp.Tensor's signature
        if not ours(start, end, weight):
            return originals[aten.lerp.Tensor](start, end, weight)

        def body(s, e, w):  # noqa: ANN001, ANN202 - ATen's lerp_vec: coefficient and base by |w| < 0.5
            small = ops.lt(ops.abs(w), ops.constant(0.5, torch.float32))
            coeff = ops.where(small, w, ops.sub(w, ops.constant(1.0, torch.float32)))
            return ops.fma(coeff, ops.sub(e, s), ops.where(small, s, e))
        return pointwise([start, end, weight], body)

    replacements = {aten.addcmul.default: addcmul, aten.lerp.Tensor: lerp}
    # an op without a lowering of its own (decomposed) falls back as inductor would, should one reach it
    originals = {op: lowerings.get(op) or fallback(op, add_to_fallback_set=False) for op in replacements}
    for table in {id(t): t for t in tables}.values():  # select_decomp_table() may return the first itself
        for op in replacements:
            if op in table:
                table[op] = step_aside(table[op])
    for op, fn in replacements.items():
        fn.__wrapped__ = originals[op]  # type: ignore[attr-defined]
        lowerings[op] = fn
    return True


def _per_vector(op: str, dst: str, x: object) -> str:
    """``at::vec::<op><dst>`` applied to each vector of the two-vector value ``x``."""
    return f"at::vec::VectorizedN<{dst},2>(at::vec::{op}<{dst}>({x}[0]), at::vec::{op}<{dst}>({x}[1]))"


def _isa_name(isa) -> str:  # noqa: ANN001 - inductor's VecISA
    """"avx512", "avx2" or "" (another ISA, or none), for :data:`_BYTE_OPS`."""
    from torch._inductor import cpu_vec_isa

    if isinstance(isa, getattr(cpu_vec_isa, "VecAVX512", ())):
        return "avx512"
    if isinstance(isa, getattr(cpu_vec_isa, "VecAVX2", ())):
        return "avx2"
    return ""


_BYTES = {torch.int8: "int8_t", torch.uint8: "uint8_t"}

# [Note: wide bytes], per ISA: {T} the 8-bit C++ type, {P} a pointer, {V} / {X} a vector
# expression, {E} "epi8" or "epu8" (sign or zero extension).
_BYTE_OPS = {
    "avx512": {
        "load": "at::vec::Vectorized<{T}>(_mm512_castsi256_si512(_mm256_loadu_si256("
                "reinterpret_cast<const __m256i*>({P}))))",
        "store": "_mm256_storeu_si256(reinterpret_cast<__m256i*>({P}), _mm512_castsi512_si256({V}));",
        "widen": "at::vec::VectorizedN<int32_t,2>("
                 "at::vec::Vectorized<int32_t>(_mm512_cvt{E}_epi32(_mm512_castsi512_si128({X}))), "
                 "at::vec::Vectorized<int32_t>(_mm512_cvt{E}_epi32(_mm512_extracti32x4_epi32({X}, 1))))",
        "narrow": "at::vec::Vectorized<{T}>(_mm512_inserti32x4(_mm512_castsi128_si512("
                  "_mm512_cvtepi32_epi8({X}[0])), _mm512_cvtepi32_epi8({X}[1]), 1))",
    },
    "avx2": {
        "load": "at::vec::Vectorized<{T}>(_mm256_castsi128_si256(_mm_loadu_si128("
                "reinterpret_cast<const __m128i*>({P}))))",
        "store": "_mm_storeu_si128(reinterpret_cast<__m128i*>({P}), _mm256_castsi256_si128({V}));",
        "widen": "at::vec::VectorizedN<int32_t,2>("
                 "at::vec::Vectorized<int32_t>(_mm256_cvt{E}_epi32(_mm256_castsi256_si128({X}))), "
                 "at::vec::Vectorized<int32_t>(_mm256_cvt{E}_epi32(_mm_srli_si128(_mm256_castsi256_si128({X}), 8))))",
        # byte {K} of each int32 lane (K = 0: the low byte, a C cast's wrap-around): a byte shuffle
        # gathers it in each 128-bit half of both vectors, and one unpack and one lane permute put
        # the sixteen bytes in order (see [Note: wide bytes], [Note: byte planes and the bf16 weight])
        "narrow": "at::vec::Vectorized<{T}>(_mm256_castsi128_si256([&]() {{ "
                  "const __m256i s_ = _mm256_setr_epi8({M}, {M}); "
                  "const __m256i u_ = _mm256_unpacklo_epi32(_mm256_shuffle_epi8({X}[0], s_), "
                  "_mm256_shuffle_epi8({X}[1], s_)); "
                  "return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(u_, "
                  "_mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))); }}()))",
        # two fp32 vectors whose low 16 bits are zero -> bf16: their high halves (what rounding to
        # nearest even leaves of them), NaN as ATen's AVX2 conversion writes it (0xFFFF)
        "bf16_high": "at::vec::Vectorized<at::BFloat16>([&]() {{ const __m256i f_ = _mm256_set1_epi32(0xFFFF); "
                     "const __m256 a_ = {X}[0], b_ = {X}[1]; "
                     "const __m256i x_ = _mm256_blendv_epi8(f_, _mm256_srli_epi32(_mm256_castps_si256(a_), 16), "
                     "_mm256_castps_si256(_mm256_cmp_ps(a_, a_, _CMP_ORD_Q))); "
                     "const __m256i y_ = _mm256_blendv_epi8(f_, _mm256_srli_epi32(_mm256_castps_si256(b_), 16), "
                     "_mm256_castps_si256(_mm256_cmp_ps(b_, b_, _CMP_ORD_Q))); "
                     "return _mm256_permute4x64_epi64(_mm256_packus_epi32(x_, y_), 0xD8); }}())",
    },
}


def _install_wide_bytes(cpp, ops: dict, wide: int) -> bool:  # noqa: ANN001 - inductor's cpp codegen module
    """The code of [Note: wide bytes] for loops of ``wide`` elements (two fp32 vectors), inside
    :func:`fused_kernels` only; False (nothing installed) on a torch laid out otherwise."""
    try:
        kernel_type, cexpr_index, indented = cpp.CppVecKernel, cpp.cexpr_index, cpp.IndentedBuffer
    except AttributeError:
        return False
    originals = _methods(kernel_type, {"_get_vec_load_line": ["self", "var", "index", "dtype", "load_mask"],
                                       "_get_store_line": ["self", "value", "var", "index", "dtype", "accu_store"],
                                       "get_to_dtype_expr": ["self", "src", "dtype", "src_dtype", "rounding"]})
    if originals is None:
        return False  # a code generator laid out otherwise: 8-bit loops stay one vector wide
    load_line, store_line, dtype_expr = originals.values()

    def widened(kernel) -> bool:  # noqa: ANN001 - a CppVecKernel of a loop widened by [Note: wide tiling]
        return (_ours.get() and type(kernel) is kernel_type
                and getattr(kernel, "tiling_factor", None) == wide and hasattr(kernel, "tail_size"))

    def whole(kernel) -> bool:  # noqa: ANN001 - its body, where every vector is full (not the tail)
        return widened(kernel) and kernel.tail_size is None

    def get_vec_load_line(self, var, index, dtype, load_mask=None):  # noqa: ANN001, ANN202
        if dtype in _BYTES and load_mask is None and whole(self):
            ptr = f"{var} + {cexpr_index(index)}" if index != 0 else var
            return ops["load"].format(T=_BYTES[dtype], P=ptr)
        return load_line(self, var, index, dtype, load_mask)

    def get_store_line(self, value, var, index, dtype, accu_store=False):  # noqa: ANN001, ANN202
        if dtype in _BYTES and not accu_store and whole(self) and \
                self._try_get_const_stride(index, self.itervars[self.tiling_idx]) == 1:
            code = indented()
            code.writeline(ops["store"].format(P=f"{var} + {cexpr_index(index)}", V=value))
            return code
        return store_line(self, value, var, index, dtype, accu_store)

    def get_to_dtype_expr(self, src, dtype, src_dtype, rounding=False):  # noqa: ANN001, ANN202
        if getattr(src, "is_vec", False) and not rounding and widened(self):
            if src_dtype in _BYTES and dtype == torch.int32:
                return ops["widen"].format(X=src, E="epi8" if src_dtype == torch.int8 else "epu8")
            if dtype in _BYTES and src_dtype == torch.int32:
                source, byte = _byte_of(self, src) if "{M}" in ops["narrow"] else (src, 0)
                return ops["narrow"].format(X=source, T=_BYTES[dtype], M=_byte_lanes(byte))
            if {src_dtype, dtype} == {torch.int32, torch.float32}:
                return _per_vector("convert", "int32_t" if dtype == torch.int32 else "float", src)
            if (dtype == torch.bfloat16 and src_dtype == torch.float32 and "bf16_high" in ops
                    and _low_half_zero(self, src)):
                return ops["bf16_high"].format(X=src)
        return dtype_expr(self, src, dtype, src_dtype, rounding)

    _replace(kernel_type, {"_get_vec_load_line": get_vec_load_line, "_get_store_line": get_store_line,
                           "get_to_dtype_expr": get_to_dtype_expr}, originals)
    return True


# [Note: byte planes and the bf16 weight] What the bf16 remainder step writes, read off the code
# generated before it. The step stores its remainder r (int32) as two int8 planes,
# ((r << 24) >> 24).to(int8) and (r >> 8).to(int8) (codecs.split_remainder_), and its weight as
# the fp32 pattern (bits + 0x8000) & -65536 converted to bf16 (codecs.encode_bf16_bits). On AVX2
# all three were dear: the shifts cost a vector shift per vector each, every narrowing masked,
# packed and permuted six times per two vectors, and ATen's fp32 -> bf16 conversion rounds to
# nearest even (four integer operations per vector) a value with nothing below its top 16 bits to
# round; with AVX2's 16 vector registers (AVX-512 has 32) the loop also spills. On an AVX2-only
# AMD EPYC the bf16 remainder step ran at 1.16x torch's fused AdamW plus casts on 16M elements,
# against at most 1.10x on AVX-512. (AVX2 code built on an AVX-512 host with inductor's default
# -march=native gets 32 registers and EVEX instructions, and understates this: build with
# TORCHINDUCTOR_CPP_MARCH=x86-64-v3 and ATEN_CPU_CAPABILITY=avx2 to time true AVX2 code there.)
# So inside a widened AVX2 loop (:func:`fused_kernels`) a narrowing to 8 bits is emitted as the
# byte it keeps, gathered from each 128-bit half by one byte shuffle per vector, then one unpack
# and one lane permute; the low byte of (x >> 8k) is byte k of x and that of (x << 24) >> 24 is
# byte 0 of x, so those are read from x (the shifts are left unused and the C++ compiler drops
# them). An fp32 -> bf16 conversion of an int32 pattern masked with a constant whose low 16 bits
# are zero is the high half of each lane, NaN written 0xFFFF as ATen's AVX2 conversion writes it.
# Both are bit selections: the same bytes and bf16 patterns as inductor's own code on every input,
# NaNs included (tests/test_kernels.py::check_wide_byte_code, full-range values). The patterns are
# read from what the code generator already emitted (the expressions in the kernel's
# common-subexpression cache); anything else keeps the general form. The bf16 remainder step's
# loop on 16K elements (in cache, true AVX2 code on a shared Xeon): 0.755 -> 0.635 ns per element;
# its main loop under llvm-mca's models, per 16 elements: Zen 2 161 -> 132 cycles, Zen 3 57 -> 46.
_SHIFT = re.compile(r"(\w+) (<<|>>) (\w+)")
_AND = re.compile(r"(\w+) & (\w+)")
_INT_CONSTANT = re.compile(r"static_cast<int32_t>\((-?\d+)\)")


def _definitions(kernel: Any) -> dict[str, tuple[str, Any]]:
    """The expression and the variable of each name the kernel's common-subexpression cache holds."""
    cache = getattr(getattr(kernel, "cse", None), "_cache", None)
    found: dict[str, tuple[str, Any]] = {}
    for key, var in (cache.items() if isinstance(cache, Mapping) else ()):
        if isinstance(key, str) and isinstance(getattr(var, "name", None), str):
            found.setdefault(var.name, (key, var))
    return found


def _int32_vector(defs: dict, name: str) -> bool:
    var = defs.get(name, ("", None))[1]
    return getattr(var, "dtype", None) == torch.int32 and getattr(var, "is_vec", False)


def _broadcast_constant(kernel: Any, defs: dict, name: str) -> int | None:
    """The int32 constant that vector ``name`` holds in every lane, if it is a broadcast constant."""
    inner = re.fullmatch(re.escape(kernel._get_vec_type(torch.int32)) + r"\((\w+)\)", defs.get(name, ("",))[0])
    constant = _INT_CONSTANT.fullmatch(defs.get(inner.group(1), ("",))[0]) if inner else None
    return int(constant.group(1)) if constant else None


def _byte_of(kernel: Any, src: Any) -> tuple[Any, int]:
    """(x, k) with byte k of each int32 lane of x the low byte of ``src``'s (see [Note: byte planes
    and the bf16 weight]); (src, 0) where ``src`` is no such shift."""
    defs = _definitions(kernel)
    outer = _SHIFT.fullmatch(defs.get(src.name, ("",))[0])
    if outer is None or outer.group(2) != ">>" or not _int32_vector(defs, outer.group(1)):
        return src, 0
    shift = _broadcast_constant(kernel, defs, outer.group(3))
    inner = _SHIFT.fullmatch(defs[outer.group(1)][0])
    if (shift == 24 and inner is not None and inner.group(2) == "<<" and _int32_vector(defs, inner.group(1))
            and _broadcast_constant(kernel, defs, inner.group(3)) == 24):
        return defs[inner.group(1)][1], 0
    if shift in (8, 16, 24):
        return defs[outer.group(1)][1], shift // 8
    return src, 0


def _byte_lanes(k: int) -> str:
    """The byte-shuffle indices of one 128-bit half that gather byte ``k`` of its four int32 lanes."""
    return ", ".join([str(4 * lane + k) for lane in range(4)] + ["-1"] * 12)


def _low_half_zero(kernel: Any, src: Any) -> bool:
    """Whether fp32 vector ``src`` is the bitcast of an int32 vector masked with a constant whose
    low 16 bits are zero (see [Note: byte planes and the bf16 weight])."""
    defs = _definitions(kernel)
    cast = re.fullmatch(r"at::vec::VectorizedN<float,2>\(at::vec::cast<float>\((\w+)\[0\]\), "
                        r"at::vec::cast<float>\(\1\[1\]\)\)", defs.get(src.name, ("",))[0])
    masked = _AND.fullmatch(defs.get(cast.group(1), ("",))[0]) if cast and _int32_vector(defs, cast.group(1)) else None
    if masked is None:
        return False
    masks = (_broadcast_constant(kernel, defs, name) for name in masked.groups())
    return any(mask is not None and mask & 0xFFFF == 0 for mask in masks)


@contextlib.contextmanager
def fused_kernels() -> Iterator[None]:
    """Around a call of a fused kernel: code generated inside (its first call, a recompile) gets
    every addition of this module; outside, inductor's own code (see [Note: scoped to shardopt's kernels])."""
    token = _ours.set(True)
    try:
        yield
    finally:
        _ours.reset(token)


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
            return (f"shardopt-vector-bitcast-{int(installed())}-wide-{int(_state['wide'])}"
                    f"-bytes-{_state['bytes'] or 'no'}-counter-{int(_state['counter'])}"
                    f"-fma-{int(bool(_state['fma']))}-{_VERSION}")

    return {"post_grad_custom_post_pass": _CodegenTag()}
