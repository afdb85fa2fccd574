"""Gradient accumulation: what each way of summing micro-batches costs in bytes and step time.

    python benchmarks/bench_accumulation.py                  # 2 gloo ranks, 8 micro-batches per step (~3 min)
    python benchmarks/bench_accumulation.py --micro 4 --steps 4

The driver launches ``torchrun --standalone --nproc_per_node=2`` once per configuration on the
example GPT (about 10M parameters, bf16 weights for shardopt) with the same seeds and data. One
optimizer step sums ``--micro`` micro-batches. Rows:

* ``DDP no_sync``: fp32 weights, DDP with ``no_sync`` on all but the last micro-batch, fused
  AdamW: what a careful DDP user writes; its gradient (4 B/param) is the accumulation buffer.
* ``shardopt S2 no_sync, fp32 sum``: the default ``accumulate_dtype=torch.float32``: one
  reduction per step, the sum in an unsharded fp32 buffer while accumulating (4 B/param).
* ``shardopt S2 no_sync, bf16 sum``: ``accumulate_dtype=None``: the sum in ``p.grad`` in bf16
  (2 B/param, as DDP's ``no_sync`` with bf16 weights), rounded at every micro-batch.
* ``shardopt S2 reduce each, fp32 shard``: no ``no_sync``: every micro-batch is reduced and the
  averages are summed in an fp32 gradient shard (4/N B/param), no unsharded copy.

Both keep their default buckets (25 MiB). Reported per rank 0: median step time, gradient bytes
fed into reductions per step, and memory from the
optimizer's report (``peak_total``: weights, state, and gradients plus buffers at their highest
at one moment) next to its ``buffers`` high-water mark; for DDP the model-state bytes (weights,
gradients, AdamW state). Peak RSS for all. Writes benchmarks/results/accumulation.md.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch as launch  # noqa: E402
CONFIGS = {
    "ddp": "DDP no_sync (fp32 weights, fused AdamW)",
    "nosync-fp32": "shardopt S2 no_sync, fp32 sum",
    "nosync-bf16": "shardopt S2 no_sync, bf16 sum",
    "each": "shardopt S2 reduce each, fp32 shard",
}


def worker(args: argparse.Namespace) -> None:
    import contextlib

    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import shardopt
    from gpt_batches import gpt_and_batches

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, batch = gpt_and_batches(rank, args.block_size, args.batch_size, n_layer=6, n_embd=384, n_head=6)

    hp = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    name = args.config
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **hp)

        def train_step() -> None:
            for i in range(args.micro):
                with net.no_sync() if i < args.micro - 1 else contextlib.nullcontext():
                    (net(*batch()) / args.micro).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        def memory() -> dict:
            tensors = list(model.parameters()) + [p.grad for p in model.parameters()]
            tensors += [s for v in opt.state.values() for s in v.values() if torch.is_tensor(s) and s.dim()]
            return {"model states": sum(t.numel() * t.element_size() for t in tensors if t is not None)}

        sent = lambda: sum(p.numel() * 4 for p in model.parameters())  # noqa: E731  the gradient, once per step
    else:
        model = model.to(torch.bfloat16)
        opt = shardopt.ShardedAdamW(model.parameters(), **hp, stage=2, loss_scale=None,
                                    accumulate_dtype=None if name == "nosync-bf16" else torch.float32)

        def train_step() -> None:
            for i in range(args.micro):
                quiet = name != "each" and i < args.micro - 1
                with opt.no_sync() if quiet else contextlib.nullcontext():
                    opt.backward(model(*batch()) / args.micro)
            opt.step()
            opt.zero_grad()

        def memory() -> dict:
            r = opt.memory_report()
            return {"peak total": r.peak_total, "buffers": r.buffers}

        sent = None
    for _ in range(args.warmup):
        train_step()
    if name != "ddp":
        opt.reset_peak_memory()
    times, reduced = [], []
    for _ in range(args.steps):
        t = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - t)
        if name != "ddp":
            reduced.append(opt.last_step_comm.reduce_bytes)  # gradient bytes fed into reductions
    res = {"config": name, "step_s": statistics.median(times), "times": times, **memory(),
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "num_params": sum(p.numel() for p in model.parameters())}
    res["sent_per_step"] = sent() if sent else statistics.median(reduced)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(res, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # see MACHINE_NOTES: a gloo worker can deadlock in process-group teardown


def run_config(config: str, args: argparse.Namespace) -> dict | str:
    out = tempfile.mktemp(suffix=".json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--worker",
           "--config", config, "--result", out, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--micro", str(args.micro), "--batch-size", str(args.batch_size), "--block-size", str(args.block_size)]
    code, stdout, stderr = launch.run(cmd, args.timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if code is None:  # killed with every process it started
        return f"timed out after {args.timeout} s"
    output = stdout + stderr
    if code != 0 or not os.path.exists(out):
        return "failed: " + " / ".join(output.strip().splitlines()[-3:])[:300]
    with open(out) as f:
        res = json.load(f)
    os.remove(out)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="ddp")
    ap.add_argument("--result", default="")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    rows = {}
    for c in args.configs.split(","):
        rows[c] = run_config(c, args)
        r = rows[c]
        print(f"{CONFIGS[c]:<44} " + (f"{r['step_s'] * 1e3:8.0f} ms/step" if isinstance(r, dict) else r), flush=True)
    mib = lambda b: f"{b / 2**20:,.2f}" if b is not None else ""  # noqa: E731
    base = rows.get("ddp") if isinstance(rows.get("ddp"), dict) else None
    lines = [f"Gradient accumulation, 2 gloo ranks, {args.micro} micro-batches of {args.batch_size} x "
             f"{args.block_size} tokens per step, median of {args.steps} steps after {args.warmup} warm-up "
             f"(`python benchmarks/bench_accumulation.py`). Memory in MiB, rank 0.", "",
             "| configuration | step ms | vs DDP | gradient MiB reduced per step | peak total (report) | buffers peak | "
             "DDP model states | peak RSS |", "|---|---|---|---|---|---|---|---|"]
    for c, r in rows.items():
        if not isinstance(r, dict):
            lines.append(f"| {CONFIGS[c]} | {r} | | | | | | |")
            continue
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else ""
        lines.append(f"| {CONFIGS[c]} | {r['step_s'] * 1e3:,.0f} | {ratio} | {mib(r['sent_per_step'])} | "
                     f"{mib(r.get('peak total'))} | {mib(r.get('buffers'))} | {mib(r.get('model states'))} | "
                     f"{mib(r['peak_rss'])} |")
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "accumulation.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
