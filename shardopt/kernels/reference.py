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
resumed run repeats exactly. Each element gets 16 bits per stream; streams 0 (weights) and 2
(``exp_avg_sq``) are the halves of one 32-bit word, so a kernel rounding both hashes once. Only
as many random bits are used as the rounding discards (16 for bf16, 13 for fp16), so the floor
below is exact and the rounding unbiased: for every finite value to bf16 (an integer add on the
bit pattern, exact down to the subnormals), in fp16's normal range to fp16.

[Note: 16-bit moments]
With ``moments="bf16"`` both moments are stored in bf16 (8 significant bits). ``exp_avg`` is
rounded to nearest: it moves by ``1 - beta1`` (10%) of the way to each new gradient, far more than
its rounding. ``exp_avg_sq`` is rounded stochastically (stream 2 of the random bits): with
``beta2 = 0.999`` its decay ``v * 0.999`` is below half an ulp of ``v``, so round to nearest gives
back ``v`` and a large gradient, once seen, never decays: measured after a spike, nearest left
``v`` 20x too large after 3000 steps (the updates 4.5x too small), stochastic rounding within 2%
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
too large in the same micro measurement, 0.97x stochastically). Decoding clamps ``|m|`` to the bound exact
Adam obeys, ``|m| <= (1 - b1) / sqrt((1 - b2) (1 - b1**2 / b2)) * sqrt(v)`` (Cauchy-Schwarz
over the two exponential sums), so a block whose ``sqrt(v)`` code rounded to zero gives no update
rather than ``m / eps``. A block scale is at least 1e-30 (so that 127 / scale stays finite);
moments below it are stored as 0.

The step needs each block's new scale before it can encode the block, so an 8-bit update is two
compiled passes: :func:`moment8_scan` (a reduction per block over the gradient and the stored
codes) and the step itself, elementwise with the scan's maxima. One graph doing both held three
fp32 buffers of the segment's length; two hold two floats per block.
"""
from __future__ import annotations

import torch
from torch import Tensor

Key = tuple[Tensor, Tensor]  # per random word, the counter of the range's first element (see make_key)
Scalars = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]

_MASK32 = 0xFFFFFFFF
MOMENT_BLOCK = 64  # elements per scale of the 8-bit moments (see [Note: 8-bit moments])
_SCALE_MIN = 1e-30  # the smallest 8-bit block scale: moments below it are stored as 0


def make_scalars(*, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                 grad_scale: float, device: torch.device | str = "cpu") -> Scalars:
    """Per-step scalars as 0-d fp32 tensors, computed in Python doubles exactly as torch.optim.AdamW does:
    (decay factor, 1 - beta1, beta2, 1 - beta2, step size, sqrt of bias correction 2, eps, gradient
    scale, :func:`moment_ratio_bound`)."""
    values = (1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1**step),
              (1 - beta2**step) ** 0.5, eps, grad_scale, moment_ratio_bound(beta1, beta2))
    return tuple(torch.tensor(values, dtype=torch.float32, device=device).unbind())  # type: ignore[return-value]


def moment_ratio_bound(beta1: float, beta2: float) -> float:
    """The most ``|exp_avg| / sqrt(exp_avg_sq)`` can be in exact Adam for these betas (inf when
    ``beta1**2 >= beta2``), with 1% to spare for rounding (see [Note: 8-bit moments])."""
    den = (1 - beta2) * (1 - beta1 * beta1 / beta2) if beta2 > 0 else 0.0
    return 1.01 * (1 - beta1) / den**0.5 if den > 0 else float("inf")


def adam_moments(g: Tensor, m: Tensor, v: Tensor, s: Scalars) -> tuple[Tensor, Tensor]:
    """The new (exp_avg, exp_avg_sq) from the fp32 scaled gradient ``g`` and the fp32 moments."""
    one_minus_beta1, beta2, one_minus_beta2 = s[1], s[2], s[3]
    return torch.lerp(m, g, one_minus_beta1), v * beta2 + one_minus_beta2 * g * g


def adamw_math(w: Tensor, grad: Tensor, m: Tensor, v: Tensor, s: Scalars) -> tuple[Tensor, Tensor, Tensor]:
    """One AdamW step on fp32 ``w`` (functional): returns (w, m, v). ``grad`` in any float dtype is
    multiplied by the gradient scale (1 / loss scale times the clip coefficient) in fp32."""
    decay, step_size, bc2_sqrt, eps, grad_scale = s[0], s[4], s[5], s[6], s[7]
    g = grad.float() * grad_scale
    w = w * decay  # decoupled weight decay, before the Adam step
    m, v = adam_moments(g, m, v, s)
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
    p, q = _encode_fp16_residual(x)
    return p, q.to(torch.int16)


def _encode_fp16_residual(x: Tensor) -> tuple[Tensor, Tensor]:
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


# -- moments: fp32, bf16 or 8-bit (see shardopt.moments) -----------------------------------
def _per_block(x: Tensor, like: Tensor) -> Tensor:
    """One value per block (``nb`` elements) -> the same value on each element of the block, shaped
    as ``like``: 1-D (``nb * MOMENT_BLOCK``) or 2-D (``nb, MOMENT_BLOCK``).

    The step encodes elementwise over 1-D tensors with the block values broadcast this way, so
    that it compiles to one loop with no full-length temporaries; the scan (a reduction per
    block) works in 2-D for the same reason."""
    return x[:, None] if like.dim() == 2 else x[:, None].expand(x.numel(), MOMENT_BLOCK).reshape(-1)


def moment8_maxima(m: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Per block of fp32 moments (1-D whole blocks, or 2-D one row per block): (max |exp_avg|, max exp_avg_sq)."""
    return m.view(-1, MOMENT_BLOCK).abs().amax(1), v.view(-1, MOMENT_BLOCK).amax(1)


def encode_moment8(m: Tensor, v: Tensor, key: Key | None, maxima: tuple[Tensor, Tensor] | None = None
                   ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """fp32 moments (1-D, whole blocks) -> ((int8 codes, scales), (uint8 codes, scales)), rounded
    stochastically with ``key``, to nearest without (see [Note: 8-bit moments]). ``maxima``: the
    blocks' :func:`moment8_maxima`, when already known."""
    m_max, v_max = maxima if maxima is not None else moment8_maxima(m, v)
    m_max, v_max = m_max.clamp_min(_SCALE_MIN), v_max.clamp_min(_SCALE_MIN)  # 127 / scale stays finite
    qm = m * _per_block(127.0 / m_max, m)
    t = v * _per_block(65025.0 / v_max, v)  # (sqrt(v) / max sqrt(v) * 255) ** 2
    lo = torch.floor(torch.sqrt(t))
    if key is None:
        m_codes = torch.floor(qm + 0.5)
        v_codes = torch.where(t > (lo + 0.5) * (lo + 0.5), lo + 1.0, lo)  # nearest in sqrt(v)
    else:  # 16 random bits per element and moment: stream 1 for m, stream 2 for v
        m_codes = torch.floor(qm + uniform16(random_bits16(key, m.numel(), 1)))
        # Up with probability (t - lo^2) / ((lo + 1)^2 - lo^2), so that the decoded v = code^2, not
        # the code, is unbiased (rounding sqrt(v) unbiased would bias v up by its variance, every step).
        u = uniform16(random_bits16(key, m.numel(), 2))
        v_codes = lo + (t - lo * lo > u * (2.0 * lo + 1.0)).float()
    m_codes = m_codes.clamp(-127.0, 127.0).to(torch.int8)
    v_codes = v_codes.clamp(0.0, 255.0).to(torch.uint8)
    return (m_codes, m_max), (v_codes, v_max.sqrt())


def decode_moment8(m_codes: Tensor, m_scale: Tensor, v_codes: Tensor, v_scale: Tensor) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`encode_moment8`, to fp32 (without the clamp of :func:`load_moments`)."""
    m, r = _decode_moment8_sqrt(m_codes, m_scale, v_codes, v_scale)
    return m, r * r


def _decode_moment8_sqrt(m_codes: Tensor, m_scale: Tensor, v_codes: Tensor, v_scale: Tensor) -> tuple[Tensor, Tensor]:
    """(exp_avg, sqrt(exp_avg_sq)) from 8-bit codes and block scales, 1-D or 2-D like the codes."""
    return (m_codes.float() * _per_block(m_scale / 127.0, m_codes),
            v_codes.float() * _per_block(v_scale / 255.0, v_codes))


def load_moments(m: Tensor | tuple, v: Tensor | tuple, s: Scalars) -> tuple[Tensor, Tensor]:
    """The stored moments as fp32: tensors in fp32 or bf16, or 8-bit operands (codes, scales) or
    (codes, scales, the new blocks' maximum from :func:`moment8_scan`)."""
    if isinstance(m, tuple):
        m32, r = _decode_moment8_sqrt(m[0], m[1], v[0], v[1])
        bound = r * s[8]  # moment_ratio_bound
        return torch.minimum(torch.maximum(m32, -bound), bound), r * r
    return m.float(), v.float()


def moment8_scan(grad: Tensor, m: tuple, v: tuple, s: Scalars) -> tuple[Tensor, Tensor]:
    """The first of two passes of an 8-bit update: per block, (max |exp_avg|, max exp_avg_sq) after
    this step, read from the gradient and the stored codes alone; the step pass (given these as
    the operands' third element) then encodes in one elementwise loop without fp32 temporaries."""
    blocks = (m[1].shape[0], MOMENT_BLOCK)  # one size for every operand, also when compiled for dynamic shapes
    m32, v32 = load_moments((m[0].view(blocks), m[1]), (v[0].view(blocks), v[1]), s)
    m_new, v_new = adam_moments(grad.view(blocks).float() * s[7], m32, v32, s)
    return moment8_maxima(m_new, v_new)


def store_moments_(m: Tensor | tuple, v: Tensor | tuple, m32: Tensor, v32: Tensor, key: Key | None) -> None:
    """Write fp32 moments back in the stored form (see [Note: 16-bit moments], [Note: 8-bit moments])."""
    if isinstance(m, tuple):
        (mq, ms), (vq, vs) = encode_moment8(m32, v32, key, (m[2], v[2]) if len(m) > 2 else None)
        m[0].copy_(mq)
        m[1].copy_(ms)
        v[0].copy_(vq)
        v[1].copy_(vs)
    elif m.dtype == torch.float32:
        m.copy_(m32)
        v.copy_(v32)
    else:
        m.copy_(m32)
        v.copy_(stochastic_round_bf16(v32, random_bits16(key, v32.numel(), 2)))


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


def step_stochastic(param: Tensor, grad: Tensor, m: Tensor | tuple, v: Tensor | tuple, s: Scalars, key: Key) -> None:
    """No master: the fp32 result is rounded stochastically into the 16-bit weight."""
    m32, v32 = load_moments(m, v, s)
    w, m_new, v_new = adamw_math(param.float(), grad, m32, v32, s)
    param.copy_(stochastic_round(w, param.dtype, random_bits16(key, param.numel(), 0)))
    store_moments_(m, v, m_new, v_new, key)


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


# -- the gradient statistics of a step (inf/NaN test, clipping norm) ---------------------------
def grad_nonfinite(g: Tensor) -> Tensor:
    """1.0 if ``g`` (1-D, not empty, any float dtype) holds an inf or a NaN, else 0.0: a 0-d fp32
    tensor. Read off the bit patterns: the largest fp32 magnitude pattern reaches the all-ones
    exponent exactly then. An integer maximum is exact in any order, and compiled it reads a 16M
    bf16 gradient in 0.9 ms where an fp32 sum took 2.2 ms (and flagged finite values summing past
    fp32)."""
    return ((g.float().view(torch.int32) & 0x7FFFFFFF).amax() >= 0x7F800000).float()


def grad_max(g: Tensor) -> Tensor:
    """max |g| in fp32 (0-d), for the inf-norm; inf or NaN when ``g`` holds one."""
    return torch.linalg.vector_norm(g, float("inf"), dtype=torch.float32)


def grad_norm_power(g: Tensor, p: float) -> Tensor:
    """sum |g|^p in fp32 (0-d): this shard's share of the p-norm's p-th power."""
    return torch.linalg.vector_norm(g, p, dtype=torch.float32) ** p
