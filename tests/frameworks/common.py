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


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """Muon's share of GPT-2: the 2-D weights but the token and position embeddings (which the
    head shares); the rest trains with AdamW."""
    return p.dim() == 2 and not name.endswith(("transformer.wte.weight", "transformer.wpe.weight"))


def torch_muon_pair(model: torch.nn.Module, adamw_lr: float) -> tuple:
    """What a user hands a framework: torch.optim.Muon (lr 0.02, momentum 0.9) for the hidden
    matrices, torch.optim.AdamW for the rest, and a per-step LambdaLR on each (different schedules)."""
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if is_hidden_matrix(n, p)], lr=0.02, momentum=0.9)
    adamw = torch.optim.AdamW([p for n, p in named if not is_hidden_matrix(n, p)], lr=adamw_lr, betas=(0.9, 0.95))
    lr = torch.optim.lr_scheduler
    return muon, adamw, (lr.LambdaLR(muon, lambda s: 0.8 ** s), lr.LambdaLR(adamw, lambda s: min(1.0, (s + 1) / 3)))
