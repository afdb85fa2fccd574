"""Training-step time and memory per rank: shardopt next to DDP, PyTorch ZeRO, FSDP2 and DeepSpeed.

    python benchmarks/bench_step.py                       # both sizes, every configuration (~10 min on 2 cores)
    python benchmarks/bench_step.py --sizes 10M --steps 6
    python benchmarks/bench_step.py --device cuda             # 2 GPUs (NCCL), or world size 1 on one GPU

The driver launches `torchrun --standalone --nproc_per_node=2` once per configuration (so that peak
memory belongs to that configuration alone; a configuration that fails or outlives --timeout is
reported as such and the next one runs) on the example GPT with the same seeds and data, and merges
the results. Each run warms up for --warmup steps, then times --steps steps. Compute is fp32 in every
configuration (this CPU has no 16-bit matrix units); "bf16" means bf16 weights and gradients with an
fp32 master. Reported per rank: median step time, tokens/s, optimizer-step time (the optimizer's
step() call, which for sharded optimizers includes the weight all-gather), for shardopt its split
(the update, with each bucket's all-gather started as soon as that bucket is updated, then the time
blocked on the gathers still running after it), time blocked on communication where the library
reports it, peak RSS, and model-state bytes (weights + gradients +
optimizer state, from the tensors held; communication buffers such as DDP's gradient buckets and
shardopt's staging are left out for everyone). Ratios are to DDP + AdamW. Writes benchmarks/results/step.md
and step.png. The ``-overlap`` configurations (``overlap_param_gather=True``: the gathers are
waited for in the next forward, so step() returns before them) run only when named in --configs.

``--baseline DIR`` (a checkout of an earlier shardopt) adds configurations named ``NAME@base``: the
same configuration run with that checkout's package, in the same rounds, for before/after tables.

``--rounds R`` runs the whole list R times, in alternating order (as given, reversed, ...), so that a
machine's drift falls on every configuration alike; a row then gives the median over the rounds, and
its ratio to DDP is the median of the per-round ratios (each to DDP's launch of the same round),
with their range: the run-to-run noise next to every number.

With ``--device cuda`` the same configurations run on two GPUs over NCCL, or, with one GPU, at world
size 1: DDP's all-reduce is then a no-op, so the step and the optimizer-step columns show each
library's own cost. Peak memory there is ``torch.cuda.max_memory_allocated`` over the whole run
(first step included). Results go to step_cuda.md.
"""
from __future__ import annotations

import datetime
import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch as launch  # noqa: E402

SIZES = {"tiny": dict(n_layer=2, n_embd=64, n_head=4), "10M": dict(n_layer=6, n_embd=384, n_head=6), "50M": dict(n_layer=8, n_embd=704, n_head=8)}
CONFIGS = ["ddp", "zero", "fsdp2", "deepspeed1", "deepspeed2", "shardopt1-fp32", "shardopt2-fp32",
           "shardopt1-bf16", "shardopt2-bf16"]
# Not in the default list (each configuration is a launch): the same with overlap_param_gather=True,
# the weight all-gather of step() waited for bucket by bucket in the next forward.
EXTRA_CONFIGS = ["shardopt2-fp32-overlap", "shardopt2-bf16-overlap", "shardopt1-fp32-overlap", "shardopt1-bf16-overlap",
                 # Muon for the blocks' matrices, AdamW for the rest (lr 0.02 and 3e-4), fp32:
                 "ddp-muon", "shardopt1-muon", "shardopt2-muon",
                 # DeepSpeed's Muon at ZeRO-1/2, its defaults: its own rule picks the matrices (2-D, name
                 # without "embed"/"lm_head", here also wte and wpe), Gram Newton-Schulz, torch's Adam:
                 "deepspeed1-muon", "deepspeed2-muon"]
MUON_LR = 0.02


# ----------------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.config.endswith("@base"):  # the same configuration with an earlier checkout's shardopt
        sys.path.insert(0, os.path.abspath(args.baseline))
    import shardopt
    from gpt_batches import gpt_and_batches
    from live_tensors import storage_bytes

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, cpu_batch = gpt_and_batches(rank, args.block_size, args.batch_size, **SIZES[args.size])
    num_params = sum(p.numel() for p in model.parameters())  # before any wrapper shards them
    model.to(device)

    def batch():
        return tuple(t.to(device, non_blocking=True) for t in cpu_batch())

    sync = torch.cuda.synchronize if cuda else (lambda: None)  # a step's time includes its kernels

    hp = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    name, comm_wait, split = args.config.split("@")[0], None, None
    if name == "ddp" or name == "zero":
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, device_ids=[device.index] if cuda else None)
        if name == "ddp":
            opt = torch.optim.AdamW(model.parameters(), fused=True, **hp)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, fused=True, **hp)

        def train_step():
            x, y = batch()
            net(x, y).backward()
            sync()
            t = time.perf_counter()
            opt.step()
            sync()
            t = time.perf_counter() - t
            opt.zero_grad(set_to_none=False)
            return t

        def state():
            st = [s for v in opt.state.values() for s in v.values() if torch.is_tensor(s)] if name == "ddp" else \
                [s for v in opt.optim.state.values() for s in v.values() if torch.is_tensor(s)]
            return storage_bytes(list(model.parameters()) + [p.grad for p in model.parameters()] + st)
    elif name == "ddp-muon":  # what a careful user writes today: DDP, torch's Muon and fused AdamW on every rank
        from gpt import muon_param_groups
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, device_ids=[device.index] if cuda else None)
        muon_group, adamw_group = muon_param_groups(model, hp["weight_decay"], hp["lr"])
        muon = torch.optim.Muon(muon_group["params"], lr=MUON_LR, weight_decay=hp["weight_decay"])
        adamw = torch.optim.AdamW(adamw_group["params"], fused=True, lr=hp["lr"], betas=hp["betas"], weight_decay=0.0)

        def train_step():
            x, y = batch()
            net(x, y).backward()
            sync()
            t = time.perf_counter()
            muon.step()  # every rank orthogonalises every matrix
            adamw.step()
            sync()
            t = time.perf_counter() - t
            muon.zero_grad(set_to_none=False)
            adamw.zero_grad(set_to_none=False)
            return t

        def state():
            st = [s for o in (muon, adamw) for v in o.state.values() for s in v.values() if torch.is_tensor(s)]
            return storage_bytes(list(model.parameters()) + [p.grad for p in model.parameters()] + st)
    elif name == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=False, mp_policy=mp)
        fully_shard(model, reshard_after_forward=False, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **hp)

        def train_step():
            x, y = batch()
            model(x, y).backward()
            sync()
            t = time.perf_counter()
            opt.step()
            sync()
            t = time.perf_counter() - t
            opt.zero_grad()
            return t

        def state():
            st = [s for v in opt.state.values() for s in v.values() if torch.is_tensor(s)]
            return storage_bytes(list(model.parameters()) + [p.grad for p in model.parameters()] + st)
    elif name.startswith("deepspeed"):
        import deepspeed

        adam = {"betas": list(hp["betas"]), "weight_decay": hp["weight_decay"], "torch_adam": True}
        optimizer = {"type": "Muon", "params": {"lr": MUON_LR, "adam_lr": hp["lr"], **adam}} if name.endswith("-muon") \
            else {"type": "AdamW", "params": {"lr": hp["lr"], **adam}}
        ds_cfg = {"train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": 1,
                  "optimizer": optimizer, "zero_optimization": {"stage": int(name[9])}, "bf16": {"enabled": False}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)

        def train_step():
            x, y = batch()
            engine.backward(engine(x, y))
            sync()
            t = time.perf_counter()
            engine.step()
            sync()
            return time.perf_counter() - t

        def state():
            opt = engine.optimizer
            inner = getattr(opt, "optimizer", opt)
            st = [s for v in inner.state.values() for s in v.values() if torch.is_tensor(s)]
            extra = list(getattr(opt, "single_partition_of_fp32_groups", []))
            return storage_bytes(list(model.parameters()) + st + extra)
    else:
        stage, dtype = int(name[8]), name.split("-")[1]
        if dtype == "bf16":
            model = model.to(torch.bfloat16)
        if dtype == "muon":
            from gpt import muon_param_groups

            opt = shardopt.ShardedMuon(muon_param_groups(model, hp["weight_decay"], hp["lr"]), lr=MUON_LR, stage=stage)
        else:
            opt = shardopt.ShardedAdamW(model.param_groups(0.1), lr=hp["lr"], betas=hp["betas"], stage=stage,
                                        overlap_param_gather=name.endswith("-overlap"))

        def train_step():
            nonlocal comm_wait, split
            x, y = batch()
            opt.backward(model(x, y))
            sync()
            t = time.perf_counter()
            opt.step()
            sync()
            t = time.perf_counter() - t
            opt.zero_grad()
            comm_wait = opt.last_step_comm.wait_seconds
            if hasattr(opt, "last_step_update_seconds"):  # an earlier version may not report it
                split = (opt.last_step_update_seconds, opt.last_step_gather_wait_seconds)
            return t

        def state():
            rep = opt.memory_report()
            return rep.total - rep.buffers  # communication buffers are left out for every library

    for _ in range(args.warmup):
        train_step()
    times, opt_times, waits, splits = [], [], [], []
    for _ in range(args.steps):
        dist.barrier()
        sync()
        t = time.perf_counter()
        opt_times.append(train_step())
        sync()
        times.append(time.perf_counter() - t)
        if comm_wait is not None:
            waits.append(comm_wait)
        if split is not None:
            splits.append(split)
    step = statistics.median(times)
    result = {
        "config": name, "size": args.size, "params": num_params,
        "step_s": step, "tokens_per_s_rank": args.batch_size * args.block_size / step,
        "opt_s": statistics.median(opt_times), "comm_wait_s": statistics.median(waits) if waits else None,
        "split_s": [statistics.median(s) for s in zip(*splits)] if splits else None,
        "shardopt": os.path.dirname(os.path.dirname(os.path.abspath(shardopt.__file__))),
        "peak_rss_mb": (torch.cuda.max_memory_allocated() / 2**20 if cuda
                        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024), "state_bytes": state(),
    }
    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(results, f)
    dist.barrier()  # every rank's result is written
    sys.stdout.flush()
    os._exit(0)  # see MACHINE_NOTES: a gloo worker can deadlock in process-group teardown


# ----------------------------------------------------------------------------------- driver
def run_config(config: str, size: str, args: argparse.Namespace) -> list[dict] | str:
    if config.startswith("deepspeed"):
        try:
            import deepspeed  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return f"skipped: deepspeed not importable ({type(e).__name__}); pip install --no-build-isolation deepspeed"
    out = tempfile.mktemp(suffix=".json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", __file__,
           "--worker", "--config", config, "--size", size, "--result", out, "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--batch-size", str(args.batch_size), "--block-size", str(args.block_size),
           "--device", args.device, "--baseline", args.baseline]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t = time.perf_counter()
    res = launch.run_for_json(cmd, out, args.timeout, env=env)  # a hung launch is killed with its workers
    if isinstance(res, str):
        return res
    print(f"  {size:>4} {config:<16} {res[0]['step_s'] * 1e3:8.0f} ms/step  ({time.perf_counter() - t:.0f}s)", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="ddp")
    ap.add_argument("--size", default="10M")
    ap.add_argument("--result", default="")
    ap.add_argument("--sizes", default="10M,50M")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, any of {','.join(CONFIGS + EXTRA_CONFIGS)}")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--timeout", type=int, default=900, help="seconds for one configuration")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the list this many times in alternating order; rows give medians and ranges")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: 2; on cuda min(2, GPUs))")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--stem", default="", help="results file name without .md (default step, or step_cuda)")
    ap.add_argument("--reference", default="ddp", help="the configuration the ratios are to")
    ap.add_argument("--baseline", default="",
                    help="a checkout of an earlier shardopt: a configuration named NAME@base runs NAME with it, "
                         "in the same rounds as the others")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    import torch

    os.environ.setdefault("SHARDOPT_KERNEL", "auto")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no GPU visible")
        args.nproc = args.nproc or min(2, torch.cuda.device_count())
        where = f"{args.nproc} x {torch.cuda.get_device_name()} (nccl)"
    else:
        args.nproc = args.nproc or 2
        where = f"{args.nproc} ranks (gloo), 1 thread each"
    header = (f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores | torch {torch.__version__} | "
              f"{where} | batch {args.batch_size} x {args.block_size} tokens per rank | "
              f"{args.warmup} warm-up + {args.steps} timed steps"
              + (f" | {args.rounds} rounds, alternating order" if args.rounds > 1 else "")
              + f" | {datetime.date.today().isoformat()}")
    print(header, flush=True)
    peak = "peak CUDA allocated MB (per rank)" if args.device == "cuda" else "peak RSS MB (per rank)"
    if any(c.endswith("@base") for c in args.configs.split(",")):
        if not args.baseline or not os.path.isdir(os.path.join(args.baseline, "shardopt")):
            raise SystemExit("a NAME@base configuration needs --baseline DIR, a checkout holding shardopt/")
        rev = subprocess.run(["git", "-C", args.baseline, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        header += f" | @base: shardopt of {rev or args.baseline}"
    rows = [f"| size | configuration | step ms | vs {args.reference} | tokens/s/rank | optimizer step ms | update / gather "
            f"wait ms | comm wait ms | {peak} | model state MB/rank | vs {args.reference} |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    plot: dict = {}
    configs = args.configs.split(",")
    for size in args.sizes.split(","):
        rounds: list[dict] = []  # per round: config -> the ranks' results
        failed: dict = {}
        for k in range(args.rounds):
            rounds.append({})
            for config in (configs if k % 2 == 0 else configs[::-1]):
                res = run_config(config, size, args)
                if isinstance(res, str):
                    failed[config] = res if args.rounds == 1 else f"round {k + 1}: {res}"
                    print(f"  {size:>4} {config:<16} {res}", flush=True)
                else:
                    rounds[-1][config] = res
        ref = args.reference
        base = next((r[ref][0] for r in rounds if ref in r), None)  # the reference's model state, for the last column
        for config in configs:
            runs = [r[config] for r in rounds if config in r]
            if not runs:
                rows.append(f"| {size} | {config} | {failed[config]} | | | | | | | | |")
                continue
            res = sorted(runs, key=lambda rr: rr[0]["step_s"])[(len(runs) - 1) // 2]  # the median launch
            r0 = res[0]
            ratios = sorted(r[config][0]["step_s"] / r[ref][0]["step_s"] for r in rounds if config in r and ref in r)
            vs_ddp = ""
            if ratios:
                vs_ddp = f"{statistics.median(ratios):.2f}x"
                vs_ddp += f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(ratios) > 1 else ""
            wait = f"{r0['comm_wait_s'] * 1e3:.0f}" if r0["comm_wait_s"] is not None else "n/a"
            split = "n/a" if not r0.get("split_s") else " / ".join(f"{s * 1e3:.0f}" for s in r0["split_s"])
            peaks = "/".join(f"{r['peak_rss_mb']:.0f}" for r in res)
            state = f"{r0['state_bytes'] / base['state_bytes']:.2f}x" if base else ""
            rows.append(f"| {size} ({r0['params'] / 1e6:.1f}M) | {config} | {r0['step_s'] * 1e3:.0f} | {vs_ddp} | "
                        f"{r0['tokens_per_s_rank']:,.0f} | {r0['opt_s'] * 1e3:.0f} | {split} | {wait} | {peaks} | "
                        f"{r0['state_bytes'] / 2**20:.0f} | {state} |")
            if config in failed:
                rows[-1] += f" {failed[config]}"
            plot.setdefault(size, []).append((config, r0["step_s"], r0["state_bytes"]))
    table = "\n".join(rows)
    print("\n" + table)
    os.makedirs(args.out, exist_ok=True)
    stem = args.stem or ("step_cuda" if args.device == "cuda" else "step")
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write(f"# Training step, side by side\n\nCommand: `python benchmarks/bench_step.py --sizes {args.sizes} "
                f"--configs {args.configs} --steps {args.steps} --warmup {args.warmup} --rounds {args.rounds} "
                f"--device {args.device}" + (f" --baseline {args.baseline}" if args.baseline else "")
                + (f" --reference {args.reference}" if args.reference != "ddp" else "")
                + (f" --stem {args.stem}" if args.stem else "")
                + f"`\n\n{header}\n\n{table}\n")
    try:
        if not plot:
            raise ImportError("nothing to plot")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(plot), figsize=(6 * len(plot), 4.5), squeeze=False)
        for ax, (size, entries) in zip(axes[0], plot.items()):
            names = [e[0] for e in entries]
            ax.barh(names, [e[1] * 1e3 for e in entries], color=["#c44" if n.startswith("shardopt") else "#888" for n in names])
            ax.set_xlabel(f"median step time, ms ({where})")
            ax.set_title(f"GPT {size}")
            ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"{stem}.png"), dpi=110)
    except ImportError as e:
        print(f"no plot ({e})")
    print(f"written to {os.path.join(args.out, stem + '.md')}")


if __name__ == "__main__":
    main()
