"""Scaling on your own cluster: step time, throughput, memory and traffic per rank at any N.

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_scaling.py                  # CPU, gloo
    torchrun --nnodes=$NODES --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \\
        benchmarks/bench_scaling.py --device cuda --size 350M --csv scaling.csv            # GPUs, NCCL
    python benchmarks/bench_scaling.py --plot scaling.csv                                  # table + PNG

Launched the way training is launched (torchrun, or srun + torchrun; see docs/cluster.md), it runs
each configuration in turn on the same ranks, with the same model (the example GPT), seeds and
data, and appends one CSV row per configuration to ``--csv``. Launches at N = 8, 16, 32, ... into
the same file build one table; ``--plot`` prints it with the scaling efficiency (tokens/s per rank
against the same configuration at the smallest N in the file) and draws efficiency and memory
against N.

Configurations (each what a careful user writes):
- ``ddp``: ``DistributedDataParallel`` + ``torch.optim.AdamW(fused=True)`` on the model's weights.
- ``fsdp2``: ``fully_shard`` per block and on the root, ``reshard_after_forward=False`` (ZeRO-2
  like), fused AdamW.
- ``deepspeed2``: DeepSpeed ZeRO-2 (``torch_adam``), when ``deepspeed`` imports.
- ``shardopt-flat``: ``ShardedAdamW(stage=2)`` sharded over every rank.
- ``shardopt-hybrid``: ``ShardedAdamW(stage=2, device_mesh=(N/S, S))``, sharded over S ranks
  (``--shard-size``, default the ranks of one node) and replicated across the N/S groups.

Weights and gradients are the compute dtype of each row (``--dtype``: fp32, or bf16 on GPUs with
an fp32 master everywhere); DDP and FSDP2 keep fp32 weights and reduce in that dtype.

Per row: median step time over ``--steps`` after ``--warmup``, tokens/s per rank, peak memory per
rank (CUDA: ``torch.cuda.max_memory_allocated`` since the configuration started, activations
included; CPU: the most bytes of live tensors other than activations, sampled after backward
and after the optimizer step: weights, gradients, optimizer state, communication buffers still
held), bytes each rank sent per step inside its shard group and across replicas (shardopt's own
counters, as ring algorithms move them; other libraries: blank) and the time shardopt's step was
blocked on communication. A configuration that raises is recorded as failed on every rank and the
next one runs; one that hangs past ``--timeout`` breaks the process group, so it and every later
one are recorded as not run and the launch exits. Every rank exits as soon as the rows are written.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
SIZES = {"tiny": dict(n_layer=2, n_embd=64, n_head=4), "10M": dict(n_layer=6, n_embd=384, n_head=6),
         "50M": dict(n_layer=8, n_embd=704, n_head=8), "350M": dict(n_layer=24, n_embd=1024, n_head=16),
         "1.3B": dict(n_layer=24, n_embd=2048, n_head=16)}
CONFIGS = ["ddp", "fsdp2", "shardopt-flat", "shardopt-hybrid", "deepspeed2"]
FIELDS = ["time", "world_size", "nodes", "backend", "size", "params", "dtype", "config", "shard_size", "status",
          "step_ms", "tokens_per_s_rank", "peak_mb", "sent_inside_mb", "sent_cross_mb", "comm_wait_ms"]


# ----------------------------------------------------------------------------------- one configuration
def _live_bytes() -> int:
    sys.path.insert(0, HERE)
    import gc
    import warnings

    from live_tensors import live_bytes

    gc.collect()  # the previous configuration's objects, in cycles, must not count
    with warnings.catch_warnings():  # walking every object touches deprecated ones
        warnings.simplefilter("ignore")
        return live_bytes(graph=False)


def build(name: str, model, args, device, mesh_shape):
    """(backward(x, y), step(): the optimizer step and zeroing, the ShardedAdamW or None) for ``name``."""
    import torch

    hp = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if name not in CONFIGS:
        raise ValueError(f"unknown configuration {name!r}; choose from {','.join(CONFIGS)}")
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **hp)

        def backward(x, y):
            net(x, y).backward()

        def step():
            opt.step()
            opt.zero_grad(set_to_none=False)
        return backward, step, None
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **hp)

        def backward(x, y):
            model(x, y).backward()

        def step():
            opt.step()
            opt.zero_grad()
        return backward, step, None
    if name == "deepspeed2":
        import deepspeed

        cfg = {"train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": hp["lr"], "betas": list(hp["betas"]),
                                                         "weight_decay": hp["weight_decay"], "torch_adam": True}},
               "zero_optimization": {"stage": 2}, "bf16": {"enabled": args.dtype == "bf16"}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

        def backward(x, y):
            engine.backward(engine(x, y))

        def step():
            engine.step()
        return backward, step, None
    import shardopt
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=("replicate", "shard")) \
        if name == "shardopt-hybrid" else None
    if args.dtype == "bf16":
        model.to(torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.param_groups(0.1), stage=2, device_mesh=mesh, **hp)

    def backward(x, y):
        opt.backward(model(x, y))

    def step():
        opt.step()
        opt.zero_grad()
    return backward, step, opt


def run_config(name: str, args, device, mesh_shape) -> dict:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    from gpt_batches import gpt_and_batches

    import gc

    gc.collect()  # what the previous configuration left in reference cycles
    rank = dist.get_rank()
    model, batch = gpt_and_batches(rank, args.block_size, args.batch_size, **SIZES[args.size])
    params = sum(p.numel() for p in model.parameters())
    model.to(device)  # fp32; shardopt rows cast to --dtype in build()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    backward, step, sharded = build(name, model, args, device, mesh_shape)
    peak, times, waits, inside, cross = 0, [], [], [], []
    for i in range(args.warmup + args.steps):
        x, y = (t.to(device) for t in batch())
        dist.barrier()
        t = time.perf_counter()
        backward(x, y)
        if i == args.warmup and not cuda:  # one sample of the timed steps, outside the timing
            t_pause = time.perf_counter()
            peak = max(peak, _live_bytes())
            t += time.perf_counter() - t_pause
        step()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
            if sharded is not None:
                stats = sharded.last_step_comm
                waits.append(stats.wait_seconds)
                a, b = sharded._comm.sent_bytes(stats, stage=2)
                inside.append(a)
                cross.append(b)
    if not cuda:
        peak = max(peak, _live_bytes())
    else:
        peak = torch.cuda.max_memory_allocated()
    step_s = statistics.median(times)
    row = {"params": params, "status": "ok", "step_ms": f"{step_s * 1e3:.1f}",
           "tokens_per_s_rank": f"{args.batch_size * args.block_size / step_s:.0f}", "peak_mb": f"{peak / 2**20:.1f}"}
    if sharded is not None:
        row.update(sent_inside_mb=f"{statistics.median(inside) / 2**20:.2f}",
                   sent_cross_mb=f"{statistics.median(cross) / 2**20:.2f}",
                   comm_wait_ms=f"{statistics.median(waits) * 1e3:.1f}", shard_size=str(sharded.inspect().shard_size))
        sharded.close()
    return row


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(args.threads)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    shard = args.shard_size or (local if local < world else max(1, world // 2))
    if world % shard:
        raise SystemExit(f"--shard-size {shard} must divide the {world} ranks")
    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"bench_scaling: {world} ranks on {world // local} node(s) ({backend}), GPT {args.size}, "
        f"batch {args.batch_size} x {args.block_size} per rank, hybrid mesh {world // shard} x {shard}", flush=True)
    configs = [c for c in args.configs.split(",") if c]
    rows, broken = [], None
    for name in configs:
        base = {"time": datetime.datetime.now().isoformat(timespec="seconds"), "world_size": world,
                "nodes": world // local, "backend": backend, "size": args.size, "dtype": args.dtype, "config": name,
                "shard_size": str(shard) if name == "shardopt-hybrid" else str(world) if name.startswith("shard") else ""}
        if broken is not None:
            rows.append({**base, "status": f"not run: {broken}"})
            continue
        if name == "deepspeed2":
            try:
                import deepspeed  # noqa: F401
            except Exception as e:  # noqa: BLE001 - any import failure means: not available here
                rows.append({**base, "status": f"skipped: deepspeed not importable ({type(e).__name__})"})
                continue
        if name == "shardopt-hybrid" and shard == world:
            rows.append({**base, "status": "skipped: the shard group is every rank (flat); pass --shard-size"})
            continue
        t = time.perf_counter()
        try:
            row, error = run_config(name, args, device, (world // shard, shard)), ""
        except Exception as e:  # noqa: BLE001 - recorded in the CSV, then the next configuration
            row, error = {}, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            if rank == 0 or os.environ.get("BENCH_SCALING_TRACEBACKS"):
                traceback.print_exc()
        # Every rank learns whether any failed (a timeout raises on the ranks that waited).
        try:
            flag = torch.tensor([1.0 if error else 0.0], device=device)
            dist.all_reduce(flag)
            failed = flag.item() > 0
        except Exception as e:  # noqa: BLE001 - the group is gone: nothing further can run
            failed, broken = True, f"process group broken after {name} ({type(e).__name__})"
        if failed:
            rows.append({**base, "status": f"failed: {error or 'on another rank'}"})
            log(f"  {name:<16} failed: {error or 'on another rank'}", flush=True)
            if "imeout" in error or "imed out" in error:
                broken = f"timed out in {name}"
            continue
        rows.append({**base, **row})
        log(f"  {name:<16} {row['step_ms']:>8} ms/step  {row['tokens_per_s_rank']:>8} tok/s/rank  "
            f"peak {row['peak_mb']} MiB  ({time.perf_counter() - t:.0f}s)", flush=True)
    if rank == 0:
        new = not os.path.exists(args.csv) or os.path.getsize(args.csv) == 0
        with open(args.csv, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            if new:
                w.writeheader()
            for r in rows:
                w.writerow({k: r.get(k, "") for k in FIELDS})
        log(f"appended {len(rows)} rows to {args.csv}", flush=True)
    if broken is None:
        dist.barrier()  # the rows are written before any rank leaves
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see MACHINE_NOTES: a gloo worker can deadlock in process-group teardown


# ----------------------------------------------------------------------------------- the table
def table(path: str) -> tuple[str, list[dict]]:
    """Markdown table of every ok row in ``path``, with the scaling efficiency of each row against
    the same (configuration, size, dtype, backend) at the smallest world size in the file."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f)]
    ok = [r for r in rows if r["status"] == "ok"]
    latest: dict[tuple, dict] = {}
    for r in ok:  # a later launch of the same configuration and N replaces an earlier one
        latest[(r["config"], r["size"], r["dtype"], r["backend"], int(r["world_size"]))] = r
    smallest: dict[tuple, dict] = {}
    for key, r in sorted(latest.items(), key=lambda kv: kv[0][4]):
        smallest.setdefault(key[:4], r)
    out = ["| N | nodes | configuration | shard size | step ms | tokens/s/rank | efficiency | peak MiB/rank | "
           "sent inside MiB | sent across MiB | comm wait ms |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, r in sorted(latest.items(), key=lambda kv: (kv[0][1], kv[0][4], CONFIGS.index(kv[0][0])
                                                          if kv[0][0] in CONFIGS else 99)):
        base = smallest[key[:4]]
        r["efficiency"] = float(r["tokens_per_s_rank"]) / float(base["tokens_per_s_rank"])
        out.append(f"| {r['world_size']} | {r['nodes']} | {r['config']} | {r['shard_size']} | {r['step_ms']} | "
                   f"{r['tokens_per_s_rank']} | {r['efficiency']:.2f} (vs N={base['world_size']}) | {r['peak_mb']} | "
                   f"{r['sent_inside_mb']} | {r['sent_cross_mb']} | {r['comm_wait_ms']} |")
    failed = [r for r in rows if r["status"] != "ok"]
    for r in failed:
        out.append(f"| {r['world_size']} | {r['nodes']} | {r['config']} | | {r['status']} | | | | | | |")
    return "\n".join(out), list(latest.values())


def plot(path: str, rows: list[dict], png: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in sorted({r["config"] for r in rows}):
        pts = sorted((int(r["world_size"]), r["efficiency"], float(r["peak_mb"])) for r in rows if r["config"] == name)
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        b.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=name)
    for ax, label in ((a, "scaling efficiency (tokens/s/rank vs smallest N)"), (b, "peak memory per rank, MiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks (N)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.suptitle(os.path.basename(path))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plot", metavar="CSV", help="print the table of CSV and draw CSV.png; runs nothing")
    ap.add_argument("--csv", default=os.path.join(ROOT, "benchmarks", "results", "scaling.csv"))
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--size", choices=sorted(SIZES), default="10M")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="shardopt and DeepSpeed weights/gradients (DDP and FSDP2 keep fp32)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--shard-size", type=int, default=0, help="hybrid shard group size (default: ranks per node)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a collective may wait before the run is failed")
    args = ap.parse_args()
    if args.plot:
        text, rows = table(args.plot)
        print(text)
        png = plot(args.plot, rows, os.path.splitext(args.plot)[0] + ".png")
        print(f"plot: {png}" if png else "matplotlib not installed: no plot")
        return 0
    if "RANK" not in os.environ:
        print("launch with torchrun, e.g. torchrun --standalone --nproc_per_node=2 benchmarks/bench_scaling.py "
              "(or --plot CSV to print a table)", file=sys.stderr)
        return 2
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
