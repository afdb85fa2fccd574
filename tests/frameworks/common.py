"""What the framework workers share: a tiny GPT-2 (random init, no downloads), token data, and
the numbers each run reports."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import write_result  # noqa: E402,F401  (re-exported for the workers)

VOCAB, SEQ, SAMPLES = 96, 16, 64


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    """A 2-layer GPT-2 (about 40k parameters) with dropout off, so runs are deterministic."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def tokens(n: int = SAMPLES, seed: int = 1) -> torch.Tensor:
    """``n`` sequences of SEQ tokens with a learnable pattern (each token a function of the last)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    steps = torch.randint(1, 4, (n, SEQ), generator=g)
    return (start + steps.cumsum(1)) % VOCAB


def weights(model: torch.nn.Module) -> dict[str, list[float]]:
    """A model's weights, flattened, for JSON."""
    return {k: v.detach().float().reshape(-1).tolist() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(max(abs(x - y) for x, y in zip(a[k], b[k])) for k in a)
