"""Tensor parallelism beside data parallelism: ShardedAdamW against FSDP2 on the same 2 x 2 mesh.

    python benchmarks/bench_tp.py                          # the example GPT, fp32 and bf16, 3 rounds (~6 min on 2 cores)
    python benchmarks/bench_tp.py --dtypes fp32 --rounds 2 --steps 6

Both configurations build the example GPT from seed 0, split its blocks Megatron-style over the
"tp" dimension of a (dp=2, tp=2) device mesh (``tensor_parallel`` in examples/gpt.py: qkv and fc
column-wise, proj and out row-wise, the embeddings, LayerNorms and head plain and replicated), and
read the same batches on the two ranks of each tensor-parallel group (seeded by the dp rank):

- ``shardopt-DTYPE``: ``shardopt.ShardedAdamW(stage=2, device_mesh=mesh["dp"])`` on the parallelized
  model; ``bf16`` stores bf16 weights and gradients with the fp32 master in the optimizer.
- ``fsdp2-DTYPE``: ``fully_shard(block, mesh=mesh["dp"])`` per block and on the root
  (``reshard_after_forward=False``, ZeRO-2-like, as in bench_step.py) with
  ``torch.optim.AdamW(fused=True)`` on the sharded fp32 parameters; ``bf16`` is
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` (the fp32 sharded parameter is the master).

Compute is fp32 everywhere (this CPU has no 16-bit matrix units); no gradient clipping in either.
Each configuration runs in its own ``torchrun --nproc_per_node=4`` launch, so that its peak memory
is its own; a launch that fails or outlives --timeout is reported and the next one runs. The list
runs --rounds times in alternating order (A, B, B, A, ...), and the ratio is taken within each
round. Per launch: median step time (forward, backward, step, zero_grad) over --steps after
--warmup, peak RSS of each rank (ru_maxrss), the model state per rank (weights, gradients, optimizer
state, communication buffers left out), and the loss at the first and last step: the same model on
the same data, so the two libraries' losses agree (fp32: to about 1e-3) before their times are
compared. Writes benchmarks/results/tp.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch as launch  # noqa: E402

SIZES = {"example": dict(n_layer=4, n_embd=128, n_head=4), "10M": dict(n_layer=6, n_embd=384, n_head=6)}
DP, TP = 2, 2
WHAT = {
    "shardopt": "ShardedAdamW stage 2, `device_mesh=mesh[\"dp\"]`, on the TP-parallelized model",
    "fsdp2": "`fully_shard(mesh=mesh[\"dp\"])` per block and root on the TP-parallelized model, "
             "`torch.optim.AdamW(fused=True)`",
}
# the loss after the timed steps may differ by this much between the two libraries (same model,
# same batches; bf16: bf16 gradients reduced in a different order)
LOSS_TOL = {"fp32": 2e-3, "bf16": 3e-2}


# ----------------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import shardopt
    from gpt import tensor_parallel
    from live_tensors import storage_bytes
    from gpt_batches import gpt_and_batches

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model, batch = gpt_and_batches(mesh["dp"].get_local_rank(), args.block_size, args.batch_size, **SIZES[args.size])
    num_params = sum(p.numel() for p in model.parameters())
    lib, dtype = args.config.split("-")
    hp = dict(lr=3e-4, betas=(0.9, 0.95))
    if lib == "shardopt":
        if dtype == "bf16":
            model = model.to(torch.bfloat16)
        tensor_parallel(model, mesh["tp"])
        opt = shardopt.ShardedAdamW(model.param_groups(0.1), stage=2, device_mesh=mesh["dp"], **hp)

        def train_step() -> float:
            loss = model(*batch())
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            return loss.item()

        def state() -> int:
            rep = opt.memory_report()
            return rep.total - rep.buffers  # communication buffers are left out for both
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        tensor_parallel(model, mesh["tp"])
        low = torch.bfloat16 if dtype == "bf16" else torch.float32
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low)
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False, mp_policy=mp)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False, mp_policy=mp)
        opt = torch.optim.AdamW(model.param_groups(0.1), fused=True, **hp)

        def train_step() -> float:
            loss = model(*batch())
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()

        def state() -> int:
            st = [s for v in opt.state.values() for s in v.values() if torch.is_tensor(s)]
            return storage_bytes(list(model.parameters()) + [p.grad for p in model.parameters()] + st)

    losses = [train_step() for _ in range(args.warmup)]
    times = []
    for _ in range(args.steps):
        dist.barrier()
        t = time.perf_counter()
        losses.append(train_step())
        times.append(time.perf_counter() - t)
    step = torch.tensor(times)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
    result = {"config": args.config, "params": num_params, "step_s": statistics.median(step.tolist()),
              "losses": losses, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "state_bytes": state(), "state": "measured after the last step (gradients zeroed)"}
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(results, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # a gloo worker can deadlock in process-group teardown (as in bench_step.py)


# ----------------------------------------------------------------------------------- driver
def run_config(config: str, args: argparse.Namespace) -> list[dict] | str:
    out = tempfile.mktemp(suffix=".json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={DP * TP}", __file__,
           "--worker", "--config", config, "--size", args.size, "--result", out, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--block-size", str(args.block_size)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t = time.perf_counter()
    res = launch.run_for_json(cmd, out, args.timeout, env=env)  # a hung launch is killed with its workers
    if isinstance(res, str):
        return res
    print(f"  {config:<14} {res[0]['step_s'] * 1e3:7.0f} ms/step  loss {res[0]['losses'][0]:.4f} -> "
          f"{res[0]['losses'][-1]:.4f}  ({time.perf_counter() - t:.0f}s)", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="shardopt-fp32")
    ap.add_argument("--result", default="")
    ap.add_argument("--size", choices=sorted(SIZES), default="example")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per dp rank")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="run the list this many times in alternating order")
    ap.add_argument("--timeout", type=int, default=300, help="seconds for one launch")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "tp.md"))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    import torch

    os.environ.setdefault("SHARDOPT_KERNEL", "auto")  # the compiled update kernel, as a user gets it
    configs = [f"{lib}-{d}" for d in args.dtypes.split(",") for lib in ("shardopt", "fsdp2")]
    header = (f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores | torch {torch.__version__} | "
              f"{DP * TP} ranks (gloo) as dp {DP} x tp {TP}, 1 thread each | GPT {args.size} | batch {args.batch_size} x "
              f"{args.block_size} tokens per dp rank | {args.warmup} warm-up + {args.steps} timed steps | "
              f"{args.rounds} rounds, alternating order | SHARDOPT_KERNEL={os.environ['SHARDOPT_KERNEL']} | "
              f"{datetime.date.today().isoformat()}")
    print(header, flush=True)
    rounds: list[dict] = []
    failed: dict[str, list[str]] = {}
    for k in range(args.rounds):
        rounds.append({})
        for config in configs if k % 2 == 0 else configs[::-1]:
            res = run_config(config, args)
            if isinstance(res, str):
                failed.setdefault(config, []).append(f"round {k + 1}: {res}")
                print(f"  {config:<14} {res}", flush=True)
            else:
                rounds[-1][config] = res
    rows = ["| configuration | what it does | step ms, median of rounds | step ms per round | vs FSDP2 + TP per round "
            "| peak RSS MB per rank | model state MB/rank | loss, first -> last step |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    problems = []
    for config in configs:
        lib, dtype = config.split("-")
        runs = [r[config] for r in rounds if config in r]
        note = "; ".join(failed.get(config, []))
        if not runs:
            rows.append(f"| {config} | {WHAT[lib]} | {note} | | | | | |")
            continue
        steps = [run[0]["step_s"] * 1e3 for run in runs]
        peer = f"fsdp2-{dtype}"
        ratios = [r[config][0]["step_s"] / r[peer][0]["step_s"] for r in rounds if config in r and peer in r]
        mid = sorted(runs, key=lambda run: run[0]["step_s"])[(len(runs) - 1) // 2]  # the median launch
        losses = mid[0]["losses"]
        if lib == "shardopt":
            for r in rounds:
                if config in r and peer in r:
                    gap = abs(r[config][0]["losses"][-1] - r[peer][0]["losses"][-1])
                    if gap > LOSS_TOL[dtype]:
                        problems.append(f"{config}: last loss {gap:.4f} away from {peer}'s (tolerance {LOSS_TOL[dtype]})")
        per_round = " / ".join(f"{s:.0f}" for s in steps)
        vs = " / ".join(f"{x:.2f}x" for x in ratios)
        peaks = "/".join(f"{r['peak_rss_mb']:.0f}" for r in mid)
        what = WHAT[lib] + (", bf16 weights" if dtype == "bf16" else ", fp32")
        rows.append(f"| {config} | {what} | {statistics.median(steps):.0f} | {per_round} | {vs} | {peaks} | "
                    f"{mid[0]['state_bytes'] / 2**20:.2f} | {losses[0]:.4f} -> {losses[-1]:.4f} |"
                    + (f" {note}" if note else ""))
    params = next((run[0]["params"] for r in rounds for run in r.values()), 0)
    table = "\n".join(rows)
    check = ("Loss check: in every round each shardopt configuration's last loss is within "
             + ", ".join(f"{v:g} ({k})" for k, v in LOSS_TOL.items()) + " of FSDP2's on the same dtype.")
    if problems:
        check = "LOSS CHECK FAILED: " + "; ".join(problems)
    print("\n" + table + "\n\n" + check)
    command = ("python benchmarks/bench_tp.py" + (f" --size {args.size}" if args.size != "example" else "")
               + f" --dtypes {args.dtypes} --steps {args.steps} --warmup {args.warmup} --rounds {args.rounds}")
    with open(args.out, "w") as f:
        f.write(f"# Tensor parallelism: ShardedAdamW against FSDP2, dp 2 x tp 2\n\n"
                f"The example GPT ({params:,} parameters) split Megatron-style over tp=2 and sharded over dp=2 "
                f"(`benchmarks/bench_tp.py`'s docstring says what each configuration does). Per-rank figures are "
                f"for the rank's part of the model. \"vs FSDP2 + TP\" is the step time of the row over FSDP2's "
                f"on the same dtype in the same round.\n\nCommand: `{command}`\n\n{header}\n\n{table}\n\n{check}\n")
    print(f"written to {args.out}")
    if problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
