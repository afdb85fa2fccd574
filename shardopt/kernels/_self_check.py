"""A check, before the first fused kernel runs in a process, that this torch's code generator
computes shardopt's codecs bit for bit as they are written.

[Note: self-check] The fused kernels are the reference functions compiled. A code generator that
simplifies a rounding round trip (``x - float(fp16(x))`` folded to 0, as inductor's CPU code did
on some torch builds before the fix for folded fp32 -> fp16 -> fp32 casts) would make the fp16
remainder lose its residual, silently: the weights would still train, only less exactly. So the
codecs every master and moment mode is built from (the bf16 remainder, the fp16 residual,
stochastic rounding to bf16 and fp16, the bf16 moments), and AdamW's moments every step computes
(``lerp`` and ``addcmul``, which eager rounds once per fused multiply-add: see _cpu_codegen
[Note: fused multiply-add]), are compiled once per device with the fused kernels' own options
and compared with eager on hard cases: random bit patterns, exact ties, subnormals, the edges of
fp16's range, infinities and NaNs. The remainders are also checked in the form the fused step
writes them (:func:`remainders_in_place`: the 16-bit weight read from an input, changed and
written back into it, the remainder stored beside it), since a code generator can keep a codec
exact as a new output and still fold it when the rounded value is stored in place (inductor's
CPU code did so for fp16 on torch 2.10 to 2.12). A buffer whose step runs a codec which differs
(:func:`codecs_run`: the fp16 remainder mode's, say) gets the reference kernels when its
:class:`shardopt.kernels.Kernels` is built, with one warning naming the codec and the torch
version; the buffers built from codecs that agree stay fused. About a second, once per process
and device, when the first fused kernels that run a codec are built.

[Note: codecs of a buffer] Which codecs a buffer's step runs follows from what the buffer is made
of: its weight dtype, its master-weight mode and its moments format (:func:`codecs_run`, a table).
tests/test_kernels.py reads the same from the arguments of every kernel call the real strategies
make, for every combination, and checks that the two agree.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch
from torch import Tensor

from shardopt.kernels import codecs, reference

NAMES = ("bf16 weight", "bf16 remainder", "fp16 weight", "fp16 residual", "stochastic bf16", "stochastic fp16",
         "bf16 moments", "AdamW moments", "bf16 remainder written in place", "fp16 residual written in place")


def hard_cases(n: int = 1 << 14, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """(fp32 values, int32 random bits in [0, 2**16)) covering the codecs' hard cases."""
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    ties = (torch.randint(0, 2**16, (n // 8,), generator=g, dtype=torch.int32) << 16 | 0x8000)
    fp16_edges = torch.tensor([65504.0, 65519.0, -65504.0, 2.0**-14, 2.0**-24, 3 * 2.0**-25, 2.0**-16, 1.0 + 2.0**-11,
                               1.0 + 3 * 2.0**-12, 0.0, -0.0, 1e-45, -1e-45, 1.1754944e-38, 3.4028235e38])
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    x = torch.cat([bits.view(torch.float32), ties.view(torch.float32), fp16_edges,
                   torch.randn(n, generator=g) * 100, special]).to(device)
    r = torch.randint(0, 1 << 16, x.shape, generator=g, dtype=torch.int32).to(device)
    return x, r


def all_codecs(x: Tensor, bits: Tensor) -> tuple[Tensor, ...]:
    """Every codec on ``x`` (int32 outputs where a conversion to int16 would make the loop scalar),
    then AdamW's new moments (exp_avg and exp_avg_sq, one tensor) with ``x`` as the gradient."""
    hi, lo = codecs.encode_bf16_bits(x)
    finite16 = torch.where(x.abs() <= 65504, x, torch.zeros_like(x))  # the fp16 residual's domain
    p, q = codecs.encode_fp16_residual(finite16)
    return (hi, lo, p, q, codecs.stochastic_round(x, torch.bfloat16, bits),
            codecs.stochastic_round(x, torch.float16, bits), codecs.stochastic_round_bf16(x, bits),
            torch.cat(adam_moments(x, bits)))


def adam_moments(g: Tensor, bits: Tensor) -> tuple[Tensor, Tensor]:
    """The step's moments from gradient ``g``, old moments of about its size made from ``bits``,
    and the betas of a language model (see reference.adam_moments and _cpu_codegen [Note: fused
    multiply-add]: a compiler that rounds the products and sums apart differs here)."""
    s = reference.make_scalars(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=2, grad_scale=1.0,
                               device=g.device)
    u = bits.float() * 2.0**-16 + 0.5  # in [0.5, 1.5)
    return reference.adam_moments(g, g.roll(1) * u, g.roll(2) * g.roll(2) * u, s)


def remainders_in_place(weights: tuple[Tensor, Tensor], delta: Tensor, rems: tuple[Tensor, Tensor]) -> None:
    """As ``reference.step_remainder`` writes them: each 16-bit weight (bf16, fp16) read, moved by
    ``delta`` and written back in place, its remainder stored into ``rems`` (int32)."""
    bf16, fp16 = weights
    hi, lo = codecs.encode_bf16_bits(bf16.float() - delta)
    bf16.copy_(hi)
    rems[0].copy_(lo)
    w = fp16.float() - delta
    p, q = codecs.encode_fp16_residual(torch.where(w.abs() <= 65504, w, torch.zeros_like(w)))
    fp16.copy_(p)
    rems[1].copy_(q)


def run_all(fns: tuple[Callable, Callable], x: Tensor, bits: Tensor) -> tuple[Tensor, ...]:
    """The codecs' outputs, then the in-place ones (weights and remainders after the write), with
    ``fns`` the (all_codecs, remainders_in_place) to run: eager or compiled."""
    codec_fn, in_place_fn = fns
    finite = torch.where(x.abs() <= 60000, x, torch.zeros_like(x))
    weights = (finite.to(torch.bfloat16), finite.to(torch.float16))
    rems = (torch.zeros_like(x, dtype=torch.int32), torch.zeros_like(x, dtype=torch.int32))
    delta = (bits.float() - 32768) * 2.0**-20  # small moves: each keeps a remainder
    in_place_fn(weights, delta, rems)
    return (*codec_fn(x, bits), torch.cat([weights[0].view(torch.int16).to(torch.int32), rems[0]]),
            torch.cat([weights[1].view(torch.int16).to(torch.int32), rems[1]]))


def _compiled() -> tuple[Callable, Callable]:
    from shardopt.kernels import _cpu_codegen, fused

    options = fused.compile_options()
    compiled = [torch.compile(f, fullgraph=True, options=options) for f in (all_codecs, remainders_in_place)]

    def scoped(fn: Callable) -> Callable:
        def run(*args: object) -> object:
            with _cpu_codegen.fused_kernels(), torch._C.DisableTorchFunction():  # see fused [Note: modes around a kernel]
                return fn(*args)
        return run
    return scoped(compiled[0]), scoped(compiled[1])


def _same(a: Tensor, b: Tensor) -> bool:
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    nan = a.float().isnan() & b.float().isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
    return bool(((a.view(ints) == b.view(ints)) | nan).all())


@functools.cache
def differences(device: str = "cpu") -> tuple[str, ...]:
    """The codecs (of :data:`NAMES`) whose compiled result differs from eager on ``device`` (see
    [Note: self-check]). Compiles once per device per process; raises what compiling raises."""
    x, bits = hard_cases(device=device)
    pairs = zip(NAMES, run_all((all_codecs, remainders_in_place), x, bits), run_all(_compiled(), x, bits))
    return tuple(name for name, want, got in pairs if want.dtype != got.dtype or not _same(want, got))


# step function -> the codecs it writes its 16-bit weight with, by weight dtype
_WEIGHT_CODECS: dict[str, dict[torch.dtype, tuple[str, ...]]] = {
    "step_fp32": {torch.bfloat16: ("bf16 weight",), torch.float16: ("fp16 weight",)},
    "step_none": {torch.bfloat16: ("bf16 weight",), torch.float16: ("fp16 weight",)},
    "step_stochastic": {torch.bfloat16: ("stochastic bf16",), torch.float16: ("stochastic fp16",)},
    "step_remainder": {torch.bfloat16: ("bf16 remainder", "bf16 remainder written in place"),
                       torch.float16: ("fp16 residual", "fp16 residual written in place")},
}


_STEP_OF_MODE = {"fp32": "step_fp32", "remainder": "step_remainder", "stochastic": "step_stochastic",
                 "none": "step_none"}  # master-weight mode -> its step function (see update._master)
_MOMENTS_CODECS = {"fp32": (), "bf16": ("bf16 moments",), "8bit": ()}  # moments format -> its stored codec
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def codecs_run(master: str | None, dtype: torch.dtype | None, moments: str | None) -> tuple[str, ...]:
    """The checked codecs (of :data:`NAMES`, in that order) that the step of a buffer of ``dtype``
    weights, master-weight mode ``master`` and moments format ``moments`` runs (see [Note: codecs of
    a buffer]). A fact given as None stands for every value it can take: the codecs of all of them.
    AdamW's moments every step runs (the 8-bit scan too); fp32 weights run no weight codec in any
    mode (they are their own master)."""
    used = {"AdamW moments"}
    for mode in _STEP_OF_MODE if master is None else (master,):
        by_dtype = _WEIGHT_CODECS[_STEP_OF_MODE[mode]]
        for weight_dtype in _WEIGHT_DTYPES if dtype is None else (dtype,):
            used.update(by_dtype.get(weight_dtype, ()))
    for fmt in _MOMENTS_CODECS if moments is None else (moments,):
        used.update(_MOMENTS_CODECS[fmt])
    return tuple(name for name in NAMES if name in used)


def failing(codecs: Iterable[str], device: str) -> str | None:
    """The first of ``codecs`` that this torch compiles differently from eager on ``device``, or
    None; runs the check (:func:`differences`, cached) only when ``codecs`` is not empty. Raises
    what compiling raises."""
    codecs = tuple(codecs)
    if not codecs:
        return None
    return next((name for name in differences(device) if name in codecs), None)
