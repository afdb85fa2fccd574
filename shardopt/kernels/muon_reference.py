"""The Muon update of one whole 2-D matrix in plain PyTorch, bit for bit as ``torch.optim.Muon``.

One step, for a weight ``W`` (m, n), its gradient ``G`` and momentum buffer ``B`` (all fp32)::

    B <- lerp(B, G, 1 - momentum)                 # B = momentum * B + (1 - momentum) * G
    U <- lerp(G, B, momentum) if nesterov else B  # Nesterov: (1 - momentum) * G + momentum * B
    O <- orthogonalize(U)                         # Newton-Schulz in bf16, result bf16 (m, n)
    W <- W * (1 - lr * weight_decay)              # decoupled decay with the *unadjusted* lr
    W <- W - adjusted_lr(lr, shape) * O           # bf16 O promoted to fp32 inside the add

The momentum is an exponential average (``lerp``), not the heavy-ball sum ``momentum * B + G``
that torch's docstring writes. Every operation, argument and dtype below is the one torch 2.13
uses, in the same order, so the results are equal bit for bit (``tests/test_muon_math.py``); a
rewrite in "nicer" algebra (``a*X + (b*A + c*A@A) @ X``) rounds differently in bf16.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

__all__ = ["NS_COEFFICIENTS", "NS_EPS", "NS_STEPS", "adjusted_lr", "muon_step_", "orthogonalize"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # (a, b, c) of the quintic iteration, torch's default
NS_EPS = 1e-7  # floor of the Frobenius norm the input is divided by
NS_STEPS = 5


def _check_matrix(name: str, t: Tensor) -> None:
    if t.ndim != 2:
        raise ValueError(f"Muon updates 2-D matrices only; {name} has shape {tuple(t.shape)}")


def orthogonalize(update: Tensor, *, ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  ns_steps: int = NS_STEPS, eps: float = NS_EPS) -> Tensor:
    """Approximately ``U V^T`` of ``update = U S V^T`` (shape (m, n)): a new bf16 (m, n) tensor.

    ``ns_steps`` iterations of ``X <- a X + (b A + c A A) X`` with ``A = X X^T``, in bf16, on
    ``X = update / max(||update||_F, eps)`` (so every singular value is at most 1). A tall matrix
    (m > n) is iterated as its transpose, so ``A`` is the smaller Gram matrix. Singular values
    that are not tiny end up near 1 (about 0.65..1.2 with the default coefficients), not at 1.
    ``update`` itself is never written to.
    """
    _check_matrix("the update", update)
    if ns_steps >= 100:
        raise ValueError(f"ns_steps must be below 100, got {ns_steps}")
    if len(ns_coefficients) != 3:
        raise ValueError(f"ns_coefficients must be three numbers (a, b, c), got {ns_coefficients!r}")
    a, b, c = ns_coefficients
    tall = update.size(0) > update.size(1)
    # A copy even when ``update`` is already bf16 (torch's ``.bfloat16()`` would alias it and the
    # in-place division below would then scale the caller's tensor).
    x = update.to(torch.bfloat16, copy=True)
    if tall:
        x = x.T  # a view: the first products read it transposed, as torch's do
    x.div_(x.norm().clamp(min=eps))  # bf16 norm, bf16 division
    for _ in range(ns_steps):
        gram = x @ x.T                                          # A = X X^T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)   # b A + c A A
        x = torch.addmm(x, poly, x, beta=a)                     # a X + (b A + c A A) X
    return x.T if tall else x


def adjusted_lr(lr: float | Tensor, adjust_lr_fn: str | None, shape: tuple[int, ...] | torch.Size) -> float | Tensor:
    """The learning rate the orthogonalized update of an (m, n) matrix is applied with.

    ``None`` or ``"original"``: ``lr * sqrt(max(1, m / n))`` (Keller Jordan's scaling);
    ``"match_rms_adamw"``: ``lr * (0.2 * sqrt(max(m, n)))`` (Moonshot's, an update RMS near
    AdamW's). The decay factor uses the unadjusted ``lr``.
    """
    m, n = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, m / n))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(m, n))
    else:
        raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")
    return lr * ratio  # lr * (0.2 * sqrt): the grouping is torch's, and it decides the last bit


def muon_step_(param: Tensor, grad: Tensor, momentum_buffer: Tensor, *, lr: float | Tensor,
               weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
               ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = NS_EPS,
               ns_steps: int = NS_STEPS, adjust_lr_fn: str | None = None,
               orthogonalize_fn: Callable[..., Tensor] | None = None,
               shape: tuple[int, ...] | None = None) -> None:
    """One Muon step of one (m, n) matrix, in place on ``param`` and ``momentum_buffer``.

    ``param``, ``grad`` and ``momentum_buffer`` are fp32 (m, n) tensors on one device; the buffer
    starts as zeros. ``lr`` is the unadjusted learning rate (see :func:`adjusted_lr`), a float or
    a 1-element tensor, used in tensor arithmetic as torch uses it (see kernels.reference [Note: a
    tensor learning rate]),
    ``weight_decay`` the decoupled decay per unit of ``lr``, ``momentum`` the averaging factor of
    the buffer. The defaults are ``torch.optim.Muon``'s. ``param`` may be one piece of a larger
    matrix (a tensor-parallel shard): ``orthogonalize_fn`` then returns this piece of the whole
    update's orthogonalisation (same keywords as :func:`orthogonalize`), and ``shape`` is the whole
    matrix's, which the learning-rate adjustment reads.
    """
    for name, t in (("param", param), ("grad", grad), ("momentum_buffer", momentum_buffer)):
        _check_matrix(name, t)
        if t.dtype != torch.float32:
            raise ValueError(f"muon_step_ takes fp32 tensors; {name} is {t.dtype}")
    if grad.shape != param.shape or momentum_buffer.shape != param.shape:
        raise ValueError(f"shapes differ: param {tuple(param.shape)}, grad {tuple(grad.shape)}, "
                         f"momentum_buffer {tuple(momentum_buffer.shape)}")
    momentum_buffer.lerp_(grad, 1 - momentum)
    update = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    ortho = (orthogonalize_fn or orthogonalize)(update, ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps)
    if isinstance(lr, Tensor):
        lr = lr.detach().reshape(())  # torch's _to_scalar: a 1-element tensor as a 0-d one
    step_lr = adjusted_lr(lr, adjust_lr_fn, shape if shape is not None else param.shape)
    param.mul_(1 - lr * weight_decay)
    # ignored: a 0-d tensor lr is a Scalar to torch, its stub takes numbers only
    param.add_(ortho, alpha=-step_lr)  # type: ignore[arg-type]
