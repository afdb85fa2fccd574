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

[Note: 16-bit moments]
With ``moments="bf16"`` both moments are stored in bf16 (8 significant bits). ``exp_avg`` is
rounded to nearest: it moves by ``1 - beta1`` (10%) of the way to each new gradient, far more than
its rounding. ``exp_avg_sq`` is rounded stochastically (stream 2 of the random bits): with
``beta2 = 0.999`` its decay ``v * 0.999`` is below half an ulp of ``v``, so round to nearest gives
back ``v`` and a large gradient, once seen, never decays: measured after a spike, nearest left
``v`` 20x too large after 3000 steps (the updates 4.5x too small), stochastic rounding within 0.2%
(``benchmarks/bench_fidelity.py --part moments``, micro table).

[Note: 8-bit moments]
With ``moments="8bit"`` each moment is one byte per element plus one fp32 scale per block of
``MOMENT_BLOCK`` elements. A block is a run of elements in the flat buffer's global coordinates;
the layout aligns every parameter and every shard boundary to ``MOMENT_BLOCK``, so a block never
holds two parameters (a small-gradient tensor quantised against a large one loses its
``exp_avg_sq`` while its ``exp_avg`` survives: oversized updates) and is the same set of elements
at any world size. The code, chosen by measurement on a recorded GPT gradient stream:
``exp_avg`` linear, ``round(m / max|m| * 127)`` in int8; ``exp_avg_sq`` through its square root,
linear, ``round(sqrt(v) / max sqrt(v) * 255)`` in uint8, rounded up with the probability that makes
``v`` itself unbiased (the square root halves the dynamic range
and is what the update divides by; ``v`` itself, linear, gave oversized updates on thousands of
elements per run; ``benchmarks/bench_moment_codes.py``). Both rounded stochastically (streams 1 and
2): as with bf16, round to nearest leaves a decaying element at its old code for good (17x
too large in the same micro measurement, 0.99x stochastically). Decoding clamps ``|m|`` to the bound exact
Adam obeys, ``|m| <= (1 - b1) / sqrt((1 - b2) (1 - b1**2 / b2)) * sqrt(v)`` (Cauchy-Schwarz
over the two exponential sums), so a block whose ``sqrt(v)`` code rounded to zero gives no update
rather than ``m / eps``.
"""
from __future__ import annotations

import torch
from torch import Tensor

Scalars = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]

_MASK32 = 0xFFFFFFFF
MOMENT_BLOCK = 64  # elements per scale of the 8-bit moments (see [Note: 8-bit moments])
_TINY = 1e-38


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
    hi, r = _encode_bf16_bits(x)
    return hi, r.to(torch.int16)


def _encode_bf16_bits(x: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`encode_bf16` with the remainder as int32."""
    bits = x.view(torch.int32)
    hi_bits = (bits + 0x8000) & -65536  # the top 16 bits, rounded half away from zero
    return hi_bits.view(torch.float32).to(torch.bfloat16), bits - hi_bits


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
    p, q = _encode_fp16_residual(x)
    return p, q.to(torch.int16)


def _encode_fp16_residual(x: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`encode_fp16` with the residual as int32."""
    p = x.to(torch.float16)
    q = torch.round((x - p.float()) / _fp16_residual_scale(p))
    return p, q.to(torch.int32)


def decode_fp16(p: Tensor, q: Tensor) -> Tensor:
    """(fp16 weight, int16 residual) -> the fp32 master (exact for 2**-16 <= |w| <= 65504)."""
    base = p.float()
    return torch.where(q == 0, base, base + q.float() * _fp16_residual_scale(p))  # keeps -0.0 negative


def random_bits(seed: Tensor, step: Tensor, offset: Tensor, n: int, stream: int = 0) -> Tensor:
    """``n`` pseudo-random 32-bit values (int64 in [0, 2**32)) for global elements offset..offset+n-1
    at ``step``: a counter-based integer hash, so no state beyond (seed, step, offset). ``stream``
    0 rounds the weights, 1 and 2 the moments."""
    idx = torch.arange(n, dtype=torch.int64, device=offset.device) + offset
    x = (idx * 0x9E3779B1 + step * 0x632BE5AB + seed * 0x2545F491 + stream * 0x68E31DA4) & _MASK32
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


def stochastic_round_bf16(x: Tensor, bits: Tensor) -> Tensor:
    """Round fp32 ``x`` (finite) to bf16 up or down in magnitude at random, unbiased: 16 random bits
    added below the kept ones carry into them with probability equal to the discarded fraction.
    Integer operations only (no division), for the moments' hot loop."""
    b = x.view(torch.int32)
    return ((b + (bits >> 16).to(torch.int32)) & -65536).view(torch.float32).to(torch.bfloat16)


# -- moments: fp32, bf16 or 8-bit (see shardopt.moments) -----------------------------------
Key = tuple[Tensor, Tensor, Tensor]  # (seed, step, global offset of the range's first element), int64


def encode_moment8(m: Tensor, v: Tensor, key: Key | None) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """fp32 moments (1-D, whole blocks) -> ((int8 codes, scales), (uint8 codes, scales)), rounded
    stochastically with ``key``, to nearest without (see [Note: 8-bit moments])."""
    mb, vb = m.view(-1, MOMENT_BLOCK), v.view(-1, MOMENT_BLOCK)
    m_scale, v_max = mb.abs().amax(1), vb.amax(1)
    qm = mb / m_scale.clamp_min(_TINY)[:, None] * 127.0
    t = vb / v_max.clamp_min(_TINY)[:, None] * 65025.0  # (sqrt(v) / max sqrt(v) * 255) ** 2
    lo = torch.floor(torch.sqrt(t))
    if key is None:
        m_codes = torch.floor(qm + 0.5)
        v_codes = torch.where(t > (lo + 0.5) * (lo + 0.5), lo + 1.0, lo)  # nearest in sqrt(v)
    else:  # one hash per element, stream 1 for m, stream 2 for v
        bits = random_bits(*key, m.numel(), 1).view(-1, MOMENT_BLOCK)
        m_codes = torch.floor(qm + (bits >> 8).float() * 2.0 ** -24)
        # Up with probability (t - lo^2) / ((lo + 1)^2 - lo^2), so that the decoded v = code^2, not
        # the code, is unbiased (rounding sqrt(v) unbiased would bias v up by its variance, every step).
        u = (random_bits(*key, m.numel(), 2).view(-1, MOMENT_BLOCK) >> 8).float() * 2.0 ** -24
        v_codes = torch.floor(lo + (t - lo * lo) / (2.0 * lo + 1.0) + (1.0 - u))  # lo + 1 when u <= p
    m_codes = m_codes.clamp(-127.0, 127.0).to(torch.int8).flatten()
    v_codes = v_codes.clamp(0.0, 255.0).to(torch.uint8).flatten()
    return (m_codes, m_scale), (v_codes, v_max.sqrt())


def decode_moment8(m_codes: Tensor, m_scale: Tensor, v_codes: Tensor, v_scale: Tensor) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`encode_moment8`, to fp32 (without the clamp of :func:`load_moments`)."""
    m = (m_codes.view(-1, MOMENT_BLOCK).float() * (m_scale / 127.0)[:, None]).flatten()
    r = v_codes.view(-1, MOMENT_BLOCK).float() * (v_scale / 255.0)[:, None]
    return m, (r * r).flatten()


def moment_ratio_bound(s: Scalars) -> Tensor:
    """The most ``|exp_avg| / sqrt(exp_avg_sq)`` can be in exact Adam for these betas (inf when
    ``beta1**2 >= beta2``), with 1% to spare for rounding."""
    one_minus_beta1, beta2, one_minus_beta2 = s[1], s[2], s[3]
    beta1 = 1.0 - one_minus_beta1
    den = one_minus_beta2 * (1.0 - beta1 * beta1 / beta2)
    return torch.where(den > 0, 1.01 * one_minus_beta1 / den.clamp_min(_TINY).sqrt(),
                       torch.full_like(den, float("inf")))


def load_moments(m: Tensor | tuple, v: Tensor | tuple, s: Scalars) -> tuple[Tensor, Tensor]:
    """The stored moments (tensors in fp32 or bf16, or 8-bit (codes, scales) pairs) as fp32."""
    if isinstance(m, tuple):
        m32, v32 = decode_moment8(m[0], m[1], v[0], v[1])
        bound = moment_ratio_bound(s) * v32.sqrt()
        return torch.minimum(torch.maximum(m32, -bound), bound), v32
    return m.float(), v.float()


def store_moments_(m: Tensor | tuple, v: Tensor | tuple, m32: Tensor, v32: Tensor, key: Key | None) -> None:
    """Write fp32 moments back in the stored form (see [Note: 16-bit moments], [Note: 8-bit moments])."""
    if isinstance(m, tuple):
        (mq, ms), (vq, vs) = encode_moment8(m32, v32, key)
        m[0].copy_(mq)
        m[1].copy_(ms)
        v[0].copy_(vq)
        v[1].copy_(vs)
    elif m.dtype == torch.float32:
        m.copy_(m32)
        v.copy_(v32)
    else:
        m.copy_(m32)
        seed, step, offset = key
        v.copy_(stochastic_round_bf16(v32, random_bits(seed, step, offset, v32.numel(), 2)))


# -- one step per master-weight mode: decode, AdamW, encode, in place -----------------------
def step_fp32(master: Tensor, grad: Tensor, m: Tensor | tuple, v: Tensor | tuple, s: Scalars,
              param_out: Tensor | None, key: Key | None = None) -> None:
    """fp32 master (updated in place); the rounded weight goes to ``param_out`` when given. ``m``,
    ``v``: the stored moments (see :func:`load_moments`); ``key``: their random bits unless fp32."""
    m32, v32 = load_moments(m, v, s)
    w, m_new, v_new = adamw_math(master, grad, m32, v32, s)
    master.copy_(w)
    store_moments_(m, v, m_new, v_new, key)
    if param_out is not None:
        param_out.copy_(round_to_dtype(w, param_out.dtype))


def join_remainder(rem: Tensor | tuple) -> Tensor:
    """The 16-bit remainder as int32: from an int16 tensor, or from (low byte, high byte) int8 planes."""
    if isinstance(rem, tuple):
        return (rem[0].to(torch.int32) & 0xFF) | (rem[1].to(torch.int32) << 8)
    return rem.to(torch.int32)


def split_remainder_(rem: Tensor | tuple, r: Tensor) -> None:
    """Store int32 ``r`` (in [-2**15, 2**15)) as :func:`join_remainder` reads it. [Note: remainder
    planes] The master keeps two int8 planes rather than one int16 tensor: inductor's CPU code does
    not vectorise a conversion to int16, and one such conversion made the whole fused loop scalar
    (3.7x slower); conversions to int8 vectorise. Same 2 bytes per element, same values."""
    if isinstance(rem, tuple):
        rem[0].copy_(((r << 24) >> 24).to(torch.int8))
        rem[1].copy_((r >> 8).to(torch.int8))
    else:
        rem.copy_(r.to(torch.int16))


def step_remainder(param: Tensor, rem: Tensor | tuple, grad: Tensor, m: Tensor | tuple, v: Tensor | tuple,
                   s: Scalars, key: Key | None = None) -> None:
    """16-bit weight + 16-bit remainder (an int16 tensor or two int8 planes) hold the exact fp32 master."""
    m32, v32 = load_moments(m, v, s)
    lo = join_remainder(rem)
    if param.dtype == torch.bfloat16:
        w, m_new, v_new = adamw_math(decode_bf16(param, lo), grad, m32, v32, s)
        hi, r = _encode_bf16_bits(w)
    else:
        w, m_new, v_new = adamw_math(decode_fp16(param, lo), grad, m32, v32, s)
        hi, r = _encode_fp16_residual(w)
    param.copy_(hi)
    split_remainder_(rem, r)
    store_moments_(m, v, m_new, v_new, key)


def step_stochastic(param: Tensor, grad: Tensor, m: Tensor | tuple, v: Tensor | tuple, s: Scalars, seed: Tensor,
                    step: Tensor, offset: Tensor) -> None:
    """No master: the fp32 result is rounded stochastically into the 16-bit weight."""
    m32, v32 = load_moments(m, v, s)
    w, m_new, v_new = adamw_math(param.float(), grad, m32, v32, s)
    param.copy_(stochastic_round(w, param.dtype, random_bits(seed, step, offset, param.numel())))
    store_moments_(m, v, m_new, v_new, (seed, step, offset))


def step_none(param: Tensor, grad: Tensor, m: Tensor | tuple, v: Tensor | tuple, s: Scalars,
              key: Key | None = None) -> None:
    """No master: fp32 recomputed from the 16-bit weight, rounded to nearest again (lossy)."""
    m32, v32 = load_moments(m, v, s)
    w, m_new, v_new = adamw_math(param.float(), grad, m32, v32, s)
    param.copy_(round_to_dtype(w, param.dtype))
    store_moments_(m, v, m_new, v_new, key)


def adamw_update_(master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, lr: float, beta1: float,
                  beta2: float, eps: float, weight_decay: float, step: int, grad_scale: float = 1.0,
                  param_out: Tensor | None = None) -> None:
    """Convenience form of :func:`step_fp32` with Python-number hyperparameters."""
    s = make_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                     grad_scale=grad_scale, device=master.device)
    step_fp32(master, grad, exp_avg, exp_avg_sq, s, param_out)
