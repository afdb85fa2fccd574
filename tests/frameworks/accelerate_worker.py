"""Accelerate's standard loop, with torch.optim.AdamW (DDP) and with shardopt, under torchrun.

``parity <state_dir>`` (2 ranks): the reference AdamW run; shardopt stage 1 (a plain AdamW
converted by ``prepare``) and stage 2 (a ShardedAdamW), each with clipping, accumulation 2 and
a warmup schedule; the stage-2 run saves its state halfway through and goes on, exports its
weights with ``save_model``, shares the accelerator with a plain DDP model, and is resumed from
that state in fresh objects; stage 2 once more with the model prepared in a call of its own; a
torch.optim.Muon + torch.optim.AdamW pair with a schedule each, under DDP and converted by
``prepare`` into one ShardedMuon. ``resume <state_dir>`` (any number of ranks): the resume alone.
"""
from __future__ import annotations

import os
import sys

import safetensors.torch
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

import shardopt
import shardopt.integrations.accelerate as so_accelerate
from common import tiny_gpt2, tokens, torch_muon_pair, weights, write_result

ACCUM, CLIP, LR, MICRO = 2, 0.5, 3e-3, 8  # micro-batches per rank in a full run
SAVE_AFTER = 4  # micro-batches (two optimizer steps) before save_state


def groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def build(kind: str, stage: int = 2, split: bool = False):
    acc = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    model = tiny_gpt2(seed=0)
    per_rank = 8 // acc.num_processes  # the same global batch at any number of processes
    data = DataLoader(tokens(), batch_size=per_rank, shuffle=False)
    if kind == "sharded":
        opt = shardopt.ShardedAdamW(groups(model), lr=LR, betas=(0.9, 0.95), stage=stage)
    else:
        opt = torch.optim.AdamW(groups(model), lr=LR, betas=(0.9, 0.95))
    lr = torch.optim.lr_scheduler  # a composite schedule: its inner schedulers must follow a converted AdamW
    sched = lr.SequentialLR(opt, [lr.LinearLR(opt, start_factor=1 / 3, total_iters=2),
                                  lr.LambdaLR(opt, lambda s: 1.0)], milestones=[2])
    if kind == "adamw":
        model, opt, data, sched = acc.prepare(model, opt, data, sched)
    elif kind == "converted" and split:  # the model alone first, then the rest
        model = so_accelerate.prepare(acc, model, stage=stage)
        opt, data, sched = so_accelerate.prepare(acc, opt, data, sched, stage=stage)
    elif kind == "converted":
        model, opt, data, sched = so_accelerate.prepare(acc, model, opt, data, sched, stage=stage)
    else:
        model, opt, data, sched = so_accelerate.prepare(acc, model, opt, data, sched)
    return acc, model, opt, data, sched


def train(acc, model, opt, data, sched, skip: int = 0, save_to: str | None = None) -> dict:
    losses, norms = [], []
    batches = acc.skip_first_batches(data, skip) if skip else data
    for i, batch in enumerate(batches, start=skip):
        with acc.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(float(loss))
        if save_to is not None and i + 1 == SAVE_AFTER:
            acc.save_state(save_to)
    return {"losses": losses, "norms": norms, "weights": weights(acc.unwrap_model(model))}


def freeze_mid_run(acc, model, opt, data) -> str:
    """Freeze part of the model after training started, then clip over model.parameters()."""
    for p in acc.unwrap_model(model).transformer.ln_f.parameters():
        p.requires_grad_(False)
    batch = next(iter(data))
    with acc.accumulate(model):
        acc.backward(model(input_ids=batch, labels=batch).loss)
    with acc.accumulate(model):
        acc.backward(model(input_ids=batch, labels=batch).loss)
        acc.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return "ok"


def muon_run(kind: str) -> dict:
    """The torch pair (Muon for GPT-2's hidden matrices, AdamW for the rest), each optimizer with its
    own per-step schedule, stepped one after the other: under DDP (``kind`` "ddp") or converted."""
    acc = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    model = tiny_gpt2(seed=0)
    data = DataLoader(tokens(), batch_size=8 // acc.num_processes, shuffle=False)
    muon, adamw, (s1, s2) = torch_muon_pair(model, LR)
    if kind == "ddp":
        model, muon, adamw, data, s1, s2 = acc.prepare(model, muon, adamw, data, s1, s2)
    else:
        model, muon, adamw, data, s1, s2 = so_accelerate.prepare(acc, model, muon, adamw, data, s1, s2, stage=2)
    losses, norms, lrs = [], [], []
    for batch in data:
        with acc.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
                lrs.append(s1.get_last_lr() + s2.get_last_lr())
            for opt in (muon, adamw):
                opt.step()
            for sched in (s1, s2):
                sched.step()
            for opt in (muon, adamw):
                opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "norms": norms, "lrs": lrs, "weights": weights(acc.unwrap_model(model)),
            "optimizers": [type(o.optimizer).__name__ for o in (muon, adamw)],
            "ddp": isinstance(model, torch.nn.parallel.DistributedDataParallel)}


def memory(opt) -> dict:
    r = opt.memory_report()
    return {"grads": r.grads, "master": r.master, "exp_avg": r.exp_avg, "exp_avg_sq": r.exp_avg_sq,
            "numel": sum(p.numel() for g in opt.param_groups for p in g["params"])}


def resume(state_dir: str) -> dict:
    acc, model, opt, data, sched = build("sharded")
    acc.load_state(state_dir)
    out = train(acc, model, opt, data, sched, skip=SAVE_AFTER)
    out["lr"] = sched.get_last_lr()
    return out


def main() -> None:
    what, state_dir = sys.argv[1], sys.argv[2]
    if what == "resume":
        write_result({"resume": resume(state_dir)})
        return
    result = {}
    acc, model, opt, data, sched = build("adamw")
    result["adamw"] = train(acc, model, opt, data, sched)
    result["ddp"] = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    acc, model, opt, data, sched = build("converted", stage=1)
    result["stage1"] = train(acc, model, opt, data, sched)
    result["stage1_is_sharded"] = isinstance(opt.optimizer, shardopt.ShardedAdamW)
    acc, model, opt, data, sched = build("sharded", stage=2)
    result["stage2"] = train(acc, model, opt, data, sched, save_to=state_dir)
    result["stage2"]["lr"] = sched.get_last_lr()
    result["stage2_ddp"] = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    result["memory"] = memory(opt)
    try:  # clipping part of the parameters cannot be done on a global norm
        acc.clip_grad_norm_(list(model.parameters())[:3], 1.0)
        result["subset_clip"] = None
    except ValueError as e:
        result["subset_clip"] = str(e)
    acc.save_model(model, state_dir + "-model")  # what a user exports: every weight, from copies
    acc.wait_for_everyone()  # the main process writes the file
    saved = safetensors.torch.load_file(os.path.join(state_dir + "-model", "model.safetensors"))
    exported = tiny_gpt2(seed=5)
    exported.load_state_dict(saved, strict=False)
    result["exported"] = weights(exported)
    other = tiny_gpt2(seed=6)  # a second model on the same accelerator, with plain AdamW: DDP as usual
    other, other_opt = acc.prepare(other, torch.optim.AdamW(other.parameters()))
    result["other_is_ddp"] = isinstance(other, torch.nn.parallel.DistributedDataParallel)
    result["other_is_plain"] = type(other_opt.optimizer) is torch.optim.AdamW
    acc, model, opt, data, sched = build("converted", stage=2, split=True)
    result["split"] = train(acc, model, opt, data, sched, save_to=state_dir + "-split")
    result["split_ddp"] = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    result["frozen_mid_run"] = freeze_mid_run(acc, model, opt, data)
    acc.free_memory()  # and a new model and optimizer on the same accelerator, as a new trial would
    fresh = tiny_gpt2(seed=0)
    fresh, fresh_opt = so_accelerate.prepare(acc, fresh, torch.optim.AdamW(fresh.parameters(), lr=LR), stage=2)
    result["after_free_memory"] = isinstance(fresh_opt.optimizer, shardopt.ShardedAdamW)
    acc.wait_for_everyone()
    result["resume"] = resume(state_dir)
    result["muon_ddp"], result["muon"] = muon_run("ddp"), muon_run("sharded")
    write_result(result)


if __name__ == "__main__":
    main()
