"""Train a small byte-level GPT with ShardedAdamW under data parallelism.

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py              # CPU, gloo
    torchrun --standalone --nproc_per_node=8 examples/train_gpt.py --device cuda --param-dtype bf16 \
        --compute-dtype bf16 --n-layer 12 --n-embd 768 --n-head 12 --block-size 1024

Each rank reads different batches from a byte-level corpus (default: the Python standard library's
sources, so it runs offline; --data PATH for your own text). Prints step, loss, learning rate and
tokens/s as it trains, validation loss at the end, then the memory held per rank: ShardedAdamW
measured, its formula, and the same model under DDP + AdamW.

Checkpoints: --save-every N writes a sharded checkpoint to --ckpt-dir every N updates and at the
end, keeping the last --keep; --resume continues from the latest complete one (at any world size),
so the same command survives a restart. Under torchrun's elastic restarts (on gloo, give each
attempt its own store: torch 2.13 otherwise hands a restarted attempt the dead one's addresses):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=3 \
        examples/train_gpt.py --save-every 50 --resume

Tensor parallelism: --tp N splits each block Megatron-style over N ranks (examples/gpt.py,
``tensor_parallel``) on a (dp, tp) device mesh of the world's ranks; ShardedAdamW shards each rank's
part over the dp ranks. The N ranks of one tensor-parallel group read the same batches:

    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py --tp 2     # dp = 2, tp = 2

SHARDOPT_EXAMPLE_CRASH_AT_STEP=K makes the last rank exit abruptly before step K of the first
attempt (to try a restart).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shardopt  # noqa: E402
from gpt import GPT, GPTConfig, load_bytes, muon_param_groups, tensor_parallel  # noqa: E402

CATEGORIES = ("params", "grads", "master", "exp_avg", "exp_avg_sq", "extra", "buffers")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=None, help="text file or folder (default: Python's stdlib sources)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--stage", type=int, default=2, choices=(1, 2))
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"),
                   help="muon: ShardedMuon for the blocks' matrices (lr --muon-lr), AdamW for the rest")
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--master-weights", default="fp32")
    p.add_argument("--param-dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--compute-dtype", default="fp32", choices=sorted(DTYPES),
                   help="dtype of the matmuls (keep fp32 on CPUs without 16-bit matrix units)")
    p.add_argument("--loss-scale", default="auto", help="auto | dynamic | none | a number (static)")
    p.add_argument("--init-loss-scale", type=float, default=2.0**16, help="first scale of dynamic scaling")
    p.add_argument("--bucket-cap-mb", type=float, default=0.25, help="MiB; small model, small buckets")
    p.add_argument("--overlap-param-gather", action="store_true",
                   help="let the weight all-gather of the next forward overlap its compute")
    p.add_argument("--shard-size", type=int, default=0,
                   help="hybrid sharding: shard over groups of this many ranks (e.g. the GPUs of a node), "
                        "replicate across groups (0: shard over all ranks)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per block (Megatron-style); the world is dp x tp ranks")
    p.add_argument("--device", default="cpu")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--ckpt-dir", default="checkpoints", help="where --save-every writes and --resume looks")
    p.add_argument("--save-every", type=int, default=0, help="save every N updates and at the end (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint, if any")
    p.add_argument("--keep", type=int, default=2, help="keep the last K checkpoints")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    log = print if rank == 0 else (lambda *a, **k: None)

    data = load_bytes(args.data)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    torch.manual_seed(args.seed)  # the same initial model on every rank
    cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                    compute_dtype=DTYPES[args.compute_dtype])
    model = GPT(cfg).to(device=device, dtype=DTYPES[args.param_dtype])
    mesh, dp_rank, dp = None, rank, world
    if args.tp > 1:
        if world % args.tp or args.shard_size:
            raise SystemExit(f"--tp {args.tp} must divide the {world} ranks, and goes without --shard-size")
        dp = world // args.tp
        # ranks r*tp ... r*tp + tp - 1 split the blocks; on GPUs, keep them inside a node
        mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh["dp"].get_local_rank()
        try:
            tensor_parallel(model, mesh["tp"])
        except ValueError as e:
            raise SystemExit(f"--tp {args.tp}: {e}") from None
    if args.loss_scale == "dynamic" or (args.loss_scale == "auto" and args.param_dtype == "fp16"):
        loss_scale = shardopt.DynamicScaler(init_scale=args.init_loss_scale)
    else:
        loss_scale = args.loss_scale if args.loss_scale in ("auto", "none") else float(args.loss_scale)
    if args.shard_size and args.shard_size != world:
        if world % args.shard_size:
            raise SystemExit(f"--shard-size {args.shard_size} must divide the {world} ranks")
        # ranks 0..S-1 form the first shard group: with torchrun, the processes of one node
        mesh = init_device_mesh(device.type, (world // args.shard_size, args.shard_size),
                                mesh_dim_names=("replicate", "shard"))
    common = dict(stage=args.stage, master_weights=args.master_weights, device_mesh=mesh["dp"] if args.tp > 1 else mesh,
                  loss_scale=None if loss_scale == "none" else loss_scale,
                  bucket_cap_mb=args.bucket_cap_mb, overlap_param_gather=args.overlap_param_gather)
    if args.optimizer == "muon":  # the schedule below scales both rules' lr alike
        opt = shardopt.ShardedMuon(muon_param_groups(model, args.weight_decay, args.lr), lr=args.muon_lr, **common)
    else:
        opt = shardopt.ShardedAdamW(model.param_groups(args.weight_decay), lr=args.lr, betas=(0.9, 0.95), **common)

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to min_lr, as a factor of lr
        if step < args.warmup:
            return (step + 1) / args.warmup
        t = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return (args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * t))) / args.lr

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(args.seed + 1 + dp_rank)  # different batches on each dp rank

    def get_batch(src: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(src) - args.block_size - 1, (args.batch_size,), generator=g)
        x = torch.stack([src[i:i + args.block_size] for i in ix])
        y = torch.stack([src[i + 1:i + 1 + args.block_size] for i in ix])
        return x.to(device), y.to(device)

    latest = shardopt.latest_checkpoint(args.ckpt_dir) if args.resume else None
    if latest is not None:
        extra = shardopt.load_checkpoint(latest, model, opt)
        sched.load_state_dict(extra["scheduler"])
        for _ in range(opt.step_count + opt.skipped_steps):  # replay this rank's batch draws so far
            get_batch(train, gen)
        log(f"resumed from {latest} at step {opt.step_count}")

    def save_checkpoint() -> None:
        path, t = os.path.join(args.ckpt_dir, f"step_{opt.step_count:06d}"), time.perf_counter()
        shardopt.save_checkpoint(path, model, opt, extra={"scheduler": sched.state_dict()})
        if rank == 0:
            for old in shardopt.list_checkpoints(args.ckpt_dir)[:-max(args.keep, 1)]:
                shutil.rmtree(old)
        log(f"saved {path} in {time.perf_counter() - t:.2f}s")

    crash_at = int(os.environ.get("SHARDOPT_EXAMPLE_CRASH_AT_STEP", "-1"))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    n_params = sum(p.numel() for p in model.parameters())
    log(f"shardopt {shardopt.__version__} | torch {torch.__version__} | {world} ranks ({backend}) | "
        f"{n_params:,} parameters ({args.param_dtype} weights, {args.compute_dtype} compute) | "
        f"stage {args.stage}, master_weights={args.master_weights}"
        + (f", {world // args.shard_size} replicas x {args.shard_size}" if args.shard_size and mesh is not None else "")
        + (f", dp {dp} x tp {args.tp}" if args.tp > 1 else "") + f" | corpus {len(data):,} bytes")
    tokens_per_step = args.batch_size * args.block_size * dp
    t0, losses = time.perf_counter(), []
    it = 0
    t_log, it_log = t0, 0  # tokens/s over the iterations since the last log line
    while opt.step_count < args.steps:  # count updates: steps skipped on overflow are redone
        if opt.skipped_steps > 1000:
            raise RuntimeError(f"{opt.skipped_steps} steps skipped for inf/NaN gradients: training diverged")
        step = opt.step_count
        if step == crash_at and rank == world - 1 and first_attempt:
            print(f"rank {rank}: exiting abruptly before step {step} (SHARDOPT_EXAMPLE_CRASH_AT_STEP)", flush=True)
            os._exit(1)
        x, y = get_batch(train, gen)
        loss = model(x, y)
        opt.backward(loss)
        norm = opt.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad()
        it += 1
        if opt.step_was_skipped:
            continue  # the learning-rate schedule follows the updates actually made
        sched.step()
        if args.save_every and (opt.step_count % args.save_every == 0 or opt.step_count == args.steps):
            save_checkpoint()
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps - 1:
            now = time.perf_counter()
            dt, n_it = now - t_log, it - it_log
            t_log, it_log = now, it
            log(f"step {step:5d} | loss {loss.item():.4f} | lr {sched.get_last_lr()[0]:.2e} | "
                f"grad norm {norm.item():.3f} | {tokens_per_step * n_it / dt:,.0f} tok/s | {1e3 * dt / n_it:.0f} ms/iter"
                + (f" | loss scale {opt.loss_scale:g}, {opt.skipped_steps} skipped" if opt.loss_scale != 1.0 else ""))

    with torch.no_grad():
        vgen = torch.Generator().manual_seed(0)
        val_loss = sum(model(*get_batch(val, vgen)).item() for _ in range(8)) / 8
    vt = torch.tensor([val_loss], device=device)
    dist.all_reduce(vt)
    finite = all(bool(torch.isfinite(getattr(p, "_local_tensor", p)).all()) for p in model.parameters())
    log(f"final train loss {sum(losses[-10:]) / len(losses[-10:]):.4f} (mean of last 10) | "
        f"val loss {vt.item() / world:.4f} | {args.steps} steps in {time.perf_counter() - t0:.1f}s | "
        f"{opt.skipped_steps} skipped | weights finite: {'yes' if finite else 'NO'}")

    report = opt.memory_report()
    mine = torch.tensor([getattr(report, c) for c in CATEGORIES], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    reports = [dataclasses.replace(report, rank=r, **dict(zip(CATEGORIES, t.tolist()))) for r, t in enumerate(every)]
    log("\n" + memory_table(reports, DTYPES[args.param_dtype], tp=args.tp))
    dist.destroy_process_group()


def memory_table(reports: list, param_dtype: torch.dtype, tp: int = 1) -> str:
    """Markdown table of bytes per rank: shardopt measured (each rank), formula, and DDP + AdamW.
    With tensor parallelism (``tp`` > 1) every figure is for the rank's own part of the model."""
    n = reports[0].num_params
    ddp = shardopt.ddp_adamw_bytes(n, param_dtype)
    cats = list(CATEGORIES)
    head = ["category"] + [f"rank {r.rank} measured" for r in reports] + ["shardopt formula", "DDP + AdamW"]
    rows = [head, ["---"] * len(head)]
    for c in cats + ["total"]:
        m = [r.total if c == "total" else getattr(r, c) for r in reports]
        f = reports[0].predicted_total if c == "total" else reports[0].predicted.get(c, 0)
        d = sum(ddp.values()) if c == "total" else ddp[c]
        rows.append([c] + [f"{v / 2**20:,.2f} MiB" for v in m] + [f"{f / 2**20:,.2f} MiB", f"{d / 2**20:,.2f} MiB"])
    per_param = [f"{r.total / n:.2f}" for r in reports]
    rows.append(["bytes/param"] + per_param + [f"{reports[0].predicted_total / n:.2f}", f"{sum(ddp.values()) / n:.2f}"])
    width = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, width))) + " |"
             for row in rows]
    lines[1] = "|" + "|".join("-" * (w + 2) for w in width) + "|"
    ratio = sum(ddp.values()) / max(reports[0].total, 1)
    shard = reports[0].shard_size
    hybrid = f" sharded over {shard} ({len(reports) // shard} replicas)" if shard and shard != len(reports) else ""
    what = f"{n:,} parameters, {len(reports)} ranks{hybrid}"
    if tp > 1:  # each rank holds a part: 1/tp of the split matrices and all of the replicated rest
        what = (f"{len(reports)} ranks as dp {len(reports) // tp} x tp {tp}; with --tp the figures are for each "
                f"rank's part of the model ({n:,} parameters: 1/{tp} of the split matrices, all of the rest), "
                f"sharded over the {len(reports) // tp} dp ranks, and DDP + AdamW is for the same part")
    return (f"Memory per rank, {what}, stage {reports[0].stage} "
            f"(MiB = 2^20 bytes):\n" + "\n".join(lines) + f"\nDDP + AdamW needs {ratio:.2f}x the bytes of rank 0 here.")


if __name__ == "__main__":
    main()
