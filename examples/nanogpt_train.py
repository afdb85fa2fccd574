"""A nanoGPT-style ``train.py`` with shardopt: each edit a nanoGPT user makes is marked ``# shardopt``
and keeps the original line beside it, selected by ``use_shardopt`` (docs/nanogpt.md shows them
as a diff).

    torchrun --standalone --nproc_per_node=2 examples/nanogpt_train.py                      # shardopt
    torchrun --standalone --nproc_per_node=2 examples/nanogpt_train.py --use_shardopt=False # DDP + AdamW
    torchrun --standalone --nproc_per_node=1 examples/nanogpt_train.py --init_from=resume   # resume, any N

Config values are globals overridable with ``--key=value``, as in nanoGPT. Data: byte-level text
of the Python standard library's sources (offline). The model is ``examples/gpt.py``'s GPT.
"""
from __future__ import annotations

import ast
import math
import os
import sys
import time
from contextlib import nullcontext

import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shardopt.integrations import from_torch_adamw  # noqa: E402  # shardopt
from gpt import GPT, GPTConfig, load_bytes  # noqa: E402

# -- config -------------------------------------------------------------------------------------
out_dir = "out-nanogpt"
eval_interval, eval_iters, log_interval = 10, 4, 1
always_save_checkpoint, init_from = True, "scratch"  # 'scratch' or 'resume'
gradient_accumulation_steps, batch_size, block_size = 4, 4, 64  # accumulation over all processes
n_layer, n_head, n_embd = 2, 2, 64
learning_rate, max_iters, weight_decay, beta1, beta2, grad_clip = 1e-3, 30, 0.1, 0.9, 0.95, 1.0
decay_lr, warmup_iters, lr_decay_iters, min_lr = True, 5, 30, 1e-4
backend, device, dtype = "gloo", "cpu", "float32"
use_shardopt, stage = True, 2  # shardopt
for arg in sys.argv[1:]:  # --key=value, as nanoGPT's configurator.py
    key, value = arg[2:].split("=", 1)
    assert key in globals(), f"unknown config key {key}"
    globals()[key] = value if isinstance(globals()[key], str) else ast.literal_eval(value)

# -- setup ----------------------------------------------------------------------------------------
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend=backend)
    ddp_rank, ddp_world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master_process, seed_offset = ddp_rank == 0, ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if dtype == "float32" else torch.autocast(device_type=device.split(":")[0], dtype=ptdtype)

data = load_bytes(None, limit=2 << 20)
split = int(0.9 * len(data))
train_data, val_data = data[:split], data[split:]


def get_batch(which: str) -> tuple[torch.Tensor, torch.Tensor]:
    d = train_data if which == "train" else val_data
    ix = torch.randint(len(d) - block_size - 1, (batch_size,))
    x = torch.stack([d[i:i + block_size].long() for i in ix])
    y = torch.stack([d[i + 1:i + 1 + block_size].long() for i in ix])
    return x.to(device), y.to(device)


model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, vocab_size=256)
iter_num, best_val_loss = 0, 1e9
model = GPT(GPTConfig(**model_args))
if init_from == "resume":
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location=device, weights_only=False)
    model.load_state_dict(checkpoint["model"])
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
model.to(device)

scaler = torch.amp.GradScaler(enabled=(dtype == "float16") and not use_shardopt)
optimizer = torch.optim.AdamW(model.param_groups(weight_decay), lr=learning_rate, betas=(beta1, beta2))
if use_shardopt:  # shardopt: the same groups, sharded (fp16 autocast: shardopt scales the loss)
    optimizer = from_torch_adamw(optimizer, stage=stage, loss_scale="dynamic" if dtype == "float16" else "auto")
if init_from == "resume":
    optimizer.load_state_dict(checkpoint["optimizer"])  # shardopt: unchanged; loads at any world size
    checkpoint = None
if ddp and not use_shardopt:  # shardopt: no DDP wrapper, the optimizer reduces the gradients
    model = DDP(model)
raw_model = model.module if isinstance(model, DDP) else model


@torch.no_grad()
def estimate_loss() -> dict[str, float]:
    out = {}
    model.eval()
    for which in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            x, y = get_batch(which)
            with ctx:
                losses[k] = model(x, y).item()
        out[which] = losses.mean().item()
    model.train()
    return out


def get_lr(it: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


# -- training loop --------------------------------------------------------------------------------
X, Y = get_batch("train")
t0 = time.time()
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for group in optimizer.param_groups:
        group["lr"] = lr
    if iter_num % eval_interval == 0:
        if use_shardopt:  # shardopt: every rank gathers the whole state before rank 0 saves it
            optimizer.consolidate_state_dict()
        if master_process:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
            if (losses["val"] < best_val_loss or always_save_checkpoint) and iter_num > 0:
                best_val_loss = losses["val"]
                checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                              "model_args": model_args, "iter_num": iter_num, "best_val_loss": best_val_loss}
                print(f"saving checkpoint to {out_dir}", flush=True)
                torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
    if iter_num >= max_iters:
        break
    for micro_step in range(gradient_accumulation_steps):
        last = micro_step == gradient_accumulation_steps - 1
        if isinstance(model, DDP):
            model.require_backward_grad_sync = last
        with optimizer.no_sync() if use_shardopt and not last else nullcontext():  # shardopt: local accumulation
            with ctx:
                loss = model(X, Y) / gradient_accumulation_steps
            X, Y = get_batch("train")
            if use_shardopt:
                optimizer.backward(loss)  # shardopt: instead of scaler.scale(loss).backward()
            else:
                scaler.scale(loss).backward()
    norm = float("nan")
    if grad_clip != 0.0:
        if use_shardopt:  # shardopt: the global norm over all ranks and shards
            norm = optimizer.clip_grad_norm_(grad_clip)
        else:
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if use_shardopt:
        optimizer.step()  # shardopt: instead of scaler.step(optimizer); scaler.update()
    else:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.6f}, grad norm {float(norm):.6f}, time {dt * 1000:.0f}ms", flush=True)
    iter_num += 1

if ddp:
    destroy_process_group()
