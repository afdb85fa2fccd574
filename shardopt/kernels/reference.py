"""The AdamW update and the master-weight codecs in plain PyTorch: the oracle.

Every function here is written once and serves twice: run eagerly it is the readable reference;
compiled by ``torch.compile`` (``kernels/fused.py``) the same code becomes one fused pass over
the shard. Per-step scalars arrive as 0-d fp32 tensors (see :func:`make_scalars`) so that a new
learning rate or step number never triggers a recompile.

The AdamW math follows ``torch.optim.AdamW`` operation for operation: decoupled weight decay,
then the moments, then the bias-corrected step ``w -= step_size * m / (sqrt(v) / sqrt(bc2) + eps)``.

[Note: the 16-bit cast]
The 16-bit weight is the fp32 master rounded to the parameter dtype. For bf16 we round half away
from zero (``hi = (bits + 0x8000) >> 16`` on the int32 pattern), not half to even: it equals
round-to-nearest except on exact ties (2**-16 of values, one ulp larger in magnitude there), and
it is the only rounding for which a 16-bit remainder rebuilds the fp32 master bit for bit (an
even bf16 value is the image of 2**16 + 1 fp32 values under round-half-even). Every mode uses this
cast, so ``fp32`` and ``remainder`` follow bit-identical trajectories. fp16 uses
round-to-nearest-even; its remainder is a scaled residual instead of a bit suffix.

[Note: fp16 remainder]
fp16 is not a bit prefix of fp32. We keep p = rne_fp16(w) as the weight and an int16 q with
w = p + q * 2**(max(e, 1) - 40), where e is p's biased exponent field (2**(e-40) is p's ulp times
2**-15). |w - p| <= ulp(p) / 2 gives |q| <= 2**14, and the fp32 grid of w is never finer than
2**(e-40) when |w| >= 2**-16, so w is rebuilt exactly for 2**-16 <= |w| <= 65504 (and w = 0);
below, within 2**-40 absolute. No 16-bit side buffer can do better: about 2**31 fp32 values round
to fp16 zero or subnormals.

[Note: stochastic rounding]
w is rounded down or up to a neighbouring 16-bit value with probability proportional to its
distance, so E[round(w)] = w. The random bits come from a counter-based hash of (seed, step,
global element offset): the same element gets the same bits whatever the number of ranks, and a
resumed run repeats exactly. Only as many random bits are used as the rounding discards, so the
floor below is exact and the rounding unbiased (for normal numbers).
"""
from __future__ import annotations

import torch
from torch import Tensor

Scalars = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]

_MASK32 = 0xFFFFFFFF


def make_scalars(*, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                 grad_scale: float, device: torch.device | str = "cpu") -> Scalars:
    """Per-step scalars as 0-d fp32 tensors, computed in Python doubles exactly as torch.optim.AdamW does:
    (decay factor, 1 - beta1, beta2, 1 - beta2, step size, sqrt of bias correction 2, eps)."""
    values = (1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1**step),
              (1 - beta2**step) ** 0.5, eps)
    t = torch.tensor(values, dtype=torch.float32, device=device)
    scale = torch.tensor(grad_scale, dtype=torch.float32, device=device)
    return (*t.unbind(), scale)  # type: ignore[return-value]


def adamw_math(w: Tensor, grad: Tensor, m: Tensor, v: Tensor, s: Scalars) -> tuple[Tensor, Tensor, Tensor]:
    """One AdamW step on fp32 ``w`` (functional): returns (w, m, v). ``grad`` in any float dtype is
    multiplied by the gradient scale (1 / loss scale times the clip coefficient) in fp32."""
    decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, grad_scale = s
    g = grad.float() * grad_scale
    w = w * decay  # decoupled weight decay, before the Adam step
    m = torch.lerp(m, g, one_minus_beta1)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = v.sqrt() / bc2_sqrt + eps
    w = w + (-step_size * m) / denom
    return w, m, v


# -- casts and codecs -------------------------------------------------------------------
def round_to_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Round fp32 ``x`` to ``dtype`` with shardopt's cast (see [Note: the 16-bit cast])."""
    if dtype == torch.bfloat16:
        return encode_bf16(x)[0]
    return x.to(dtype)


def encode_bf16(x: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 -> (bf16 weight rounded half away from zero, int16 remainder); exact inverse of decode_bf16.

    Written with 32-bit integer ops and a final exact fp32 -> bf16 conversion (the masked value is
    already a bf16 value) because that form stays vectorised when compiled."""
    bits = x.view(torch.int32)
    hi_bits = (bits + 0x8000) & -65536  # the top 16 bits, rounded half away from zero
    return hi_bits.view(torch.float32).to(torch.bfloat16), (bits - hi_bits).to(torch.int16)


def decode_bf16(hi: Tensor, lo: Tensor) -> Tensor:
    """(bf16 weight, int16 remainder) -> the fp32 master, bit for bit."""
    return (hi.float().view(torch.int32) + lo.to(torch.int32)).view(torch.float32)


def _fp16_residual_scale(p: Tensor) -> Tensor:
    """2**(max(e, 1) - 40) for fp16 ``p`` with biased exponent field e, as fp32 (see [Note: fp16 remainder]).

    Read off the fp32 exponent of float(p): e - 15 + 127, at least 113 for fp16 zeros and subnormals."""
    exp32 = p.float().view(torch.int32) & 0x7F800000
    return (torch.clamp(exp32, min=113 << 23) - (25 << 23)).view(torch.float32)


def encode_fp16(x: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 -> (fp16 weight rounded to nearest even, int16 residual q)."""
    p = x.to(torch.float16)
    q = torch.round((x - p.float()) / _fp16_residual_scale(p))
    return p, q.to(torch.int16)


def decode_fp16(p: Tensor, q: Tensor) -> Tensor:
    """(fp16 weight, int16 residual) -> the fp32 master (exact for 2**-16 <= |w| <= 65504)."""
    base = p.float()
    return torch.where(q == 0, base, base + q.float() * _fp16_residual_scale(p))  # keeps -0.0 negative


def random_bits(seed: Tensor, step: Tensor, offset: Tensor, n: int) -> Tensor:
    """``n`` pseudo-random 32-bit values (int64 in [0, 2**32)) for global elements offset..offset+n-1
    at ``step``: a counter-based integer hash, so no state beyond (seed, step, offset)."""
    idx = torch.arange(n, dtype=torch.int64, device=offset.device) + offset
    x = (idx * 0x9E3779B1 + step * 0x632BE5AB + seed * 0x2545F491) & _MASK32
    for mul in (0x7FEB352D, 0x5BD1E995):  # multipliers below 2**31 keep every product inside int64
        x = x ^ (x >> 16)
        x = (x * mul) & _MASK32
    return x ^ (x >> 15)


def stochastic_round(x: Tensor, dtype: torch.dtype, bits: Tensor) -> Tensor:
    """Round fp32 ``x`` to ``dtype`` up or down at random, unbiased, using 32-bit ``bits`` (int64)."""
    mant, emin = (7, -126) if dtype == torch.bfloat16 else (10, -14)
    discarded = 23 - mant  # random bits needed: exactly what the rounding throws away
    e = ((x.view(torch.int32) >> 23) & 0xFF) - 127
    ulp = ((torch.clamp(e, min=emin) - mant + 127) << 23).view(torch.float32)
    u = (bits >> (32 - discarded)).float() * (2.0 ** -discarded)
    return (torch.floor(x / ulp + u) * ulp).to(dtype)


# -- one step per master-weight mode: decode, AdamW, encode, in place -----------------------
def step_fp32(master: Tensor, grad: Tensor, m: Tensor, v: Tensor, s: Scalars, param_out: Tensor | None) -> None:
    """fp32 master (updated in place); the rounded weight goes to ``param_out`` when given."""
    w, m_new, v_new = adamw_math(master, grad, m, v, s)
    master.copy_(w)
    m.copy_(m_new)
    v.copy_(v_new)
    if param_out is not None:
        param_out.copy_(round_to_dtype(w, param_out.dtype))


def step_remainder(param: Tensor, rem: Tensor, grad: Tensor, m: Tensor, v: Tensor, s: Scalars) -> None:
    """16-bit weight + int16 remainder hold the exact fp32 master."""
    if param.dtype == torch.bfloat16:
        w, m_new, v_new = adamw_math(decode_bf16(param, rem), grad, m, v, s)
        hi, lo = encode_bf16(w)
    else:
        w, m_new, v_new = adamw_math(decode_fp16(param, rem), grad, m, v, s)
        hi, lo = encode_fp16(w)
    param.copy_(hi)
    rem.copy_(lo)
    m.copy_(m_new)
    v.copy_(v_new)


def step_stochastic(param: Tensor, grad: Tensor, m: Tensor, v: Tensor, s: Scalars, seed: Tensor, step: Tensor,
                    offset: Tensor) -> None:
    """No master: the fp32 result is rounded stochastically into the 16-bit weight."""
    w, m_new, v_new = adamw_math(param.float(), grad, m, v, s)
    param.copy_(stochastic_round(w, param.dtype, random_bits(seed, step, offset, param.numel())))
    m.copy_(m_new)
    v.copy_(v_new)


def step_none(param: Tensor, grad: Tensor, m: Tensor, v: Tensor, s: Scalars) -> None:
    """No master: fp32 recomputed from the 16-bit weight, rounded to nearest again (lossy)."""
    w, m_new, v_new = adamw_math(param.float(), grad, m, v, s)
    param.copy_(round_to_dtype(w, param.dtype))
    m.copy_(m_new)
    v.copy_(v_new)


def adamw_update_(master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, lr: float, beta1: float,
                  beta2: float, eps: float, weight_decay: float, step: int, grad_scale: float = 1.0,
                  param_out: Tensor | None = None) -> None:
    """Convenience form of :func:`step_fp32` with Python-number hyperparameters."""
    s = make_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                     grad_scale=grad_scale, device=master.device)
    step_fp32(master, grad, exp_avg, exp_avg_sq, s, param_out)
