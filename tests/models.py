"""Tiny models shared by the tests (importable in spawned ranks)."""
from __future__ import annotations

import torch
from torch import nn


class TinyNet(nn.Module):
    """Odd shapes, a tied weight used twice, an unused parameter and a frozen one."""

    def __init__(self, vocab: int = 11, dim: int = 17, hidden: int = 29) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter, two uses
        self.unused = nn.Parameter(torch.randn(5))  # never gets a gradient
        self.frozen = nn.Parameter(torch.randn(3, 3), requires_grad=False)
        self.scalar = nn.Parameter(torch.tensor(0.5))  # one element, fewer than the ranks

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        h = torch.relu(self.norm(self.fc1(x)))
        x = x + self.fc2(h) * self.scalar
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), idx.roll(1, dims=-1).view(-1))


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, **kw) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(**kw).to(dtype)


def batch(rank: int, step: int, vocab: int = 11, n: int = 4, t: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (n, t), generator=g)


def param_groups(model: nn.Module, lr: float = 1e-2) -> list[dict]:
    """Two groups, as in GPT training: matrices with weight decay, the rest without, own lr/betas."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": other, "weight_decay": 0.0, "lr": lr * 0.5, "betas": (0.8, 0.99)},
    ]


def small_gpt(dtype: torch.dtype = torch.bfloat16):
    """The example GPT (examples/gpt.py) at 2 layers, 64 wide, 4 heads, 16 tokens, seed 0."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=16)).to(dtype)


def gpt_steps(model: nn.Module, opt, seed: int, steps: int = 2) -> None:
    """``steps`` training steps of ``small_gpt`` on random bytes from ``seed`` (2 sequences each)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=g)
        opt.backward(model(x, x.roll(1, dims=1)))
        opt.step()
        opt.zero_grad()
