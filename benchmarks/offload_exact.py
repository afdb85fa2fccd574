"""Whether ``offload="cpu"`` trains bit for bit as ``offload=None`` on this device, one rank.

    python benchmarks/offload_exact.py --device cuda     # part of benchmarks/gpu_check.sh
    python benchmarks/offload_exact.py --device cpu

With offload the update runs in the host's compiled kernels; without it in the device's (Triton on
a GPU). The tests hold the two equal on CPU; this runs the same comparison where the weights live
on another device: a small model, a few steps with clipping, for each master-weight mode and
moment format, both ways in one process on the same batches. Prints one line per configuration
and exits 1 if any differs (with the largest difference in units in the last place).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import shardopt  # noqa: E402

CONFIGS = [("fp32", "fp32"), ("fp32", "bf16"), ("remainder", "fp32"), ("remainder", "8bit"), ("stochastic", "bf16")]


def train(device: torch.device, master: str, moments: str, offload: str | None, steps: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    model = model.to(device=device, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, master_weights=master,
                                moments=moments, bucket_cap_mb=0.1, offload=offload)
    g = torch.Generator(device="cpu").manual_seed(1)
    for _ in range(steps):
        x = torch.randn(64, 256, generator=g).to(device=device, dtype=torch.bfloat16)
        opt.zero_grad()
        opt.backward(model(x).float().pow(2).mean())
        opt.clip_grad_norm_(0.01)
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29700 + os.getpid() % 200))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    bad = 0
    for master, moments in CONFIGS:
        plain = train(device, master, moments, None, args.steps)
        offloaded = train(device, master, moments, "cpu", args.steps)
        ulps = max(int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max()) for a, b in
                   zip(plain, offloaded))
        bad += ulps != 0
        print(f"offload exact on {device.type}: master_weights={master}, moments={moments}: "
              f"{'bit for bit' if ulps == 0 else f'DIFFERS by up to {ulps} ulp'}", flush=True)
    dist.destroy_process_group()
    print(f"offload exact on {device.type}: {len(CONFIGS) - bad}/{len(CONFIGS)} configurations bit for bit")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
