"""The training setup the step-time benchmarks share: the example GPT and a stream of batches."""
from __future__ import annotations

import os
import sys
from typing import Callable

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def gpt_and_batches(rank: int, block_size: int, batch_size: int, **size: int) -> tuple[object, Callable[[], tuple]]:
    """(the example GPT built from seed 0 with ``size`` (n_layer, n_embd, n_head), a function that
    returns the next (inputs, targets) batch of ``batch_size`` x ``block_size`` bytes of text,
    seeded per rank). Call after ``init_process_group`` on every rank."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT, GPTConfig, load_bytes

    torch.manual_seed(0)
    cfg = GPTConfig(block_size=block_size, **size)
    model = GPT(cfg)
    data = load_bytes(None, limit=4 << 20)
    gen = torch.Generator().manual_seed(1 + rank)

    def batch() -> tuple:
        ix = torch.randint(len(data) - cfg.block_size - 1, (batch_size,), generator=gen)
        return (torch.stack([data[i:i + cfg.block_size] for i in ix]),
                torch.stack([data[i + 1:i + 1 + cfg.block_size] for i in ix]))

    return model, batch
