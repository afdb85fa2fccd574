"""Fidelity of the master-weight modes: how much of the training signal each one keeps.

    python benchmarks/bench_fidelity.py                 # micro + real, about 5 minutes on 2 cores
    python benchmarks/bench_fidelity.py --real-steps 300 --seeds 1

Micro: 4096 weights near 1.0 pushed by a steady gradient so that AdamW moves each by lr per step
(relative updates of 1e-4 to 1e-6) for thousands of steps; we report the mean distance each mode's weights
travelled as a fraction of the fp32 master's (100% = every update kept, 0% = all lost).

Real: a small byte-level GPT (examples/gpt.py) trained in one process with ShardedAdamW for each
mode and 16-bit dtype, under a cosine schedule that decays the learning rate 100x. 16-bit compute
is emulated on CPU: weights are stored in 16 bits, activations (and their gradients) are rounded
to 16 bits between blocks, matmuls accumulate in fp32. Repeated over seeds to show the noise.
Prints markdown tables and writes benchmarks/results/fidelity.md and fidelity.png.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import shardopt  # noqa: E402
from gpt import GPT, GPTConfig, load_bytes  # noqa: E402
from shardopt._layout import Range  # noqa: E402
from shardopt.kernels import make_scalars, select  # noqa: E402
from shardopt.master import make_master  # noqa: E402

MODES = ("fp32", "remainder", "stochastic", "none")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BYTES = {"fp32": 4, "remainder": 2, "stochastic": 0, "none": 0}  # master/extra bytes per param, sharded


def micro(steps: int) -> list[str]:
    rows = ["| dtype | lr (relative update) | " + " | ".join(f"{m}: travel kept" for m in MODES) + " |",
            "|---|---|" + "---:|" * len(MODES)]
    for dname, dtype in DTYPES.items():
        for lr in (1e-4, 1e-5, 1e-6):
            n = 4096
            w0 = 1.0 + torch.rand(n, generator=torch.Generator().manual_seed(0)) * 0.01
            finals = {}
            for mode in MODES:  # all modes start from the same 16-bit weights
                strategy = make_master(mode, w0.to(dtype), kernels=select("reference"))
                m, v = torch.zeros(n), torch.zeros(n)
                g = torch.ones(n, dtype=dtype)
                for step in range(1, steps + 1):
                    s = make_scalars(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=step, grad_scale=1.0)
                    strategy.update_(Range(0, n), g, m, v, s, step)
                finals[mode] = strategy.fp32()
            start = w0.to(dtype).float()
            travel = float((finals["fp32"] - start).mean())
            cells = [f"{float((finals[mo] - start).mean()) / travel:.1%}" for mo in MODES]
            rows.append(f"| {dname} | {lr:g} ({steps} steps) | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    return rows


def train(mode: str, dtype: torch.dtype, seed: int, steps: int, data: torch.Tensor) -> tuple[list[float], float]:
    torch.manual_seed(seed)
    cfg = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64, activation_dtype=dtype)
    model = GPT(cfg).to(dtype)
    opt = shardopt.ShardedAdamW(model.param_groups(0.1), lr=3e-3, betas=(0.9, 0.95), master_weights=mode,
                                seed=seed, loss_scale="auto")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    gen = torch.Generator().manual_seed(seed + 1)

    def get(src: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(src) - 65, (16,), generator=g)
        return torch.stack([src[i:i + 64] for i in ix]), torch.stack([src[i + 1:i + 65] for i in ix])

    curve = []
    while opt.step_count < steps:
        x, y = get(train_data, gen)
        loss = model(x, y)
        opt.backward(loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if not opt.step_was_skipped:
            sched.step()
            curve.append(loss.item())
    with torch.no_grad():
        vg = torch.Generator().manual_seed(1234)
        val = sum(model(*get(val_data, vg)).item() for _ in range(20)) / 20
    return curve, val


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--micro-steps", type=int, default=3000)
    ap.add_argument("--real-steps", type=int, default=400)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("SHARDOPT_KERNEL", "reference")
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    print("## Micro: drift from the fp32 master, as a fraction of the distance travelled\n", flush=True)
    micro_rows = micro(args.micro_steps)
    data = load_bytes(None, limit=2 << 20)
    print("\n## Real: small GPT, emulated 16-bit compute\n", flush=True)
    curves: dict = {}
    rows = ["| dtype | mode | master bytes/param (sharded) | final train loss | val loss | val - fp32 val |",
            "|---|---|---:|---:|---:|---:|"]
    for dname, dtype in DTYPES.items():
        vals = {}
        for mode in MODES:
            t = time.perf_counter()
            runs = [train(mode, dtype, seed, args.real_steps, data) for seed in range(args.seeds)]
            curves[(dname, mode)] = runs[0][0]
            tr = [sum(c[-50:]) / len(c[-50:]) for c, _ in runs]
            vals[mode] = [v for _, v in runs]
            fmt = lambda xs: " / ".join(f"{x:.4f}" for x in xs)  # noqa: E731
            diff = [v - f for v, f in zip(vals[mode], vals["fp32"])]
            rows.append(f"| {dname} | {mode} | {BYTES[mode]} | {fmt(tr)} | {fmt(vals[mode])} | "
                        f"{' / '.join(f'{d:+.4f}' for d in diff)} |")
            print(rows[-1], f"({time.perf_counter() - t:.0f}s)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    text = (f"# Master-weight fidelity\n\nCommand: `python benchmarks/bench_fidelity.py --micro-steps "
            f"{args.micro_steps} --real-steps {args.real_steps} --seeds {args.seeds}` (torch {torch.__version__})\n\n"
            "## Micro: weights near 1.0, a steady push of lr per step\n\nMean distance travelled by the weights "
            "(decoded master where one is kept, else the 16-bit weight), as a fraction of the fp32 master's: "
            "100% = every update kept, 0% = all lost.\n\n" + "\n".join(micro_rows) + "\n\n## Real: small GPT, lr decayed 100x, one "
            "value per seed\n\n" + "\n".join(rows) + "\n")
    with open(os.path.join(args.out, "fidelity.md"), "w") as f:
        f.write(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for ax, dname in zip(axes, DTYPES):
            for mode in MODES:
                c = torch.tensor(curves[(dname, mode)])
                k = 25
                smooth = torch.nn.functional.avg_pool1d(c.view(1, 1, -1), k, 1).flatten() if len(c) > k else c
                ax.plot(range(len(smooth)), smooth.tolist(), label=f"{mode} ({BYTES[mode]} B/param)")
            ax.set_title(f"{dname} weights, emulated {dname} compute")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend()
        axes[0].set_ylabel(f"train loss (moving average of 25, seed 0)")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "fidelity.png"), dpi=110)
        print(f"plot: {os.path.join(args.out, 'fidelity.png')}")
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
    print(f"written to {os.path.join(args.out, 'fidelity.md')}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
