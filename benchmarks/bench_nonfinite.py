"""The step's inf/NaN test of the gradient shard, three ways, on the CPU.

    python benchmarks/bench_nonfinite.py                     # ~1 min on 2 CPU cores
    python benchmarks/bench_nonfinite.py --numel 1.6e7 --threads 1,2

Every step reads the averaged gradient shard once before the update, to skip the step on every
rank when some gradient holds an inf or a NaN (``kernels.grad_nonfinite``); ``offload="cpu"``
then reads it again to copy it into host memory. Measured here, side by side, median of
``--repeat`` calls after two warm-up ones, milliseconds:

* ``copy``: ``dst.copy_(g)``, the offload's gradient copy alone (what a hand-written offload does);
* ``bits``: ``kernels.fused.grad_nonfinite``, shardopt's test: the largest fp32 magnitude bit
  pattern, an integer maximum (exact in any order), compiled with shardopt's kernel options;
* ``isfinite``: ``(~torch.isfinite(g)).any()``, compiled with the same options;
* ``copy+bits``: the copy and the bit test in one compiled function (what folding the test into
  the copy would run).
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

from bench_kernels import timed  # the median of timed calls after two warm-up ones, seconds
from shardopt.kernels import _cpu_codegen, fused, reference


def _isfinite(g: torch.Tensor) -> torch.Tensor:
    return (~torch.isfinite(g)).any().float()


def _copy_bits(dst: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    dst.copy_(g)
    return reference.grad_nonfinite(g)


def _compiled(fn: Callable) -> Callable:
    c = torch.compile(fn, fullgraph=True, dynamic=None, options=fused.compile_options())

    def run(*args: torch.Tensor) -> torch.Tensor:
        with _cpu_codegen.fused_kernels():
            return c(*args)
    return run


def _measure(g: torch.Tensor, dst: torch.Tensor, repeat: int, isfinite: Callable,
             copy_bits: Callable) -> tuple[float, ...]:
    """(copy, bits, isfinite, copy+bits) ms for gradient ``g`` and copy target ``dst``."""
    return tuple(timed(fn, repeat) * 1e3 for fn in (
        lambda: dst.copy_(g), lambda: fused.grad_nonfinite(g), lambda: isfinite(g), lambda: copy_bits(dst, g)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=float, default=1.6e7, help="gradient elements")
    ap.add_argument("--threads", default="1,2", help="torch threads, a comma list")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    n = int(args.numel)
    isfinite, copy_bits = _compiled(_isfinite), _compiled(_copy_bits)
    print("| dtype | threads | copy ms | bits ms | isfinite ms | copy+bits ms | copy+bits - copy - bits ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.randn(n).to(dtype)
        dst = torch.empty_like(g)
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            copy, bits, fin, both = _measure(g, dst, args.repeat, isfinite, copy_bits)
            print(f"| {str(dtype).replace('torch.', '')} | {threads} | {copy:.2f} | {bits:.2f} | {fin:.2f} | "
                  f"{both:.2f} | {both - copy - bits:+.2f} |")


if __name__ == "__main__":
    main()
