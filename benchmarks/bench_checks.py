"""What the per-step usage checks cost, against the whole training step of the example GPT.

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_checks.py              # ~1 min on 2 CPU cores
    torchrun --standalone --nproc_per_node=2 benchmarks/bench_checks.py --stage 1 --n-layer 8

The checks that keep ordinary torch usage from corrupting training (parameters re-bound or written
from outside, zeroing through the model, unscaled backward passes, parameters without gradient)
cost three things on top of a step; each is measured here, in the same run, on rank 0:

* their Python work at step(), at the start of each backward and, in stage 2, pointing every
  ``p.grad`` at its placeholder after each reduction: ``opt.last_step_check_seconds``;
  (this includes the digest of every group's lr/betas/eps/weight_decay that finds a hyperparameter
  changed on one rank only);
* the numbers they add to the step's one all-reduce (the call header, the usage flags and that
  digest): an all-reduce of ``shardopt.comm._messages.StepMessage.NUMEL`` numbers against one of the 2
  (overflow flag, squared norm) it would carry without them (both latency-bound: the difference is
  mostly noise). A second all-reduce, of two bitmaps with one number per parameter, runs only in
  steps where some rank lacks a gradient for some parameter or a weight was written from outside;
  a third, of one flag per parameter, only in skipped steps that no loss scale can fix (to name
  the parameters whose gradients were not finite), so neither is in these numbers;
* with clipping, the step's own all-reduce after ``clip_grad_norm_``'s: code between the two calls
  (``model.zero_grad()`` on one rank, a weight write) may change something on one rank only, which
  only a collective can tell the others. Without the checks, a clipped step needs no all-reduce
  of its own.
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
from shardopt.comm._messages import StepMessage  # noqa: E402


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

    small, large = torch.zeros(2), torch.zeros(StepMessage.NUMEL)
    small_t: list[float] = []
    large_t: list[float] = []
    for i in range(200):  # interleaved, in alternating order, so that neither gets the warmer cache
        order = [(small, small_t), (large, large_t)]
        for t, out in order[::-1] if i % 2 else order:
            start = time.perf_counter()
            dist.all_reduce(t)
            out.append(time.perf_counter() - start)
    t_small, t_large = statistics.median(small_t), statistics.median(large_t)
    payload = max(t_large - t_small, 0.0)

    total = checks + payload + t_large  # the train step clips: the step's all-reduce is there for the checks
    if rank == 0:
        print(f"example GPT, {sum(q.numel() for q in model.parameters()):,} parameters in {n_params} tensors, bf16 "
              f"weights, stage {args.stage}, {world} gloo ranks, torch {torch.__version__}")
        print("| what | ms per step | share of the step |")
        print("|---|---:|---:|")
        print(f"| whole training step (forward, backward, clip, step) | {1e3 * step:.1f} | 100% |")
        for name, t in (("checks' Python work (opt.last_step_check_seconds)", checks),
                        (f"all-reduce of {large.numel()} numbers ({1e3 * t_large:.3f} ms) instead of 2 "
                         f"({1e3 * t_small:.3f} ms)", payload),
                        ("step()'s own all-reduce after clip_grad_norm_'s", t_large),
                        ("**all checks**", total)):
            print(f"| {name} | {1e3 * t:.3f} | {100 * t / step:.2f}% |")
    dist.barrier()
    os._exit(0)  # see MACHINE_NOTES: a gloo worker can deadlock in process-group teardown


if __name__ == "__main__":
    main()
