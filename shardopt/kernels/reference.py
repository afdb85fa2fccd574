"""Reference AdamW update on one flat shard, in plain PyTorch: the oracle.

The math follows ``torch.optim.AdamW`` (single-tensor path) operation for operation, so that a
sharded run matches the plain optimizer to rounding. Per-step scalars (bias corrections, step
size) are computed in Python doubles exactly as torch does.

[Note: the 16-bit cast]
The new 16-bit weight is the fp32 master rounded to the parameter dtype. For bf16 we round half
away from zero (``hi = (bits + 0x8000) >> 16`` on the int32 pattern), not half to even: it equals
round-to-nearest except on exact ties (2**-16 of values), and it is the only rounding for which
a 16-bit remainder rebuilds the fp32 master bit for bit. Every master-weight mode uses this cast,
so all modes follow identical trajectories. fp16 uses round-to-nearest-even.
"""
from __future__ import annotations


import torch
from torch import Tensor


def round_to_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Round fp32 ``x`` to ``dtype`` with shardopt's cast (see [Note: the 16-bit cast])."""
    if dtype == torch.bfloat16:
        hi = (x.view(torch.int32) + 0x8000) >> 16
        # Keep inf/nan patterns intact: adding 0x8000 to a NaN payload must not make it inf.
        hi = torch.where(torch.isnan(x), torch.full_like(hi, 0x7FC0), hi)
        return hi.to(torch.int16).view(torch.bfloat16)
    return x.to(dtype)


def adamw_update_(
    master: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    param_out: Tensor | None = None,
) -> None:
    """One AdamW step on a 1-D shard, in place.

    master:      1D fp32, the weights being optimised (updated in place).
    grad:        1D, any float dtype, same length; multiplied by ``grad_scale`` (unscale and
                 clip coefficient) after the cast to fp32.
    exp_avg,
    exp_avg_sq:  1D fp32 moments (updated in place).
    step:        the step number after this update (1 on the first step).
    param_out:   optional 1D 16-bit tensor that receives the master rounded to its dtype.
    """
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    # Decoupled weight decay, applied to the weights before the Adam update.
    master.mul_(1 - lr * weight_decay)
    # First and second moments.
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    # Bias correction folded into the step size and the denominator.
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-step_size)
    if param_out is not None:
        param_out.copy_(round_to_dtype(master, param_out.dtype))
