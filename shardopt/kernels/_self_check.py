"""A check, before the first fused kernel runs in a process, that this torch's code generator
computes shardopt's codecs bit for bit as they are written.

[Note: self-check] The fused kernels are the reference functions compiled. A code generator that
simplifies a rounding round trip (``x - float(fp16(x))`` folded to 0, as inductor's CPU code did
on some torch builds before the fix for folded fp32 -> fp16 -> fp32 casts) would make the fp16
remainder lose its residual, silently: the weights would still train, only less exactly. So the
codecs every master and moment mode is built from (the bf16 remainder, the fp16 residual,
stochastic rounding to bf16 and fp16, the bf16 moments) are compiled once per device with the
fused kernels' own options and compared with eager on hard cases: random bit patterns, exact
ties, subnormals, the edges of fp16's range, infinities and NaNs. On any difference
:class:`shardopt.kernels.Kernels` uses the reference kernels and warns once, naming the torch
version. About a second on the first use of the fused path (the codecs compile once).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from shardopt.kernels import codecs

NAMES = ("bf16 weight", "bf16 remainder", "fp16 weight", "fp16 residual", "stochastic bf16", "stochastic fp16",
         "bf16 moments")


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
    """Every codec on ``x`` (int32 outputs where a conversion to int16 would make the loop scalar)."""
    hi, lo = codecs.encode_bf16_bits(x)
    finite16 = torch.where(x.abs() <= 65504, x, torch.zeros_like(x))  # the fp16 residual's domain
    p, q = codecs.encode_fp16_residual(finite16)
    return (hi, lo, p, q, codecs.stochastic_round(x, torch.bfloat16, bits),
            codecs.stochastic_round(x, torch.float16, bits), codecs.stochastic_round_bf16(x, bits))


def _compiled() -> Callable[[Tensor, Tensor], tuple[Tensor, ...]]:
    from shardopt.kernels import _cpu_codegen, fused

    compiled = torch.compile(all_codecs, fullgraph=True, options=fused.compile_options())

    def run(x: Tensor, bits: Tensor) -> tuple[Tensor, ...]:
        with _cpu_codegen.fused_kernels():
            return compiled(x, bits)
    return run


def _same(a: Tensor, b: Tensor) -> bool:
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    nan = a.float().isnan() & b.float().isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
    return bool(((a.view(ints) == b.view(ints)) | nan).all())


@functools.lru_cache(maxsize=None)
def first_difference(device: str = "cpu") -> str | None:
    """The first codec whose compiled result differs from eager on ``device`` (see [Note:
    self-check]), or None. Compiles once per device per process; raises what compiling raises."""
    x, bits = hard_cases(device=device)
    for name, want, got in zip(NAMES, all_codecs(x, bits), _compiled()(x, bits)):
        if want.dtype != got.dtype or not _same(want, got):
            return name
    return None
