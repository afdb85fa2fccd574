"""Train a tiny GPT-2 with PyTorch Lightning and shardopt's ShardedStrategy (ZeRO-2 on CPU ranks).

    torchrun --nproc_per_node=2 examples/lightning_gpt.py
    python examples/lightning_gpt.py --devices 2          # Lightning launches the processes itself
    torchrun --nproc_per_node=2 examples/lightning_gpt.py --precision bf16-true --stage 1

The LightningModule is ordinary Lightning code: it returns a plain torch.optim.AdamW and a per-step
schedule from configure_optimizers; the strategy turns the AdamW into a ShardedAdamW (each rank keeps
1/N of the Adam moments, master weights and, in stage 2, gradients) and points the scheduler at it.
Prints the loss as it trains, then the bytes each rank holds.
"""
from __future__ import annotations

import argparse
import math
import os

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from shardopt.integrations.lightning import ShardedStrategy

VOCAB, SEQ = 96, 32


class TinyGPT(pl.LightningModule):
    def __init__(self, lr: float, steps: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same random init on every rank
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.gpt = GPT2LMHeadModel(cfg)
        self.lr, self.steps = lr, steps

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.gpt(input_ids=batch, labels=batch).loss
        self.log("loss", loss)
        self.last_loss = loss.item()  # this rank's last micro-batch
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        norm = self.trainer.strategy.last_grad_norm  # global norm over all ranks and shards, before clipping
        self.log("grad_norm", norm)
        if self.trainer.is_global_zero and self.global_step % 10 == 0:
            lr = optimizer.param_groups[0]["lr"]
            print(f"step {self.global_step:4d} | loss {self.last_loss:.4f} | grad norm {norm:.3f} | lr {lr:.2e}",
                  flush=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim >= 2]
        rest = [p for p in self.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                lr=self.lr, betas=(0.9, 0.95))

        def warmup_cosine(step: int) -> float:
            return min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(step, self.steps) / self.steps))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_end(self) -> None:
        report = self.trainer.strategy.optimizers[0].memory_report()
        for rank in range(self.trainer.world_size):  # one rank at a time, so the tables do not interleave
            if rank == self.global_rank:
                print(report, flush=True)
            self.trainer.strategy.barrier()


def pattern_tokens(n: int) -> torch.Tensor:
    """Sequences in which each token is the previous one plus 1, 2 or 3: learnable, no download."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    return (start + torch.randint(1, 4, (n, SEQ), generator=g).cumsum(1)) % VOCAB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=None, help="default: $WORLD_SIZE under torchrun, else 2")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--precision", default="32-true", help="32-true, bf16-true, 16-true or bf16-mixed")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8, help="per device")
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    devices = args.devices or int(os.environ.get("WORLD_SIZE", 2))
    samples = args.steps * args.accumulate * args.batch_size * devices  # one epoch of max_steps
    data = DataLoader(pattern_tokens(samples), batch_size=args.batch_size)
    trainer = pl.Trainer(strategy=ShardedStrategy(stage=args.stage), accelerator="cpu", devices=devices,
                         precision=args.precision, max_steps=args.steps, accumulate_grad_batches=args.accumulate,
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(TinyGPT(args.lr, args.steps), data)


if __name__ == "__main__":
    main()
