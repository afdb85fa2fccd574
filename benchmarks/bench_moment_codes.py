"""Which 8-bit code for the Adam moments: candidate codes replayed on a recorded gradient stream.

    python benchmarks/bench_moment_codes.py            # about 3 minutes on 2 cores

Records the gradients of 300 steps of the small byte-level GPT (examples/gpt.py, torch AdamW,
clipped at 1.0), then replays the two moment recurrences over that stream with each candidate
code applied after every step, per 64-element block inside each parameter (as shardopt's blocks
are). Reports, from step 20 on, the relative error of the Adam direction m_hat / (sqrt(v_hat) + eps)
against fp32 moments, and how many elements got an oversized update (|u| > 2 |u_fp32| + 0.5)
over the run. Writes benchmarks/results/moment_codes.md.
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import GPT, GPTConfig, load_bytes  # noqa: E402

BLOCK = 64


def record(steps: int) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    data = load_bytes(None, limit=1 << 20)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ix = torch.randint(len(data) - 65, (16,), generator=g)
        x = torch.stack([data[i:i + 64] for i in ix])
        y = torch.stack([data[i + 1:i + 65] for i in ix])
        opt.zero_grad()
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out.append([p.grad.detach().flatten().clone() for p in model.parameters()])
        opt.step()
    return out


def _round(x: torch.Tensor, stochastic: bool) -> torch.Tensor:
    return torch.floor(x + (torch.rand_like(x) if stochastic else 0.5))


def linear(x: torch.Tensor, levels: int, stochastic: bool) -> torch.Tensor:
    """|x| / block max on ``levels`` linear steps (signed when x has negatives)."""
    s = x.abs().amax(1, keepdim=True).clamp_min(1e-38)
    return _round(x / s * levels, stochastic).clamp(-levels, levels) / levels * s


def logarithmic(x: torch.Tensor, levels: int, octaves: int, stochastic: bool) -> torch.Tensor:
    """|x| / block max on ``levels`` log-spaced steps over ``octaves`` powers of two, 0 below."""
    s = x.abs().amax(1, keepdim=True).clamp_min(1e-38)
    c = (torch.log2((x.abs() / s).clamp_min(1e-38)) / octaves + 1) * (levels - 1)
    c = _round(c, stochastic).clamp(-1, levels - 1)
    return torch.sign(x) * torch.where(c < 0, torch.zeros_like(c), torch.exp2((c / (levels - 1) - 1) * octaves)) * s


CODES = {
    "m linear int8, v linear uint8": (lambda m: linear(m, 127, False), lambda v: linear(v, 255, False)),
    "m linear, sqrt(v) linear (nearest)": (lambda m: linear(m, 127, False), lambda v: linear(v.sqrt(), 255, False) ** 2),
    "m linear, sqrt(v) linear (stochastic) [shardopt]": (lambda m: linear(m, 127, True),
                                                         lambda v: linear(v.sqrt(), 255, True) ** 2),
    "m log, sqrt(v) log (stochastic)": (lambda m: logarithmic(m, 128, 12, True),
                                        lambda v: logarithmic(v.sqrt(), 256, 16, True) ** 2),
    "m linear, sqrt(v) log (stochastic)": (lambda m: linear(m, 127, True),
                                           lambda v: logarithmic(v.sqrt(), 256, 16, True) ** 2),
}


def blocks(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(-x.numel() % BLOCK)]).view(-1, BLOCK)


def replay(grads: list[list[torch.Tensor]], code, b1: float, b2: float, eps: float = 1e-8) -> list[torch.Tensor]:
    torch.manual_seed(0)
    ms = [torch.zeros_like(g) for g in grads[0]]
    vs = [torch.zeros_like(g) for g in grads[0]]
    out = []
    for t, step in enumerate(grads):
        us = []
        for j, g in enumerate(step):
            m, v = b1 * ms[j] + (1 - b1) * g, b2 * vs[j] + (1 - b2) * g * g
            if code is not None:
                n = m.numel()
                m, v = code[0](blocks(m)).flatten()[:n], code[1](blocks(v)).flatten()[:n]
            ms[j], vs[j] = m, v
            us.append((m / (1 - b1 ** (t + 1))) / (v.sqrt() / math.sqrt(1 - b2 ** (t + 1)) + eps))
        out.append(torch.cat(us))
    return out


def main() -> None:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    grads = record(300)
    print(f"recorded 300 steps of {sum(g.numel() for g in grads[0]):,} gradients ({time.perf_counter() - t0:.0f}s)",
          flush=True)
    rows = ["| code (per 64-element block) | beta2 | direction error, mean | at the end | oversized updates |",
            "|---|---:|---:|---:|---:|"]
    for b2 in (0.95, 0.999):
        ref = replay(grads, None, 0.9, b2)
        for name, code in CODES.items():
            got = replay(grads, code, 0.9, b2)
            errs = [float((u - r).norm() / r.norm()) for u, r in zip(got[20:], ref[20:])]
            over = sum(int((u.abs() > 2 * r.abs() + 0.5).sum()) for u, r in zip(got[20:], ref[20:]))
            rows.append(f"| {name} | {b2} | {sum(errs) / len(errs):.3f} | {errs[-1]:.3f} | {over:,} |")
            print(rows[-1], flush=True)
    text = ("# 8-bit moment codes on a recorded gradient stream\n\nCommand: `python benchmarks/bench_moment_codes.py` "
            f"(torch {torch.__version__})\n\nThe gradients of 300 steps of the small GPT, replayed through the moment "
            "recurrences with each code applied after every step. Direction error: |u - u_fp32| / |u_fp32| over all "
            "elements, u = m_hat / (sqrt(v_hat) + eps), from step 20. Oversized: elements with |u| > 2 |u_fp32| + 0.5, "
            "summed over the steps.\n\n" + "\n".join(rows) + "\n")
    out = os.path.join(ROOT, "benchmarks", "results", "moment_codes.md")
    with open(out, "w") as f:
        f.write(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
