"""The reference the everyday-usage tests compare with: plain ``torch.optim.AdamW`` stepped on
the gradient averaged over ranks the way DDP averages it (a plain ``all_reduce``; a parameter no
rank has a gradient for keeps ``grad=None``), and small helpers the ranks run."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from models import batch

HP = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _with_some_gradient(model: nn.Module):  # noqa: ANN202 - yields (parameter, its gradient or zeros)
    """The trainable parameters some rank has a gradient for, each with this rank's (zeros where it
    has none): the ones an average over ranks gives a gradient. Every rank."""
    for p in model.parameters():
        if not p.requires_grad:
            continue
        has = torch.tensor([0.0 if p.grad is None else 1.0])
        dist.all_reduce(has, op=dist.ReduceOp.MAX)
        if has.item() > 0:
            yield p, p.grad if p.grad is not None else torch.zeros_like(p)


def ddp_average(model: nn.Module, fp32: bool = False) -> None:
    """Average .grad over ranks as DDP does: None only where no rank has a gradient; ``fp32``:
    16-bit gradients summed in fp32 and rounded once."""
    for p, g in _with_some_gradient(model):
        g = g.float() if fp32 else g
        dist.all_reduce(g, op=dist.ReduceOp.SUM)
        p.grad = (g / dist.get_world_size()).to(p.dtype)


def rank_order_average(model: nn.Module) -> None:
    """Average .grad over ranks summing in rank order (every rank's gradient gathered, then added
    rank 0 first, then divided by the world size): the order shardopt's gloo reduction sums in, so
    that a comparison at 3 ranks is not blurred by the order gloo's ring adds in (fp32 addition is
    not associative). None only where no rank has a gradient."""
    world = dist.get_world_size()
    for p, g in _with_some_gradient(model):
        every = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(every, g.contiguous())
        total = every[0].clone()
        for other in every[1:]:
            total += other
        p.grad = total / world


def ref_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, zero: bool = True) -> None:
    if zero:
        opt.zero_grad()
    model(batch(dist.get_rank(), step)).backward()
    ddp_average(model)
    opt.step()


def param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p.detach().float() - q.detach().float()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


def error_of(fn) -> tuple[str, str] | None:
    try:
        fn()
    except (TypeError, ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return None
