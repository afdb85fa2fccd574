"""The update in context: ``opt.step()`` on one rank against the step a careful user writes by hand.

    python benchmarks/bench_update.py                      # 16M-element bf16 parameter, every master mode
    python benchmarks/bench_update.py --numel 3.2e7 --dtype fp16 --device cuda
    python benchmarks/bench_update.py --offload --dtype fp32 --rounds 15   # offload="cpu" against offload by hand

One rank (a process group of one), one parameter of ``--numel`` elements. Each step, a backward
pass (untimed) gives both rows of a pair the same gradient, as a training loop does (shardopt
reduces it from its hooks during that backward); then only the optimizer step is timed. The two
rows are timed interleaved (A B A B ...) so that the machine's drift hits both alike, and the
ratio is the median of the per-round ratios.

- ``shardopt <mode>``: ``ShardedAdamW(stage=2, master_weights=<mode>).step()`` as a training
  loop calls it: the inf/NaN and usage checks, the fused update of the shard, the (here local)
  all-gather into the weights.
- ``by hand``: what a user writes for 16-bit weights with an fp32 master, allocated once: a
  persistent fp32 gradient buffer, ``grad32.copy_(p.grad)``, ``torch.optim.AdamW(fused=True)``
  on the fp32 master, ``p.copy_(master)``. For fp32 weights: ``AdamW(fused=True)`` on the
  weight itself.

Each shardopt mode is compared with that same hand-written fp32-master step (the one a user has
instead of shardopt, whatever shardopt's mode keeps). With ``--offload``: ``offload="cpu"``
against an offload by hand, the master kept apart from the weights whatever their dtype (the
gradient copied into a persistent host fp32 buffer, ``AdamW(fused=True)`` on the host master, the
result copied back). Writes benchmarks/results/update[_offload][_cuda].md.
"""
from __future__ import annotations

import datetime
import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=float, default=16e6)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--modes", nargs="*", default=["fp32", "remainder", "stochastic", "none"])
    ap.add_argument("--rounds", type=int, default=7, help="timed A/B rounds (after 2 warm-up rounds)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--offload", action="store_true", help='offload="cpu" against an offload by hand')
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    import shardopt

    os.environ.setdefault("SHARDOPT_KERNEL", "auto")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    store = tempfile.mktemp()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                            world_size=1)
    dtype = getattr(torch, DTYPES[args.dtype])
    n = int(args.numel)
    gen = torch.Generator(device="cpu").manual_seed(0)
    init = torch.randn(n, generator=gen).to(device=device, dtype=dtype)
    grads = [torch.randn(n, generator=gen).mul_(1e-2).to(device=device, dtype=dtype) for _ in range(2)]
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def backward(w: torch.nn.Parameter, g: torch.Tensor) -> None:
        (w * g).sum().backward()  # d/dw = g

    def by_hand():
        w = torch.nn.Parameter(init.clone())
        if dtype == torch.float32 and not args.offload:
            opt = torch.optim.AdamW([w], fused=True, **hp)

            def step() -> None:
                opt.step()

            def zero() -> None:
                opt.zero_grad()
            return w, step, zero
        host = torch.device("cpu") if args.offload else device
        master = torch.nn.Parameter(init.to(host, torch.float32, copy=True))
        master.grad = torch.zeros_like(master)  # persistent fp32 gradient buffer
        opt = torch.optim.AdamW([master], fused=True, **hp)

        def step() -> None:
            master.grad.copy_(w.grad)
            opt.step()
            w.data.copy_(master)

        def zero() -> None:
            w.grad = None
        return w, step, zero

    def sharded(mode: str):
        w = torch.nn.Parameter(init.clone())
        opt = shardopt.ShardedAdamW([w], stage=2, master_weights=mode, loss_scale=None,
                                    offload="cpu" if args.offload else None, **hp)
        return w, opt.step, opt.zero_grad

    rows = []
    modes = args.modes if dtype != torch.float32 else ["fp32"]
    for mode in modes:
        steps = {"by hand": by_hand(), f"shardopt {mode}": sharded(mode)}
        times = {k: [] for k in steps}
        for r in range(args.rounds + 2):
            for name, (w, step, zero) in steps.items():
                backward(w, grads[r % 2])
                sync()
                t = time.perf_counter()
                step()
                sync()
                if r >= 2:
                    times[name].append(time.perf_counter() - t)
                zero()
        hand, ours = times["by hand"], times[f"shardopt {mode}"]
        ratio = statistics.median(o / h for o, h in zip(ours, hand))
        rows.append((mode, statistics.median(hand), statistics.median(ours), ratio, min(ours), max(ours)))
        print(f"  {mode:<11} by hand {statistics.median(hand) * 1e3:7.1f} ms   shardopt {statistics.median(ours) * 1e3:7.1f} ms"
              f"   {ratio:.2f}x", flush=True)
        del steps
    head = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} thread(s) | "
            f"torch {torch.__version__} | device {device} | one {args.dtype} parameter of {n:,} elements | "
            f"median of {args.rounds} interleaved rounds | {datetime.date.today().isoformat()}")
    title = "Offload in context" if args.offload else "The update in context"
    lines = [f"# {title}\n\nCommand: `python benchmarks/bench_update.py --numel {args.numel:g} --dtype "
             f"{args.dtype} --device {args.device} --threads {args.threads} --rounds {args.rounds}"
             f"{' --offload' if args.offload else ''}`\n\n{head}\n",
             "| shardopt master_weights | by hand ms (persistent fp32 grad, fused AdamW, copy back) | "
             "shardopt opt.step() ms (min-max) | shardopt / by hand |", "|---|---:|---:|---:|"]
    for mode, hand, ours, ratio, lo, hi in rows:
        lines.append(f"| {mode} | {hand * 1e3:.1f} | {ours * 1e3:.1f} ({lo * 1e3:.1f}-{hi * 1e3:.1f}) | {ratio:.2f}x |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                   f"update{'_offload' if args.offload else ''}{'_cuda' if device.type == 'cuda' else ''}.md")
    with open(out, "w") as f:
        f.write(text)
    print(f"written to {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
