"""The AdamW update and the moment codecs in plain PyTorch: the oracle.

Every function here is written once and serves twice: run eagerly it is the readable reference;
compiled by ``torch.compile`` (``kernels/fused.py``) the same code becomes one fused pass over
the shard. Per-step scalars arrive as 0-d fp32 tensors (see :func:`make_scalars`) so that a new
learning rate or step number never triggers a recompile.

The AdamW math follows ``torch.optim.AdamW`` operation for operation: decoupled weight decay,
then the moments, then the bias-corrected step ``w -= step_size * m / (sqrt(v) / sqrt(bc2) + eps)``. The casts and
the master-weight codecs it calls (the 16-bit cast, the remainders, stochastic rounding and
its random bits) are in :mod:`shardopt.kernels.codecs`.

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

from typing import cast

import torch
from torch import Tensor

from shardopt.kernels.codecs import (Key, decode_bf16, decode_fp16, encode_bf16_bits, encode_fp16_residual, join_remainder,
                                     random_bits16, round_to_dtype, split_remainder_, stochastic_round,
                                     stochastic_round_bf16, uniform16)

Scalars = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]

MOMENT_BLOCK = 64  # elements per scale of the 8-bit moments (see [Note: 8-bit moments])
_SCALE_MIN = 1e-30  # the smallest 8-bit block scale: moments below it are stored as 0


def make_scalars(*, lr: float | Tensor, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                 grad_scale: float, device: torch.device | str = "cpu") -> Scalars:
    """Per-step scalars as 0-d fp32 tensors, computed exactly as torch.optim.AdamW does: (decay
    factor, 1 - beta1, beta2, 1 - beta2, step size, sqrt of bias correction 2, eps, gradient scale,
    :func:`moment_ratio_bound`). In Python doubles, except where ``lr`` is a tensor (see [Note: a
    tensor learning rate]). ``grad_scale`` negative: ``maximize=True`` (the gradient negated, as
    torch negates it, exactly)."""
    decay, step_size = lr_factors(lr, weight_decay, 1 - beta1**step)
    values = (decay, 1 - beta1, beta2, 1 - beta2, step_size,
              (1 - beta2**step) ** 0.5, eps, grad_scale, moment_ratio_bound(beta1, beta2))
    return tuple(torch.tensor(values, dtype=torch.float32, device=device).unbind())  # type: ignore[return-value]


# [Note: a tensor learning rate]
# torch.optim.AdamW and torch.optim.Muon take ``lr`` as a 1-element tensor (so that a compiled step
# or a scheduler can change it without a recompile). Their step then computes the learning rate's
# products with tensor arithmetic in the tensor's dtype (``1 - lr * weight_decay``, ``lr /
# bias_correction1``: fp32 for ``torch.tensor(1e-3)``) where a float lr is computed in Python
# doubles, and rounds differently in the last bit. These factors are computed the same way here,
# with the user's tensor on its own device, then passed to the update as numbers, so that a tensor
# lr gives torch's tensor-lr step bit for bit, and a float lr torch's float-lr step.
def lr_factors(lr: float | Tensor, weight_decay: float, bias_correction1: float) -> tuple[float, float]:
    """(the decoupled decay factor ``1 - lr * weight_decay``, the step size ``lr / bias_correction1``)
    as torch.optim.AdamW computes them for a float or a 1-element tensor ``lr``."""
    if isinstance(lr, Tensor):
        t = lr.detach().reshape(())
        return float(1 - t * weight_decay), float(t / bias_correction1)
    return 1 - lr * weight_decay, lr / bias_correction1


def moment_ratio_bound(beta1: float, beta2: float) -> float:
    """The most ``|exp_avg| / sqrt(exp_avg_sq)`` can be in exact Adam for these betas (inf when
    ``beta1**2 >= beta2``), with 1% to spare for rounding (see [Note: 8-bit moments])."""
    den = (1 - beta2) * (1 - beta1 * beta1 / beta2) if beta2 > 0 else 0.0
    return 1.01 * (1 - beta1) / den**0.5 if den > 0 else float("inf")


def adam_moments(g: Tensor, m: Tensor, v: Tensor, s: Scalars) -> tuple[Tensor, Tensor]:
    """The new (exp_avg, exp_avg_sq) from the fp32 scaled gradient ``g`` and the fp32 moments,
    rounded as torch.optim.AdamW's ``lerp_`` and ``mul_(beta2).addcmul_(g, g, value=1 - beta2)``
    round them: ``exp_avg_sq`` is ``fma((1 - beta2) * g, g, beta2 * v)``, one rounding for the
    sum (see _cpu_codegen [Note: fused multiply-add] for the compiled form)."""
    one_minus_beta1, beta2, one_minus_beta2 = s[1], s[2], s[3]
    return torch.lerp(m, g, one_minus_beta1), torch.addcmul(v * beta2, one_minus_beta2 * g, g)


def adamw_math(w: Tensor, grad: Tensor, m: Tensor, v: Tensor, s: Scalars,
               vmax: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One AdamW step on fp32 ``w`` (functional): returns (w, m, v, vmax). ``grad`` in any float
    dtype is multiplied by the gradient scale (1 / loss scale times the clip coefficient, negative
    with ``maximize``) in fp32. ``vmax``: with ``amsgrad``, the running maximum of ``v`` (fp32),
    which the step divides by instead of ``v``, as torch.optim.AdamW(amsgrad=True); else None."""
    decay, step_size, bc2_sqrt, eps, grad_scale = s[0], s[4], s[5], s[6], s[7]
    g = grad.float() * grad_scale
    w = w * decay  # decoupled weight decay, before the Adam step
    m, v = adam_moments(g, m, v, s)
    if vmax is not None:
        vmax = torch.maximum(vmax, v)
    denom = (v if vmax is None else vmax).sqrt() / bc2_sqrt + eps
    w = w + (-step_size * m) / denom
    return w, m, v, vmax


# -- moments: fp32, bf16 or 8-bit (see shardopt.update._moments) -----------------------------------
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
    return m.float(), cast(Tensor, v).float()  # m and v are stored alike


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
        cast(Tensor, v).copy_(v32)  # m and v are stored alike
    else:  # bf16, rounded stochastically: a key is given for every format but fp32
        m.copy_(m32)
        cast(Tensor, v).copy_(stochastic_round_bf16(v32, random_bits16(cast(Key, key), v32.numel(), 2)))


def load_max(vmax: Tensor | None) -> Tensor | None:
    """amsgrad's stored running maximum of ``exp_avg_sq`` as fp32 (None without amsgrad)."""
    return None if vmax is None else vmax.float()


def store_max_(vmax: Tensor | None, vmax32: Tensor | None) -> None:
    """Store amsgrad's new running maximum: exactly in fp32; in bf16 (``moments="bf16"``) rounded to
    nearest, which keeps it from ever decreasing (the old stored value is representable, and
    rounding is monotone)."""
    if vmax is not None and vmax32 is not None:
        vmax.copy_(vmax32)


# -- one step per master-weight mode: decode, AdamW, encode, in place -----------------------
def step_fp32(master: Tensor, grad: Tensor, m: Tensor | tuple, v: Tensor | tuple, s: Scalars,
              param_out: Tensor | None, key: Key | None = None, *, vmax: Tensor | None = None) -> None:
    """fp32 master (updated in place); the rounded weight goes to ``param_out`` when given. ``m``,
    ``v``: the stored moments (see :func:`load_moments`); ``key``: their random bits unless fp32;
    ``vmax``: amsgrad's running maximum of ``v`` (fp32 or bf16, see :func:`store_max_`), else None."""
    m32, v32 = load_moments(m, v, s)
    w, m_new, v_new, vmax_new = adamw_math(master, grad, m32, v32, s, load_max(vmax))
    master.copy_(w)
    store_moments_(m, v, m_new, v_new, key)
    store_max_(vmax, vmax_new)
    if param_out is not None:
        param_out.copy_(round_to_dtype(w, param_out.dtype))


def step_remainder(param: Tensor, rem: Tensor | tuple, grad: Tensor, m: Tensor | tuple, v: Tensor | tuple,
                   s: Scalars, key: Key | None = None, *, vmax: Tensor | None = None) -> None:
    """16-bit weight + 16-bit remainder (an int16 tensor or two int8 planes) hold the exact fp32 master."""
    m32, v32 = load_moments(m, v, s)
    lo = join_remainder(rem)
    if param.dtype == torch.bfloat16:
        w, m_new, v_new, vmax_new = adamw_math(decode_bf16(param, lo), grad, m32, v32, s, load_max(vmax))
        hi, r = encode_bf16_bits(w)
    else:
        w, m_new, v_new, vmax_new = adamw_math(decode_fp16(param, lo), grad, m32, v32, s, load_max(vmax))
        hi, r = encode_fp16_residual(w)
    param.copy_(hi)
    split_remainder_(rem, r)
    store_moments_(m, v, m_new, v_new, key)
    store_max_(vmax, vmax_new)


def step_stochastic(param: Tensor, grad: Tensor, m: Tensor | tuple, v: Tensor | tuple, s: Scalars, key: Key, *,
                    vmax: Tensor | None = None) -> None:
    """No master: the fp32 result is rounded stochastically into the 16-bit weight."""
    m32, v32 = load_moments(m, v, s)
    w, m_new, v_new, vmax_new = adamw_math(param.float(), grad, m32, v32, s, load_max(vmax))
    param.copy_(stochastic_round(w, param.dtype, random_bits16(key, param.numel(), 0)))
    store_moments_(m, v, m_new, v_new, key)
    store_max_(vmax, vmax_new)


def step_none(param: Tensor, grad: Tensor, m: Tensor | tuple, v: Tensor | tuple, s: Scalars,
              key: Key | None = None, *, vmax: Tensor | None = None) -> None:
    """No master: fp32 recomputed from the 16-bit weight, rounded to nearest again (lossy)."""
    m32, v32 = load_moments(m, v, s)
    w, m_new, v_new, vmax_new = adamw_math(param.float(), grad, m32, v32, s, load_max(vmax))
    param.copy_(round_to_dtype(w, param.dtype))
    store_moments_(m, v, m_new, v_new, key)
    store_max_(vmax, vmax_new)


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
