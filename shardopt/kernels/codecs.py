"""The 16-bit casts, the master-weight codecs and the random bits of stochastic rounding, in plain
PyTorch: bit manipulations the update steps of :mod:`shardopt.kernels.reference` are built from.
Like them, each is the readable reference run eagerly and part of a fused pass when compiled.

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
resumed run repeats exactly. Each element gets 16 bits per stream; streams 0 (weights) and 2
(``exp_avg_sq``) are the halves of one 32-bit word, so a kernel rounding both hashes once. Only
as many random bits are used as the rounding discards (16 for bf16, 13 for fp16), so the floor
below is exact and the rounding unbiased: for every finite value to bf16 (an integer add on the
bit pattern, exact down to the subnormals), in fp16's normal range to fp16.
"""
from __future__ import annotations

import torch
from torch import Tensor

Key = tuple[Tensor, Tensor]  # per random word, the counter of the range's first element (see make_key)

_MASK32 = 0xFFFFFFFF


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
    hi, r = encode_bf16_bits(x)
    return hi, r.to(torch.int16)


def encode_bf16_bits(x: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`encode_bf16` with the remainder as int32."""
    bits = x.view(torch.int32)
    hi_bits = (bits + 0x8000) & -65536  # the top 16 bits, rounded half away from zero
    return hi_bits.view(torch.float32).to(torch.bfloat16), bits - hi_bits


def decode_bf16(hi: Tensor, lo: Tensor) -> Tensor:
    """(bf16 weight, int16 remainder) -> the fp32 master, bit for bit."""
    return (hi.float().view(torch.int32) + lo.to(torch.int32)).view(torch.float32)


def _fp16_residual_scale_bits(p: Tensor) -> Tensor:
    """The int32 pattern of 2**(max(e, 1) - 40), for fp16 ``p`` with biased exponent field e (see
    [Note: fp16 remainder]). Read off the fp32 exponent of float(p): e - 15 + 127, at least 113
    for fp16 zeros and subnormals."""
    exp32 = p.float().view(torch.int32) & 0x7F800000
    return torch.clamp(exp32, min=113 << 23) - (25 << 23)


def _fp16_residual_scale(p: Tensor) -> Tensor:
    """2**(max(e, 1) - 40) as fp32."""
    return _fp16_residual_scale_bits(p).view(torch.float32)


def _fp16_residual_inverse_scale(p: Tensor) -> Tensor:
    """1 / :func:`_fp16_residual_scale`, exactly (negated exponent): between 2**9 and 2**39."""
    return ((254 << 23) - _fp16_residual_scale_bits(p)).view(torch.float32)


def encode_fp16(x: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 -> (fp16 weight rounded to nearest even, int16 residual q)."""
    p, q = encode_fp16_residual(x)
    return p, q.to(torch.int16)


def encode_fp16_residual(x: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`encode_fp16` with the residual as int32 (a product by the inverse scale: the scale
    is a power of two, so it equals the quotient, and a multiply is cheaper)."""
    p = x.to(torch.float16)
    q = torch.round((x - p.float()) * _fp16_residual_inverse_scale(p))
    return p, q.to(torch.int32)


def decode_fp16(p: Tensor, q: Tensor) -> Tensor:
    """(fp16 weight, int16 residual) -> the fp32 master (exact for 2**-16 <= |w| <= 65504)."""
    base = p.float()
    return torch.where(q == 0, base, base + q.float() * _fp16_residual_scale(p))  # keeps -0.0 negative


def _mix32(x: Tensor) -> Tensor:
    """A bijective avalanche of int32 words (Wellons' lowbias32): multiplies wrap modulo 2**32
    and shifts are made logical with a mask, so eager and compiled code agree bit for bit."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * -0x7B935975  # 0x846CA68B as a signed 32-bit constant
    return x ^ ((x >> 16) & 0xFFFF)


def _word_key(seed: int, step: int, word: int) -> int:
    """A well-mixed 32-bit key of (seed, step, word)."""
    x = (step * 0x632BE5AB + seed * 0x2545F491 + word * 0x68E31DA4) & _MASK32
    for mul in (0x7FEB352D, 0x5BD1E995):
        x ^= x >> 16
        x = (x * mul) & _MASK32
    return x ^ (x >> 15)


def make_key(seed: int, step: int, offset: int, device: torch.device | str = "cpu") -> Key:
    """The random-bit key of a range that starts at global element ``offset``, at ``step``: per
    word, the 32-bit counter of its first element, (offset + key(seed, step, word)) mod 2**32, as
    a 0-d int32 tensor (computed here once, not in the kernel's loop)."""
    def base(word: int) -> int:
        x = (offset + _word_key(seed, step, word)) & _MASK32
        return x - (1 << 32) if x >= 1 << 31 else x
    return tuple(torch.tensor(base(w), dtype=torch.int32, device=device) for w in range(2))  # type: ignore[return-value]


def random_words(key: Key, n: int, word: int = 0) -> Tensor:
    """``n`` pseudo-random int32 words for the ``n`` elements from the key's range start: a
    counter-based hash of (element + key), so no state beyond (seed, step, global offset), and
    the same element gets the same word however the buffer is split. Elements 2**32 apart share
    their words; that correlates them, it does not bias them."""
    return _mix32(torch.arange(n, dtype=torch.int32, device=key[word].device) + key[word])


def random_bits16(key: Key, n: int, stream: int = 0) -> Tensor:
    """16 random bits per element (int32 in [0, 2**16)): ``stream`` 0 rounds the weights, 1 and 2
    the moments. Streams 0 and 2 are the two halves of one word, so a kernel that rounds both a
    weight and ``exp_avg_sq`` hashes each element once."""
    w = random_words(key, n, 1 if stream == 1 else 0)
    return (w >> 16) & 0xFFFF if stream == 2 else w & 0xFFFF


def uniform16(bits: Tensor) -> Tensor:
    """16 random bits -> fp32 uniform on (0, 1), at the centres of 2**16 equal cells."""
    return (bits.float() + 0.5) * 2.0 ** -16


def stochastic_round(x: Tensor, dtype: torch.dtype, bits: Tensor) -> Tensor:
    """Round fp32 ``x`` to ``dtype`` up or down at random, unbiased, using 16 random bits (int32):
    down to the 16-bit grid below ``x`` unless ``x / ulp`` plus a uniform in [0, 1) reaches the
    next grid point (the floor rounding of [Note: stochastic rounding])."""
    if dtype == torch.bfloat16:
        return _stochastic_round_bf16_floor(x, bits)
    mant, emin = 10, -14
    discarded = 23 - mant  # random bits needed: exactly what the rounding throws away
    e = torch.clamp(((x.view(torch.int32) >> 23) & 0xFF) - 127, min=emin)
    ulp = ((e - mant + 127) << 23).view(torch.float32)
    inv_ulp = ((mant - e + 127) << 23).view(torch.float32)  # x * inv_ulp == x / ulp: powers of two, in range
    u = (bits >> (16 - discarded)).float() * (2.0 ** -discarded)
    return (torch.floor(x * inv_ulp + u) * ulp).to(dtype)


def _stochastic_round_bf16_floor(x: Tensor, bits: Tensor) -> Tensor:
    """:func:`stochastic_round` to bf16 with integer operations. bf16 keeps the top 16 bits, so
    floor(x / ulp + bits / 2**16) is the bit pattern plus ``bits`` (carrying into the kept bits)
    for x >= 0, and plus ``0xFFFF - bits`` for x < 0 (sign and magnitude: flooring a negative
    value rounds its magnitude up exactly when ``bits`` is below the discarded ones). The same
    result as the floor for every x, in the subnormal range too, and a NaN stays a NaN."""
    b = x.view(torch.int32)
    up = (b + torch.where(b < 0, bits ^ 0xFFFF, bits)) & -65536
    return torch.where((b & 0x7FFFFFFF) > 0x7F800000, b, up).view(torch.float32).to(torch.bfloat16)


def stochastic_round_bf16(x: Tensor, bits: Tensor) -> Tensor:
    """Round fp32 ``x`` (finite) to bf16 up or down in magnitude at random, unbiased: 16 random bits
    (int32 in [0, 2**16)) added below the kept ones carry into them with probability equal to the
    discarded fraction. Integer operations only (no division), for the moments' hot loop."""
    b = x.view(torch.int32)
    return ((b + bits) & -65536).view(torch.float32).to(torch.bfloat16)


# -- the remainder's storage ---------------------------------------------------------------
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
