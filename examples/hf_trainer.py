"""Fine-tune a small GPT-2 with transformers.Trainer, its optimizer sharded by shardopt.

    torchrun --standalone --nproc_per_node=2 examples/hf_trainer.py            # CPU, gloo
    torchrun --standalone --nproc_per_node=8 examples/hf_trainer.py --bf16     # GPUs, nccl

The one change from a plain Trainer script is the class: ``ShardedTrainer(...,
shardopt_kwargs={"stage": 2})`` instead of ``Trainer(...)``. TrainingArguments keep their meaning
(learning rate, weight decay, betas, max_grad_norm, accumulation, schedule, checkpoints). The
model (a 4-layer GPT-2, random init so it runs offline) learns byte-level text from the Python
standard library's sources. Rerun with --resume to continue from the last checkpoint, at any
number of processes.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from shardopt.integrations.hf import ShardedTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import load_bytes  # noqa: E402


class Chunks(torch.utils.data.Dataset):
    """Fixed-length byte sequences; the model shifts the labels itself."""

    def __init__(self, data: torch.Tensor, length: int) -> None:
        self.data, self.length = data, length

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.length

    def __getitem__(self, i: int) -> dict:
        x = self.data[i * self.length:(i + 1) * self.length].long()
        return {"input_ids": x, "labels": x}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--out", default="runs/hf_trainer")
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    cfg = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=256, n_positions=128)
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=8,
                             gradient_accumulation_steps=2, learning_rate=1e-3, weight_decay=0.1, adam_beta2=0.95,
                             max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=5, logging_steps=10,
                             save_steps=max(1, a.steps // 2), save_total_limit=2, bf16=a.bf16, report_to=[],
                             use_cpu=not torch.cuda.is_available(), disable_tqdm=True, seed=0)
    data = load_bytes(None, limit=1 << 20)
    trainer = ShardedTrainer(model=model, args=args, train_dataset=Chunks(data, 128),
                             shardopt_kwargs={"stage": a.stage})
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    if trainer.is_world_process_zero():
        print(trainer.sharded_optimizer.memory_report())


if __name__ == "__main__":
    main()
