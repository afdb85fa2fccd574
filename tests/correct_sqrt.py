"""torch.optim.AdamW rounded as shardopt's fused kernels round it: with a correctly rounded sqrt.

The fused kernels take ``sqrt(exp_avg_sq)`` from the CPU's vector sqrt instruction, which IEEE 754
rounds correctly. Eager ``torch.sqrt`` need not: on a torch built with MKL it is MKL's vector
sqrt, which on an AMD EPYC (torch 2.13 and 2.9 from PyPI) is one ulp off for about a fifth of
random fp32 inputs (:func:`eager_sqrt_is_correctly_rounded`). torch's step run inside
:func:`correctly_rounded_sqrt` is what the fused kernels must equal bit for bit on any machine;
where eager sqrt is correctly rounded it changes nothing.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class correctly_rounded_sqrt(TorchFunctionMode):  # noqa: N801 - used as a context manager
    """Inside: ``sqrt`` of an fp32 tensor is the fp64 square root rounded to fp32, which is the
    correctly rounded fp32 square root (fp64 holds more than twice fp32's digits)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in (torch.sqrt, torch.Tensor.sqrt) and args[0].dtype == torch.float32 and not kwargs:
            return torch.sqrt(args[0].double()).float()
        return func(*args, **(kwargs or {}))


def eager_sqrt_is_correctly_rounded(n: int = 1 << 16) -> bool:
    """Whether eager ``torch.sqrt`` gives the correctly rounded result on ``n`` random fp32 values."""
    x = torch.rand(n, generator=torch.Generator().manual_seed(0)) * 1e-3
    return torch.equal(x.sqrt(), x.double().sqrt().float())
