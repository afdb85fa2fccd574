"""Host cost per parameter tensor: DDP, torch's ZeroRedundancyOptimizer and shardopt on many tiny tensors.

    python benchmarks/bench_per_param.py                       # ~4 min on 2 CPU cores
    python benchmarks/bench_per_param.py --tensors 500,2000 --rounds 2

On a GPU the per-parameter Python path (hooks, bookkeeping, checks) is pure host time, which a
large model with many small tensors (norms, biases) pays on every step. Here each tensor has 16
elements, so the arithmetic is nothing and the time of ``backward() + step() + zero_grad()`` is
the per-tensor work of each implementation (the forward is the same for all and not timed).
2 gloo ranks, 1 thread each; each configuration runs in its own ``torchrun`` launch, and the
configurations alternate order from round to round (the first round in the listed order, the
next reversed), so a slow period of the machine does not fall on one of them only. A launch that
fails or outlives ``--timeout`` is reported as such and the driver moves on.

What each row does:
* ``ddp``: ``DistributedDataParallel`` (one 25 MB bucket) and ``torch.optim.AdamW(fused=True)``
  (the careful user's fastest CPU AdamW), ``zero_grad(set_to_none=True)``;
* ``torch-zero``: ``DistributedDataParallel`` and ``ZeroRedundancyOptimizer(AdamW, fused=True)``;
* ``shardopt1`` / ``shardopt2``: ``ShardedAdamW(stage=1 | 2)`` with its defaults (no DDP).
Each time is the median over ``--steps`` iterations after ``--warmup``, rank 0, milliseconds; the
ratio is to ``ddp`` in the same round. ``--baseline DIR`` (a checkout of an earlier shardopt) adds
configurations named ``NAME@base``, which run NAME with that checkout's shardopt, in the same rounds.
shardopt's rows also report its own control messages per step (round tags, the step's message;
``opt.last_step_comm.control_messages``) and the time rank 0 was blocked on them
(``control_seconds``), which includes waiting for the other rank to reach the same point.
With two sizes or more, a table splits each configuration's time (medians over the rounds)
into a cost per tensor (the slope between the smallest and the largest size, microseconds: the
hooks and the bookkeeping per parameter) and a cost per step (what is left at the smallest size,
milliseconds: the collectives and the work that does not grow with the tensors).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
CONFIGS = ("ddp", "torch-zero", "shardopt1", "shardopt2")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    class Many(torch.nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(16)) for _ in range(n)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.stack([(p * x).sum() for p in self.ps]).sum()

    model = Many(args.tensors)
    if args.config == "ddp":
        net = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    elif args.config == "torch-zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        net = DDP(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, fused=True)
    else:
        if args.config.endswith("@base"):  # the same configuration with an earlier checkout's shardopt
            sys.path.insert(0, os.path.abspath(args.baseline))
        import shardopt

        net = model
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=int(args.config.split("@")[0][-1]))
    x = torch.randn(16, generator=torch.Generator().manual_seed(rank))
    times, control = [], []
    for i in range(args.warmup + args.steps):
        loss = net(x)
        start = time.perf_counter()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            stats = getattr(opt, "last_step_comm", None)  # shardopt's: this step's own control messages
            if stats is not None and hasattr(stats, "control_messages"):
                control.append((stats.control_messages, stats.control_seconds))
    if rank == 0:
        result = {"ms": statistics.median(times) * 1e3}
        if control:
            result["messages"] = statistics.median(n for n, _ in control)
            result["control_ms"] = statistics.median(s for _, s in control) * 1e3
        print(json.dumps(result))
    dist.destroy_process_group()


CONTROL: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (messages, ms blocked on them) per step, per run


def run_config(config: str, tensors: int, args: argparse.Namespace) -> float | str:
    """Median ms of ``config`` at ``tensors`` tensors, or what went wrong; shardopt's control
    messages per step and the time blocked on them go to ``CONTROL``."""
    from _launch import run

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "--worker", "--config", config, "--tensors", str(tensors), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--baseline", args.baseline]
    code, out, err = run(cmd, timeout=args.timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if code is None:
        return f"timed out after {args.timeout} s"
    if code != 0:
        return f"failed (exit {code}): {err.strip().splitlines()[-1] if err.strip() else ''}"
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            got = json.loads(line)
            if "messages" in got:
                CONTROL.setdefault((config, tensors), []).append((got["messages"], got["control_ms"]))
            return float(got["ms"])
    return "no result printed"


def per_tensor(configs: list[str], sizes: list[int], times: dict[tuple[str, int], list[float]]) -> list[str]:
    """Each configuration's cost split in two, from the medians over the rounds at the smallest and
    the largest size: per tensor (the slope between them, microseconds) and per step (what is left at
    the smallest size, milliseconds: collectives and work that does not grow with the tensors)."""
    lo, hi = min(sizes), max(sizes)
    out = [f"| per tensor ({lo} to {hi} tensors) | us per tensor | / ddp | per step ms (at {lo}) | - ddp ms |",
           "|---|---:|---:|---:|---:|"]
    fits = {}
    for c in configs:
        if (c, lo) in times and (c, hi) in times:
            a, b = statistics.median(times[c, lo]), statistics.median(times[c, hi])
            slope = (b - a) / (hi - lo)  # ms per tensor
            fits[c] = (slope * 1e3, a - slope * lo)
    for c, (us, fixed) in fits.items():
        base = fits.get("ddp")
        ratio = f"{us / base[0]:.2f}x" if base and c != "ddp" else "-"
        extra = f"{fixed - base[1]:+.2f}" if base and c != "ddp" else "-"
        out.append(f"| {c} | {us:.1f} | {ratio} | {fixed:.2f} | {extra} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="ddp")
    ap.add_argument("--tensors", default="500,2000", help="tensors per model (comma list in the driver)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=300, help="seconds for one launch")
    ap.add_argument("--out", default="", help="write the table to this file too")
    ap.add_argument("--baseline", default="", help="a checkout of an earlier shardopt, for NAME@base configurations")
    args = ap.parse_args()
    if args.worker:
        args.tensors = int(args.tensors)
        worker(args)
        return
    from _launch import emit

    configs = args.configs.split(",")
    sizes = [int(t) for t in args.tensors.split(",")]
    times: dict[tuple[str, int], list[float]] = {}
    lines = ["| tensors | round | " + " | ".join(f"{c} ms" for c in configs) + " | " +
             " | ".join(f"{c} / ddp" for c in configs if c != "ddp") + " |",
             "|---:|---:|" + "---:|" * (2 * len(configs) - 1)]
    for n in sizes:
        for rnd in range(args.rounds):
            order = configs if rnd % 2 == 0 else configs[::-1]
            got = {}
            for c in order:
                got[c] = run_config(c, n, args)
                print(f"tensors {n} round {rnd + 1} {c}: {got[c]}", file=sys.stderr, flush=True)
            for c in configs:
                if isinstance(got[c], float):
                    times.setdefault((c, n), []).append(got[c])
            cells = [f"{got[c]:.2f}" if isinstance(got[c], float) else str(got[c]) for c in configs]
            base = got.get("ddp")
            ratios = [f"{got[c] / base:.2f}x" if isinstance(got[c], float) and isinstance(base, float) else "-"
                      for c in configs if c != "ddp"]
            lines.append(f"| {n} | {rnd + 1} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    if len(sizes) > 1:
        lines += ["", *per_tensor(configs, sizes, times)]
    if CONTROL:
        lines += ["", "| configuration | tensors | control messages per step | ms blocked on them per step (median of "
                  "each run) | share of the step |", "|---|---:|---:|---:|---:|"]
        for (c, n), runs in sorted(CONTROL.items()):
            ms = [m for _, m in runs]
            share = statistics.median(ms) / statistics.median(times[c, n]) if (c, n) in times else float("nan")
            lines.append(f"| {c} | {n} | {runs[0][0]:g} | {' / '.join(f'{m:.2f}' for m in ms)} | {share:.0%} |")
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
