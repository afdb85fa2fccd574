"""Train a small GPT-2 with Hugging Face Accelerate's standard loop, its optimizer sharded by shardopt.

    torchrun --standalone --nproc_per_node=2 examples/accelerate_gpt.py        # CPU, gloo
    accelerate launch --multi_gpu --num_processes=8 examples/accelerate_gpt.py --mixed-precision bf16

The one change from a plain Accelerate script: ``shardopt.integrations.accelerate.prepare(
accelerator, model, optimizer, ...)`` instead of ``accelerator.prepare(model, optimizer, ...)``;
a plain ``torch.optim.AdamW`` is converted (``stage=2``). The loop itself is Accelerate's:
``accumulate``, ``backward``, ``clip_grad_norm_``, ``save_state``; --resume loads the last state
saved, at any number of processes.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

import shardopt.integrations.accelerate as so_accelerate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import load_bytes  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--mixed-precision", default="no")
    p.add_argument("--state", default="runs/accelerate_gpt/state")
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    acc = Accelerator(gradient_accumulation_steps=2, mixed_precision=a.mixed_precision,
                      cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=256, n_positions=128))
    data = load_bytes(None, limit=1 << 20)
    chunks = data[: len(data) // 128 * 128].long().view(-1, 128)
    loader = torch.utils.data.DataLoader(chunks, batch_size=8, shuffle=True)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    model, opt, loader, sched = so_accelerate.prepare(acc, model, opt, loader, sched, stage=a.stage)
    if a.resume and os.path.isdir(a.state):
        acc.load_state(a.state)
    step = 0
    for micro, x in enumerate(loader):
        with acc.accumulate(model):
            loss = model(input_ids=x, labels=x).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norm = acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            step += 1
            if step % 10 == 0 or step == 1:
                acc.print(f"step {step:4d} | loss {loss.item():.4f} | grad norm {norm.item():.3f} | "
                          f"lr {sched.get_last_lr()[0]:.2e}")
            if step == a.steps:
                break
    acc.save_state(a.state)
    acc.print(opt.memory_report())


if __name__ == "__main__":
    main()
