"""A profile of one training step: shardopt's ranges and the collectives it calls, and a trace file.

    torchrun --standalone --nproc_per_node=1 benchmarks/profile_step.py --device cuda   # the GPU check's part
    torchrun --standalone --nproc_per_node=2 benchmarks/profile_step.py                 # gloo, CPU

The example GPT (``--n-layer`` blocks, bf16 weights on CUDA, fp32 on CPU), ``ShardedAdamW(stage=2)``
with ``overlap_param_gather=True``, three warm-up steps, then one step under ``torch.profiler``
(CPU activity, and CUDA's on a GPU): forward, backward, ``step()``, ``zero_grad()`` and the next
forward, where the overlapped gathers are waited for. Rank 0 writes the Chrome/Perfetto trace to
``--trace`` and prints, per name, how many of shardopt's ranges (``shardopt::...``, see
``shardopt/core/_ranges.py``) and of the process group's collectives (``c10d::...`` and
``nccl:...`` / ``gloo:...`` records) the step made, and the number of buckets. At one rank no
data moves, but the step still makes every collective call it makes at more ranks (there is no
one-rank shortcut), so the trace shows the calls a multi-GPU run makes. Exits non-zero when a
range of shardopt's is missing from the trace, or when the native bucket path (NCCL's, or
``SHARDOPT_COLLECTIVES=native``) made other than one ``reduce_scatter_tensor`` and one
``all_gather_into_tensor`` per bucket.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--bucket-cap-mb", type=float, default=1.0)
    ap.add_argument("--trace", default="/tmp/shardopt-step-trace.json")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device(args.device, torch.cuda.current_device()) if cuda else torch.device("cpu")

    import shardopt
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, compute_dtype=dtype)
    model = GPT(cfg).to(device=device, dtype=dtype)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=2, bucket_cap_mb=args.bucket_cap_mb,
                                overlap_param_gather=True)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g).to(device)

    def train_step() -> None:
        opt.backward(model(x, x))
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        train_step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        train_step()
        model(x, x)  # the next forward waits for the overlapped gathers
        if cuda:
            torch.cuda.synchronize()
    buckets = sum(len(b.buckets) for b in opt.inspect().buffers)
    counts = collections.Counter(e.name for e in prof.events()
                                 if e.name.startswith(("shardopt::", "c10d::", "nccl:", "gloo:")))
    if rank == 0:
        prof.export_chrome_trace(args.trace)
        print(f"profile_step: {dist.get_world_size()} rank(s), {dist.get_backend()}, {buckets} buckets; "
              f"trace: {args.trace}")
        for name, n in sorted(counts.items()):
            print(f"  {n:5d}  {name}")
    from shardopt.core._ranges import NAMES

    missing = [n for n in NAMES if n not in counts]
    native = opt._comm.path.name == "native"
    opt.close()
    dist.destroy_process_group()
    if missing:
        sys.exit(f"profile_step: missing from the trace: {', '.join(missing)}")
    # The native path (NCCL's): one reduce-scatter and one all-gather per bucket, nothing else per bucket
    calls = {n: counts.get(n, 0) for n in ("c10d::_reduce_scatter_base_", "c10d::_allgather_base_")}
    other = {n: counts[n] for n in ("c10d::alltoall_base_", "c10d::broadcast_", "c10d::reduce_scatter_") if n in counts}
    if native and (set(calls.values()) != {buckets} or other):
        sys.exit(f"profile_step: the native path made {calls} and {other} for {buckets} buckets; expected one "
                 "reduce-scatter and one all-gather per bucket and nothing else")


if __name__ == "__main__":
    main()
