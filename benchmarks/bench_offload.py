"""Accelerator memory and step time with and without ``offload="cpu"``, one rank, bf16 weights.

    python benchmarks/bench_offload.py --device cuda                       # the GPU check's part
    python benchmarks/bench_offload.py --device cpu --sizes 4M,8M --dim 256 --tokens 256   # the path on CPU

Two model sizes: one that fits in the accelerator memory given (``--gpu-memory-gib``, enforced on
CUDA with ``torch.cuda.set_per_process_memory_fraction``) without offload, and one that fits only
with it. Each size runs, each in its own process (killed after ``--timeout``, and reported), as:

- ``shardopt``: ``ShardedAdamW(stage=2)`` with its fp32 master and moments on the accelerator;
- ``shardopt offload``: the same with ``offload="cpu"`` (master, moments and the gradient's copy in
  host memory, updated there by the fused CPU kernel); ``shardopt offload 0.5`` with
  ``offload_fraction=0.5`` (half of the buckets on the host);
- ``torchao offload``: torchao's ``CPUOffloadOptimizer`` over ``torch.optim.AdamW(fused=True)``, when
  torchao imports (it keeps the optimizer's parameters in the weights' dtype, bf16: no fp32 master).

The model is a stack of bf16 ``Linear(dim, dim)`` layers trained on ``--tokens`` random rows per
step. Peak accelerator memory: ``torch.cuda.max_memory_allocated`` over the timed steps (CUDA), or
on CPU the optimizer's own ``memory_report().accelerator_peak``. Step time: the median of
``--steps`` steps after ``--warmup``; with ``--rounds`` each configuration runs that many times in
alternating order, and the table gives the median and range of the rounds. Results go to stdout and benchmarks/results/offload[_cuda].md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))


def parse_size(s: str) -> int:
    s = s.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMB" else s) * scale)


def worker(config: str, size: int, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, args.gpu_memory_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    layers = max(1, round(size / args.dim**2))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim, bias=False) for _ in range(layers)])
    model = model.to(device=device, dtype=torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    if config == "torchao offload":
        from torchao.optim import CPUOffloadOptimizer
        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, fused=True)
    else:
        import shardopt
        fraction = float(config.split()[-1]) if config.startswith("shardopt offload ") else 1.0
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-4, stage=2,
                                    offload="cpu" if config.startswith("shardopt offload") else None,
                                    offload_fraction=fraction)
    x = torch.randn(args.tokens, args.dim, device=device, dtype=torch.bfloat16)

    def step() -> None:
        loss = model(x).float().pow(2).mean()
        (opt.backward(loss) if hasattr(opt, "backward") else loss.backward())
        opt.step()
        opt.zero_grad()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    elif hasattr(opt, "reset_peak_memory"):
        opt.reset_peak_memory()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = opt.memory_report().accelerator_peak if hasattr(opt, "memory_report") else None
    host = opt.memory_report().host if hasattr(opt, "memory_report") else None
    return {"numel": numel, "layers": layers, "step_s": statistics.median(times), "peak": peak, "host": host}


def run_config(config: str, size: int, args: argparse.Namespace) -> dict | str:
    from _launch import run

    cmd = [sys.executable, os.path.abspath(__file__), "--worker", config, "--sizes", str(size)] + [
        a for k, v in vars(args).items() if k in ("device", "dim", "tokens", "steps", "warmup", "gpu_memory_gib")
        for a in (f"--{k.replace('_', '-')}", str(v))]
    code, out, err = run(cmd, args.timeout, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if code is None:
        return f"timed out after {args.timeout:g} s"
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    if code != 0 or not lines:
        last = (err.strip().splitlines() or ["?"])[-1]
        if "out of memory" in err.lower() or "OutOfMemoryError" in err:
            return "out of memory"
        if "No module named 'torchao'" in err:
            return "not run: torchao is not installed"
        return f"failed (exit {code}): {last[:160]}"
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="0.5B,1B", help="parameters: one that fits without offload, one only with it")
    ap.add_argument("--dim", type=int, default=4096, help="width of each Linear layer")
    ap.add_argument("--tokens", type=int, default=8192, help="rows of the batch per step")
    ap.add_argument("--gpu-memory-gib", type=float, default=12.0, help="accelerator memory this process may use")
    ap.add_argument("--configs", default="shardopt,shardopt offload,shardopt offload 0.5,torchao offload",
                    help="comma-separated; 'shardopt offload F' sets offload_fraction=F")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="each configuration this many times, in alternating order")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="host threads (OMP_NUM_THREADS)")
    ap.add_argument("--timeout", type=float, default=150, help="seconds one configuration may take")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, parse_size(args.sizes), args)), flush=True)
        return
    import torch

    where = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU, {os.cpu_count()} cores"
    head = (f"machine: {where} | torch {torch.__version__} | accelerator memory allowed {args.gpu_memory_gib:g} GiB | "
            f"{args.threads} host threads | dim {args.dim}, {args.tokens} tokens | {datetime.date.today().isoformat()}")
    print(head, flush=True)
    rows = ["| parameters | configuration | step ms, median (range) of rounds | vs shardopt | peak accelerator GiB | "
            "B/param | host GiB |", "|---|---|---:|---:|---:|---:|---:|"]
    configs = args.configs.split(",")
    for size in map(parse_size, args.sizes.split(",")):
        runs: dict[str, list] = {c: [] for c in configs}
        for _ in range(args.rounds):  # alternating: a drift of the machine's speed hits every configuration
            for config in configs:
                runs[config].append(run_config(config, size, args))
        ok = {c: [r for r in rs if isinstance(r, dict)] for c, rs in runs.items()}
        base = statistics.median(r["step_s"] for r in ok["shardopt"]) if ok.get("shardopt") else None
        for config in configs:
            if not ok[config]:
                rows.append(f"| {size / 1e9:g}B | {config} | {runs[config][0]} | | | | |")
            else:
                res, times = ok[config][-1], [r["step_s"] for r in ok[config]]
                t, peak = statistics.median(times), max(r["peak"] or 0 for r in ok[config]) or None
                failed = f" ({len(runs[config]) - len(ok[config])} rounds failed)" if len(ok[config]) < args.rounds else ""
                rows.append(f"| {res['numel'] / 1e9:.3g}B | {config}{failed} | {t * 1e3:,.0f} "
                            f"({min(times) * 1e3:,.0f}-{max(times) * 1e3:,.0f}) | "
                            f"{t / base if base else float('nan'):.2f}x | "
                            f"{peak / 2**30 if peak is not None else float('nan'):.2f} | "
                            f"{peak / res['numel'] if peak is not None else float('nan'):.2f} | "
                            f"{res['host'] / 2**30 if res['host'] is not None else float('nan'):.2f} |")
            print(rows[-1], flush=True)
    out = args.out or os.path.join(HERE, "results", "offload_cuda.md" if args.device == "cuda" else "offload.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(f"# Offload: accelerator memory and step time\n\nCommand: `python benchmarks/bench_offload.py "
                f"--device {args.device} --sizes {args.sizes} --dim {args.dim} --tokens {args.tokens} "
                f"--gpu-memory-gib {args.gpu_memory_gib:g} --threads {args.threads} --steps {args.steps} --warmup {args.warmup} "
                f"--rounds {args.rounds} --configs {args.configs!r}`\n\n{head}\n\n" + "\n".join(rows) +
                "\n\nshardopt: ShardedAdamW stage 2 (fp32 master and moments beside the weights); shardopt offload: "
                "the same with offload='cpu'; torchao offload: CPUOffloadOptimizer over torch.optim.AdamW(fused=True), "
                "state in bf16. B/param: the peak over the parameters.\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
