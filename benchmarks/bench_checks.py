"""What the per-step usage checks cost, against the whole training step of the example GPT.

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_checks.py              # ~1 min on 2 CPU cores
    torchrun --standalone --nproc_per_node=2 benchmarks/bench_checks.py --stage 1 --n-layer 8

The checks that keep ordinary torch usage from corrupting training (parameters re-bound or written
from outside, zeroing through the model, unscaled backward passes, parameters without gradient)
cost three things on top of a step; each is measured here, in the same run, on rank 0:

* their Python work at step() and at the start of each backward: ``opt.last_step_check_seconds``;
* in stage 2, one tensor pre-hook per parameter: a backward of the same model with as many
  no-op tensor hooks, against one without, in plain torch;
* the numbers they add to the step's one all-reduce (3 + 2 per parameter): an all-reduce of that
  length against one of the 2 numbers (overflow flag, squared norm) it carried before.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import shardopt  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=2, choices=(1, 2))
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    model = GPT(cfg).to(torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.param_groups(0.1), lr=1e-3, stage=args.stage, bucket_cap_mb=0.25)
    n_params = sum(1 for _ in model.parameters())
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (8, 64), generator=g)

    def train_step() -> None:
        opt.backward(model(x, x))
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    step_times, check_times = [], []
    for i in range(args.steps + 3):
        start = time.perf_counter()
        train_step()
        if i >= 3:  # the first steps learn the bucket order and compile
            step_times.append(time.perf_counter() - start)
            check_times.append(opt.last_step_check_seconds)
    step = statistics.median(step_times)
    checks = statistics.median(check_times)

    ref = GPT(cfg)
    loss = lambda: ref(x, x).backward()  # noqa: E731
    plain = timed(loss, 10)
    handles = [q.register_hook(lambda grad: None) for q in ref.parameters()]
    hooked = timed(loss, 10)
    for h in handles:
        h.remove()
    hooks = max(hooked - plain, 0.0) if args.stage == 2 else 0.0

    small, large = torch.zeros(2), torch.zeros(2 + 3 + 2 * n_params)
    t_small = timed(lambda: dist.all_reduce(small), 50)
    t_large = timed(lambda: dist.all_reduce(large), 50)
    payload = max(t_large - t_small, 0.0)

    total = checks + hooks + payload
    if rank == 0:
        print(f"example GPT, {sum(q.numel() for q in model.parameters()):,} parameters in {n_params} tensors, bf16 "
              f"weights, stage {args.stage}, {world} gloo ranks, torch {torch.__version__}")
        print("| what | ms per step | share of the step |")
        print("|---|---:|---:|")
        print(f"| whole training step (forward, backward, clip, step) | {1e3 * step:.1f} | 100% |")
        for name, t in (("checks' Python work (opt.last_step_check_seconds)", checks),
                        ("stage-2 pre-hooks (a backward with as many no-op hooks)", hooks),
                        (f"all-reduce of {large.numel()} numbers instead of 2", payload),
                        ("**all checks**", total)):
            print(f"| {name} | {1e3 * t:.3f} | {100 * t / step:.2f}% |")
    dist.barrier()
    os._exit(0)  # see MACHINE_NOTES: a gloo worker can deadlock in process-group teardown


if __name__ == "__main__":
    main()
