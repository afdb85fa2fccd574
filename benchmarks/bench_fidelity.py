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

    python benchmarks/bench_fidelity.py --part moments    # the moments modes, about 5 minutes

Moments: the same GPT with bf16 weights and the exact (remainder) master, each ``moments`` mode,
over --moment-seeds seeds; the validation loss against fp32 moments' on the same seed (a paired
difference) beside the seed-to-seed spread of fp32 moments themselves, and a micro measurement
of why ``exp_avg_sq`` is rounded stochastically. Writes benchmarks/results/fidelity_moments.md.
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
from shardopt.core._layout import Range  # noqa: E402
from shardopt.kernels import codecs, make_scalars, reference, select  # noqa: E402
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


def train(mode: str, dtype: torch.dtype, seed: int, steps: int, data: torch.Tensor,
          moments: str = "fp32") -> tuple[list[float], float]:
    torch.manual_seed(seed)
    cfg = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64, activation_dtype=dtype)
    model = GPT(cfg).to(dtype)
    opt = shardopt.ShardedAdamW(model.param_groups(0.1), lr=3e-3, betas=(0.9, 0.95), master_weights=mode,
                                moments=moments, seed=seed, loss_scale="auto")
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


def moments_micro(steps: int = 3000) -> list[str]:
    """exp_avg_sq after a gradient spike: 1.0, then gradients of 1e-3 with beta2 = 0.999, stored
    each step as each mode stores it (the reference codecs, the same random bits as training)."""
    n = 64 * 64
    rows = ["| stored as | exp_avg_sq after 3000 steps | exact (fp32) | ratio |", "|---|---:|---:|---:|"]
    exact = None
    for name in ("fp32", "bf16, to nearest", "bf16, stochastic (shardopt)", "8-bit, to nearest",
                 "8-bit, stochastic (shardopt)"):
        v = torch.zeros(n)
        v[1::64] = 1.0  # the spiked element of each block
        g2 = torch.full((n,), 1e-6)
        g2[::64] = 1.0  # one element per block keeps a large gradient: the block's scale
        for step in range(steps):
            v = v * 0.999 + 0.001 * g2
            key = codecs.make_key(0, step, 0)
            if name.startswith("bf16, to"):
                v = v.bfloat16().float()
            elif name.startswith("bf16, st"):
                v = codecs.stochastic_round(v, torch.bfloat16, codecs.random_bits16(key, n, 2)).float()
            elif name.startswith("8-bit"):
                codes = reference.encode_moment8(torch.zeros(n), v, None if "nearest" in name else key)
                v = reference.decode_moment8(*codes[0], *codes[1])[1]
        got = float(v[1::64].mean())
        exact = got if name == "fp32" else exact
        rows.append(f"| {name} | {got:.3e} | {exact:.3e} | {got / exact:.2f}x |")
        print(rows[-1], flush=True)
    return rows


def moments_part(args: argparse.Namespace, data: torch.Tensor) -> None:
    print("## Moments micro: exp_avg_sq decaying after a spike\n", flush=True)
    micro_rows = moments_micro()
    print("\n## Moments: small GPT, bf16 weights, remainder master\n", flush=True)
    kinds = ("fp32", "bf16", "8bit")
    per = {"fp32": 8, "bf16": 4, "8bit": 2.125}
    vals = {}
    for m in kinds:
        t = time.perf_counter()
        vals[m] = [train("remainder", torch.bfloat16, seed, args.real_steps, data, moments=m)[1]
                   for seed in range(args.moment_seeds)]
        print(m, [f"{v:.4f}" for v in vals[m]], f"({time.perf_counter() - t:.0f}s)", flush=True)
    ref = vals["fp32"]
    mean = sum(ref) / len(ref)
    spread = (sum((v - mean) ** 2 for v in ref) / max(len(ref) - 1, 1)) ** 0.5
    rows = ["| moments | bytes/param (both, sharded) | val loss per seed | paired diff vs fp32 per seed | mean diff | "
            "fp32 seed-to-seed std | within the spread |", "|---|---:|---|---|---:|---:|---|"]
    for m in kinds:
        diffs = [v - r for v, r in zip(vals[m], ref)]
        md = sum(diffs) / len(diffs)
        rows.append(f"| {m} | {per[m]:g} | {' / '.join(f'{v:.4f}' for v in vals[m])} | "
                    f"{' / '.join(f'{d:+.4f}' for d in diffs)} | {md:+.4f} | {spread:.4f} | "
                    f"{'yes' if abs(md) <= spread else 'no'} |")
        print(rows[-1], flush=True)
    text = (f"# Moments fidelity\n\nCommand: `python benchmarks/bench_fidelity.py --part moments --real-steps "
            f"{args.real_steps} --moment-seeds {args.moment_seeds}` (torch {torch.__version__})\n\n"
            "## Micro: exp_avg_sq after a spike\n\nOne element per 64-element block keeps a gradient of 1 (the "
            "block's scale), another had exp_avg_sq = 1 and then gets gradients of 1e-3; beta2 = 0.999. "
            "Stored each step as each mode stores it.\n\n" + "\n".join(micro_rows) +
            "\n\n## Small GPT: validation loss per moments mode\n\nbf16 weights, remainder (exact) master, "
            f"{args.real_steps} steps, lr decayed 100x; the same seeds (data order and initialisation) for every "
            "mode, so the difference is paired.\n\n" + "\n".join(rows) + "\n")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fidelity_moments.md"), "w") as f:
        f.write(text)
    print(f"written to {os.path.join(args.out, 'fidelity_moments.md')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--micro-steps", type=int, default=3000)
    ap.add_argument("--real-steps", type=int, default=400)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--part", choices=("all", "masters", "moments"), default="all")
    ap.add_argument("--moment-seeds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("SHARDOPT_KERNEL", "reference")
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    if args.part in ("all", "moments"):
        moments_part(args, load_bytes(None, limit=2 << 20))
        if args.part == "moments":
            dist.destroy_process_group()
            return
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
