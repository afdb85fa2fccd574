"""Memory per rank for N = 1, 2, 4, 8: shardopt's stages and master-weight modes next to DDP + AdamW,
a replicated optimizer without master weights (fairseq's memory-efficient one), PyTorch's
ZeroRedundancyOptimizer, FSDP2 and DeepSpeed ZeRO-1/2 (when installed), measured and predicted.

    python benchmarks/bench_memory.py                                # N = 1, 2, 4, 8 on CPU (gloo), ~7 min on 2 cores
    python benchmarks/bench_memory.py --world-sizes 1 2 --n-layer 2  # quicker
    python benchmarks/bench_memory.py --device cuda --world-sizes 1  # one GPU (NCCL), adds torch.cuda figures

The driver launches ``torchrun --standalone --nproc_per_node=N`` for each N (oversubscribing the
cores is fine: this measures bytes, not speed). Every rank builds each configuration in turn on
the example GPT, takes a warm-up step and timed steps, and records, from the tensors held after
``step()``: bytes of parameters, gradients, master weights, Adam moments, other optimizer state
("extra") and communication buffers. shardopt reports its own (``memory_report``); for the peers
we sum ``nbytes`` of the local parameter, gradient and optimizer-state tensors. Buffers of the
peers are not visible from outside and are left blank, except DDP's, which are the gradients
(``gradient_as_bucket_view=True``). Also: peak RSS (VmHWM, reset before each configuration) and
RSS before it (psutil), and on CUDA ``torch.cuda.max_memory_allocated``/``reserved`` per phase.
On CPU the peak of each of the first 3 steps is counted without trusting any library: every live
tensor and ``.grad`` (``benchmarks/live_tensors.py``), sampled from a gradient hook on every
parameter and after each step.
On CPU the ranks use shardopt's reference update kernel unless SHARDOPT_KERNEL says otherwise. A
first, discarded run of the first configuration warms each process up.

Precision: shardopt and the no-master optimizer keep bf16 weights (compute in fp32 on CPU, bf16 on
CUDA). DDP, ZeroRedundancyOptimizer and FSDP2 keep fp32 weights, as with ``torch.amp``; DDP's
16 B/param then equals mixed-precision Adam's 2 + 2 + 12. "predicted" is ``shardopt.estimate``
for shardopt and the ZeRO formula (Rajbhandari et al. 2019) for the rest. Writes
benchmarks/results/memory.md, memory.csv and memory.png (``memory_cuda.*`` on CUDA).
"""
from __future__ import annotations

import datetime
import argparse
import csv
import ctypes
import gc
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch as launch  # noqa: E402
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shardopt  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from live_tensors import LiveTensors  # noqa: E402
from shardopt.estimate import estimate_memory  # noqa: E402

CATS = ("params", "grads", "master", "exp_avg", "exp_avg_sq", "extra", "buffers")
MODES = ("fp32", "remainder", "stochastic", "none")
MODEL_ARGS = ("n_layer", "n_embd", "n_head", "block_size", "batch_size")
CONFIGS = [f"shardopt S{s} {m}" for s in (1, 2) for m in MODES] + [
    "shardopt S2 remainder+bf16", "shardopt S2 remainder+8bit"] + [  # master + moments modes
    "DDP + AdamW", "replicated, no master", "ZeroRedundancyOptimizer", "FSDP2", "DeepSpeed ZeRO-1", "DeepSpeed ZeRO-2",
    # Muon for the blocks' matrices, AdamW for the rest: ShardedMuon (bf16 weights, fp32 master) and
    # DDP with torch.optim.Muon + torch.optim.AdamW (fp32 weights), as a careful user runs them today.
    "shardopt S2 muon", "shardopt S2 muon+bf16", "DDP + Muon + AdamW",  # +bf16: moments="bf16" (both rules)
    # DeepSpeed's Muon at ZeRO-1/2 (bf16 weights, fp32 master), its own rule for which parameters are
    # Muon's (2-D, name without "embed"/"lm_head": here also wte and wpe), torch's Adam for the rest.
    "DeepSpeed ZeRO-1 Muon", "DeepSpeed ZeRO-2 Muon"]
# Bytes per parameter per rank, model states only (ZeRO paper accounting), for the peers; N ranks.
FORMULAS = {
    "DDP + AdamW": lambda n: 4 + 4 + 8,  # fp32 weights and grads, fp32 moments (= 2 + 2 + 12 mixed)
    "replicated, no master": lambda n: 2 + 2 + 8,
    "ZeroRedundancyOptimizer": lambda n: 4 + 4 + 8 / n,
    "FSDP2": lambda n: 16 / n,
    "DeepSpeed ZeRO-1": lambda n: 2 + 2 + 12 / n,
    "DeepSpeed ZeRO-2": lambda n: 2 + (2 + 12) / n,
}
# Formula lines of the plot and the configurations measured against each.
SERIES = [("DDP + AdamW: 16", FORMULAS["DDP + AdamW"], ["DDP + AdamW"]),
          ("replicated, no master: 2 + 2 + 8", FORMULAS["replicated, no master"], ["replicated, no master"]),
          ("ZeroRedundancyOptimizer, fp32: 4 + 4 + 8/N", FORMULAS["ZeroRedundancyOptimizer"], ["ZeroRedundancyOptimizer"]),
          ("ZeRO-1: 2 + 2 + 12/N", FORMULAS["DeepSpeed ZeRO-1"], ["shardopt S1 fp32", "DeepSpeed ZeRO-1"]),
          ("ZeRO-2: 2 + (2 + 12)/N", FORMULAS["DeepSpeed ZeRO-2"], ["shardopt S2 fp32", "DeepSpeed ZeRO-2"]),
          ("ZeRO-2, remainder: 2 + (2 + 10)/N", lambda n: 2 + 12 / n, ["shardopt S2 remainder"]),
          ("ZeRO-2, no master: 2 + (2 + 8)/N", lambda n: 2 + 10 / n, ["shardopt S2 stochastic", "shardopt S2 none"]),
          ("ZeRO-2, remainder, bf16 moments: 2 + (2 + 6)/N", lambda n: 2 + 8 / n, ["shardopt S2 remainder+bf16"]),
          ("ZeRO-2, remainder, 8-bit moments: 2 + (2 + 4.125)/N", lambda n: 2 + 6.125 / n,
           ["shardopt S2 remainder+8bit"]),
          ("ZeRO-3 / FSDP2, fp32: 16/N", FORMULAS["FSDP2"], ["FSDP2"])]


# ---------------------------------------------------------------------------------------- worker
class ReplicatedNoMasterAdamW(torch.optim.Optimizer):
    """AdamW on 16-bit weights with fp32 moments and no master: each update is computed in fp32
    and rounded to the weight's dtype (fairseq's MemoryEfficientFP16Optimizer). For comparison."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            (b1, b2), lr = g["betas"], g["lr"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"], st["exp_avg"], st["exp_avg_sq"] = 0, torch.zeros_like(p, dtype=torch.float32), \
                        torch.zeros_like(p, dtype=torch.float32)
                st["step"] += 1
                grad, w = p.grad.float(), p.float()
                st["exp_avg"].lerp_(grad, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                denom = (st["exp_avg_sq"] / (1 - b2 ** st["step"])).sqrt_().add_(g["eps"])
                w.mul_(1 - lr * g["weight_decay"]).addcdiv_(st["exp_avg"], denom, value=-lr / (1 - b1 ** st["step"]))
                p.copy_(w)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors) -> int:
    """Bytes of distinct local tensors (a tied weight counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() >= 0:
            t = _local(t)
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def _state_cats(state) -> dict:
    out = {"exp_avg": 0, "exp_avg_sq": 0, "extra": 0}
    for per_param in state.values():
        for k, v in per_param.items():
            if isinstance(v, torch.Tensor):
                k = "exp_avg" if k == "momentum_buffer" else k  # Muon's one moment
                out[k if k in out else "extra"] += _nbytes([v])
    return out


def _rss(reset: bool = False) -> tuple[int, int]:
    """(current RSS, peak RSS since the last reset), bytes; ``reset`` first frees what it can and
    restarts the peak (Linux: VmHWM, reset through /proc/self/clear_refs)."""
    import psutil

    if reset:
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed memory back, so RSS starts clean
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
    status = open("/proc/self/status").read() if os.path.exists("/proc/self/status") else ""
    hwm, rss = re.search(r"VmHWM:\s+(\d+) kB", status), psutil.Process().memory_info().rss
    return rss, int(hwm.group(1)) * 1024 if hwm else rss


def build(name: str, args: argparse.Namespace, device: torch.device, n: int) -> dict:
    """The model and callables ``fwd_bwd(x, y)``, ``step()``, ``zero_grad()``, ``cats()`` (bytes held by
    category) for configuration ``name`` on this rank, and the ``predicted`` bytes."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    sixteen = name.startswith(("shardopt", "replicated", "DeepSpeed"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.block_size,
                          compute_dtype=compute)).to(device, torch.bfloat16 if sixteen else torch.float32)
    groups, hp = model.param_groups(0.1), dict(lr=1e-3, betas=(0.9, 0.95))
    in_opt = [p for g in groups for p in g["params"]]
    shapes, index = [tuple(p.shape) for p in in_opt], {id(p): i for i, p in enumerate(in_opt)}
    params = lambda: list(model.parameters())  # noqa: E731
    model_states = lambda: {"params": _nbytes(params()), "grads": _nbytes(p.grad for p in params())}  # noqa: E731
    formula = FORMULAS.get(name)
    predicted = None if formula is None else {"total_states": formula(n) * sum(p.numel() for p in params())}
    if name.startswith("shardopt S2 muon"):
        from gpt import muon_param_groups

        groups, moments = muon_param_groups(model, 0.1, hp["lr"]), "bf16" if name.endswith("+bf16") else "fp32"
        opt = shardopt.ShardedMuon(groups, lr=0.02, stage=2, bucket_cap_mb=args.bucket_cap_mb, loss_scale=None,
                                   moments=moments)
        ests = []
        for g, rule in zip(groups, ("muon", "adamw")):
            where = {id(p): i for i, p in enumerate(g["params"])}
            ests.append(estimate_memory(None, n, 2, "fp32", torch.bfloat16, param_shapes=[tuple(p.shape) for p in g["params"]],
                                        bucket_cap_mb=args.bucket_cap_mb, rank=dist.get_rank(), rule=rule,
                                        moments=moments,
                                        grad_order=[where[id(p)] for p in reversed(params()) if id(p) in where],
                                        backend="nccl" if device.type == "cuda" else "gloo").by_category())
        rep = lambda: {c: getattr(opt.memory_report(), c) for c in CATS}  # noqa: E731
        return dict(model=model, fwd_bwd=lambda x, y: opt.backward(model(x, y)), step=opt.step, zero_grad=opt.zero_grad,
                    cats=rep, predicted={c: sum(e[c] for e in ests) for c in CATS})
    if name == "DDP + Muon + AdamW":
        from gpt import muon_param_groups

        muon_group, adamw_group = muon_param_groups(model, 0.1, hp["lr"])
        wrapped = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_cap_mb)
        muon = torch.optim.Muon(muon_group["params"], lr=0.02, weight_decay=0.1)
        adamw = torch.optim.AdamW(adamw_group["params"], **hp, fused=True)
        hidden = sum(p.numel() for p in muon_group["params"])
        total = sum(p.numel() for p in params())
        both = lambda: {**muon.state, **adamw.state}  # noqa: E731
        return dict(model=model, fwd_bwd=lambda x, y: wrapped(x, y).backward(),
                    step=lambda: (muon.step(), adamw.step()), zero_grad=lambda: (muon.zero_grad(), adamw.zero_grad()),
                    cats=lambda: {**model_states(), "master": 0, **_state_cats(both()), "buffers": 0},
                    predicted={"total_states": 4 * total + 4 * total + 4 * hidden + 8 * (total - hidden)})
    if name.startswith("shardopt"):
        stage, (mode, _, moments) = int(name[10]), name.split()[-1].partition("+")
        moments = moments or "fp32"
        opt = shardopt.ShardedAdamW(groups, **hp, stage=stage, master_weights=mode, moments=moments,
                                    bucket_cap_mb=args.bucket_cap_mb, loss_scale=None)
        # Gradients become ready in about the reverse of the order the model registers its parameters.
        est = estimate_memory(None, n, stage, mode, torch.bfloat16, param_shapes=shapes, bucket_cap_mb=args.bucket_cap_mb,
                              moments=moments,
                              grad_order=[index[id(p)] for p in reversed(params())], rank=dist.get_rank(),
                              backend="nccl" if device.type == "cuda" else "gloo")
        rep = lambda: {c: getattr(opt.memory_report(), c) for c in CATS}  # noqa: E731
        return dict(model=model, fwd_bwd=lambda x, y: opt.backward(model(x, y)), step=opt.step, zero_grad=opt.zero_grad,
                    cats=rep, predicted=est.by_category())
    if name.startswith("DeepSpeed"):
        import deepspeed  # noqa: F401  (ImportError: reported as skipped)

        optimizer = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3, "betas": [0.9, 0.95],
                                                "torch_adam": True}} if name.endswith("Muon") else \
            {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "torch_adam": True}}
        stage = int(name.split()[1][-1])
        if name.endswith("Muon"):  # ZeRO accounting: bf16 weights and grads, fp32 master, Muon's one moment
            total = sum(p.numel() for p in params())
            mats = sum(p.numel() for k, p in model.named_parameters()
                       if p.dim() >= 2 and not any(w in k.lower() for w in ("embed", "lm_head")))
            sharded = 4 * total + 4 * mats + 8 * (total - mats) + (2 * total if stage == 2 else 0)
            predicted = {"total_states": 2 * total + (2 * total if stage == 1 else 0) + sharded / n}
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config={
            "train_micro_batch_size_per_gpu": args.batch_size, "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage,
                                  "reduce_bucket_size": int(args.bucket_cap_mb * 2**20)}, "optimizer": optimizer})

        def ds_cats() -> dict:
            inner = opt.optimizer
            master = _nbytes(getattr(opt, "single_partition_of_fp32_groups", []))
            return {**model_states(), "master": master, **_state_cats(inner.state), "buffers": None}

        return dict(model=model, fwd_bwd=lambda x, y: engine.backward(engine(x, y)), step=engine.step,
                    zero_grad=lambda: None, cats=ds_cats, predicted=predicted)
    if name == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (n,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped, opt = model, torch.optim.AdamW(model.param_groups(0.1), **hp)
    else:
        wrapped = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_cap_mb)
        if name == "DDP + AdamW":
            opt = torch.optim.AdamW(groups, **hp, fused=True)
        elif name == "replicated, no master":
            opt = ReplicatedNoMasterAdamW(groups, **hp)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(params(), optimizer_class=torch.optim.AdamW, **hp, weight_decay=0.1)
    state = lambda: (opt.optim.state if hasattr(opt, "optim") else opt.state)  # noqa: E731
    buffers = 0 if name != "FSDP2" else None  # DDP's buckets are the gradients; FSDP2's are not visible
    cats = lambda: {**model_states(), "master": 0, **_state_cats(state()), "buffers": buffers}  # noqa: E731
    return dict(model=model, fwd_bwd=lambda x, y: wrapped(x, y).backward(), step=opt.step, zero_grad=opt.zero_grad,
                cats=cats, predicted=predicted)


def measure(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    cuda = device.type == "cuda"
    rss_before, _ = _rss(reset=True)
    if cuda:  # what earlier configurations of this process freed goes back, so "reserved" is this one's
        torch.cuda.empty_cache()
    phases: dict[str, float] = {}

    def phase(label: str, start: bool) -> None:
        if cuda:
            torch.cuda.synchronize()
            if start:
                torch.cuda.reset_peak_memory_stats()
            else:
                phases[f"cuda {label} allocated"] = torch.cuda.max_memory_allocated()
                phases[f"cuda {label} reserved"] = torch.cuda.max_memory_reserved()

    walk = not cuda  # on CPU: count live tensors from gradient hooks during the first 3 steps
    live = LiveTensors().__enter__() if walk else None
    base = live.bytes() if walk else 0
    phase("build", True)
    run = build(name, args, device, n)
    model, predicted = run["model"], run["predicted"]
    phase("build", False)
    walked = [0]  # per step: the most live tensor bytes seen, over what was live before the build

    def sample(*_: object) -> None:
        walked[-1] = max(walked[-1], live.bytes() - base)

    hooks = [p.register_post_accumulate_grad_hook(sample) for p in model.parameters() if p.requires_grad] if walk else []
    g = torch.Generator().manual_seed(1000 + rank)
    times, opt_times, losses = [], [], []
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, 256, (args.batch_size, args.block_size), generator=g).to(device)
        y = x.roll(-1, dims=1)
        t0 = time.perf_counter()
        phase("forward+backward", True)
        with torch.no_grad():
            losses.append(float(model(x, y)) if i == 0 else float("nan"))
        run["fwd_bwd"](x, y)
        phase("forward+backward", False)
        phase("step", True)
        t1 = time.perf_counter()
        run["step"]()
        phase("step", False)
        t2 = time.perf_counter()
        if hooks:
            sample()
            if len(walked) == 3:
                for h in hooks:
                    h.remove()
                hooks = []
                live.__exit__()
            else:
                walked.append(0)
        if i == args.warmup + args.steps - 1:
            measured = run["cats"]()  # after step(), before zero_grad(): everything is allocated
        run["zero_grad"]()
        if i >= args.warmup:
            times.append(t2 - t0)
            opt_times.append(t2 - t1)
    _, peak = _rss()
    out = {"config": name, "rank": rank, "world_size": n, "num_params": sum(p.numel() for p in set(model.parameters())),
           **{f"measured {c}": measured.get(c) for c in CATS}, "rss before MiB": rss_before / 2**20,
           "peak rss MiB": peak / 2**20, "step ms": 1e3 * statistics.median(times),
           "optimizer step ms": 1e3 * statistics.median(opt_times), "initial loss": losses[0], **phases}
    if walk:
        out["walk peak step 1"], out["walk peak steps 2-3"] = walked[0], max(walked[1:] or [0])
    if predicted and "total_states" in predicted:
        out["predicted states"] = predicted["total_states"]
    elif predicted:
        out.update({f"predicted {c}": predicted[c] for c in CATS})
    del model, run
    return out


def worker(args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, results = dist.get_rank(), []
    try:  # warm the process up (allocator, gloo, lazy imports) so that no configuration pays for it
        measure(args.configs[0], args, device)
    except ImportError:
        pass
    for name in args.configs:
        try:
            results.append(measure(name, args, device))
        except ImportError as e:
            gc.unfreeze()  # the live-tensor count of a configuration that stopped part way
            results.append({"config": name, "rank": rank, "world_size": dist.get_world_size(),
                            "skipped": f"not installed ({e.name or e})"})
        except Exception as e:  # noqa: BLE001 - reported in the table; the next configuration runs
            results.append({"config": name, "rank": rank, "world_size": dist.get_world_size(),
                            "skipped": f"failed: {type(e).__name__}: {str(e)[:200]}"})
            gc.unfreeze()
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:  # what survives a later hang
            json.dump(results, f)
        dist.barrier()
        if rank == 0:
            print(f"N={dist.get_world_size()} {name}: {results[-1].get('skipped', 'done')}", flush=True)
    dist.barrier()  # every rank's result is written
    sys.stdout.flush()
    os._exit(0)  # see MACHINE_NOTES: a gloo worker can deadlock in process-group teardown


# ---------------------------------------------------------------------------------------- driver
def machine() -> str:
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        m = re.search(r"model name\s*:\s*(.+)", open("/proc/cpuinfo").read())
        cpu = m.group(1).strip() if m else cpu
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else 0
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} cores, {ram:.0f} GiB{gpu}; torch {torch.__version__}, shardopt "
            f"{shardopt.__version__}, Python {platform.python_version()}; {datetime.date.today().isoformat()}")


def states(r: dict) -> int:
    return sum(r[f"measured {c}"] or 0 for c in CATS if c != "buffers")


def summarize(rows: list[dict]) -> dict:
    """(config, N) -> the rank with the most bytes (model states plus known buffers)."""
    worst: dict = {}
    for r in rows:
        key = (r["config"], r["world_size"])
        r["states"], r["total"] = states(r), states(r) + (r["measured buffers"] or 0)
        if key not in worst or r["total"] > worst[key]["total"]:
            worst[key] = r
    return worst


def tables(rows: list[dict], skipped: dict, args: argparse.Namespace) -> str:
    worst, ns = summarize(rows), sorted({r["world_size"] for r in rows})
    configs = [c for c in CONFIGS if any((c, n) in worst for n in ns)]
    n_params = rows[0]["num_params"]
    md = lambda head, body: "\n".join(["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]  # noqa: E731
                                       + ["| " + " | ".join(map(str, b)) + " |" for b in body])
    out = [f"# Memory per rank\n\n{machine()}.\n\nExample GPT, {n_params:,} parameters ({args.n_layer} layers, "
           f"{args.n_embd} wide, batch {args.batch_size} x {args.block_size}), buckets of {args.bucket_cap_mb:g} MiB, "
           f"{args.device}, shardopt update kernel: {os.environ.get('SHARDOPT_KERNEL', 'reference' if args.device == 'cpu' else 'auto')}.\n\n    {' '.join(['python', 'benchmarks/bench_memory.py'] + sys.argv[1:])}\n"]
    body = []
    for c in configs:
        cells = []
        for n in ns:
            r = worst.get((c, n))
            if r is None:
                cells.append("")
                continue
            pred = r.get("predicted states", sum(r.get(f"predicted {k}", 0) for k in CATS if k != "buffers"))
            cells.append(f"{r['states'] / n_params:.2f} ({pred / n_params:.2f})")
        body.append([c] + cells)
    out.append("## Model states: bytes per parameter on each rank, measured (ZeRO formula)\n\n"
               "Weights, gradients, master weights, moments and other optimizer state; the rank with the most.\n\n"
               + md(["configuration"] + [f"N = {n}" for n in ns], body))
    ddp, s2 = [worst.get(("DDP + AdamW", n)) for n in ns], [worst.get(("shardopt S2 fp32", n)) for n in ns]
    if all(ddp) and all(s2):
        out.append("DDP + AdamW holds " + ", ".join(f"{d['states'] / s['states']:.2f}x (N = {n})" for n, d, s in
                                                    zip(ns, ddp, s2)) + " the model-state bytes of shardopt stage 2.")
    body, worst_dev = [], 0.0
    for c in [c for c in configs if c.startswith("shardopt")]:
        cells = []
        for n in ns:
            devs = [r["total"] / sum(r[f"predicted {k}"] for k in CATS) - 1 for r in rows
                    if r["config"] == c and r["world_size"] == n]
            r = worst[(c, n)]
            worst_dev = max([worst_dev] + [abs(d) for d in devs])
            cells.append(f"{r['total'] / n_params:.2f} / {max(devs, key=abs):+.2%}")
        body.append([c] + cells)
    out.append("## shardopt with communication buffers: bytes per parameter, and the estimate's error\n\n"
               "Total of all categories on the rank with the most; then the largest deviation of "
               "`shardopt.estimate_memory` from any rank's measured total.\n\n"
               + md(["configuration"] + [f"N = {n}" for n in ns], body)
               + f"\n\nLargest deviation over all ranks and configurations: {worst_dev:.2%}"
               + (" (within 1%)." if worst_dev <= 0.01 else " (MORE THAN 1%)."))
    top, mib = ns[-1], lambda v: "" if v is None else f"{v / 2**20:,.2f}"  # noqa: E731
    body = [[c] + [mib(worst[(c, top)][f"measured {k}"]) for k in CATS] + [mib(worst[(c, top)]["total"]),
            f"{worst[(c, top)]['peak rss MiB']:,.0f}", f"{worst[(c, top)]['peak rss MiB'] - worst[(c, top)]['rss before MiB']:,.0f}"]
            for c in configs if (c, top) in worst]
    out.append(f"## Every category at N = {top}, MiB on the rank with the most\n\nBlank: not visible from outside "
               "the library. Peak RSS is the process's (runtime included); growth is over the RSS before the "
               "configuration was built.\n\n" + md(["configuration", *CATS, "total", "peak RSS", "RSS growth"], body))
    body = [[c] + [f"{max(r['peak rss MiB'] - r['rss before MiB'] for r in rows if r['config'] == c and r['world_size'] == n):,.0f}"
                   if (c, n) in worst else "" for n in ns] for c in configs]
    out.append("## Peak RSS growth per rank, MiB (largest rank)\n\nPeak RSS while the configuration was built and "
               "stepped, minus the RSS before it: its tensors, activations and temporaries, without the runtime. With "
               "the reference update kernel, shardopt's includes the kernel's shard-sized fp32 temporaries, which "
               "the fused kernel does not allocate.\n\n"
               + md(["configuration"] + [f"N = {n}" for n in ns], body))
    if "walk peak step 1" in rows[0]:
        top_walk = lambda c, n, k: max(r[k] for r in rows if r["config"] == c and r["world_size"] == n)  # noqa: E731
        body = [[c] + [f"{top_walk(c, n, 'walk peak step 1') / 2**20:,.2f} / {top_walk(c, n, 'walk peak steps 2-3') / 2**20:,.2f}"
                       if (c, n) in worst else "" for n in ns] for c in configs]
        out.append("## Peak per rank over the first 3 steps, MiB: step 1 / steps 2-3 (largest rank)\n\nEvery tensor "
                   "reachable from Python and every `.grad`, counted from a gradient hook after each parameter's "
                   "gradient arrives and after each step (`benchmarks/live_tensors.py`), minus what was live before "
                   "the configuration was built: weights, gradients, optimizer state and buffers as each library holds "
                   "them, plus the batch; activations held only by autograd are not counted. On CPU the example GPT "
                   "computes in fp32, so the 16-bit configurations also hold the fp32 copies of the weights that "
                   "forward casts and saves for backward (up to 4 B/param).\n\n"
                   + md(["configuration"] + [f"N = {n}" for n in ns], body))
    cuda_keys = [k for k in rows[0] if k.startswith("cuda ")]
    if cuda_keys:
        body = [[c, str(n)] + [mib(worst[(c, n)].get(k)) for k in cuda_keys] + [f"{worst[(c, n)]['step ms']:.1f}",
                f"{worst[(c, n)]['optimizer step ms']:.1f}"] for c in configs for n in ns if (c, n) in worst]
        out.append("## CUDA: peak allocated and reserved per phase, MiB; step times, ms\n\n"
                   + md(["configuration", "N"] + [k[5:] for k in cuda_keys] + ["step", "optimizer step"], body))
    spread = max(max(r["initial loss"] for r in rows if r["world_size"] == n and r["rank"] == k)
                 - min(r["initial loss"] for r in rows if r["world_size"] == n and r["rank"] == k)
                 for n in ns for k in range(n))
    out.append(f"Check: every configuration starts from the same weights and batches; initial losses agree within "
               f"{spread:.4f} (bf16 against fp32 weights).")
    if skipped:
        out.append("Skipped: " + "; ".join(f"{c}: {why}" for c, why in skipped.items()) + ".")
    return "\n\n".join(out) + "\n"


def plot(rows: list[dict], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    worst, ns = summarize(rows), sorted({r["world_size"] for r in rows})
    n_params = rows[0]["num_params"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    grid = [2 ** (i / 4) for i in range(4 * 6 + 1)]  # N = 1 .. 64: the formulas beyond what we measured
    for i, (label, f, members) in enumerate(SERIES):
        color = f"C{i}"
        left.plot(grid, [f(n) for n in grid], "--", color=color, linewidth=1, label=label)
        for c, marker in zip(members, "ox"):
            pts = [(n, worst[(c, n)]["states"] / n_params) for n in ns if (c, n) in worst]
            if pts:
                left.plot(*zip(*pts), marker, color=color, markersize=7, mfc="none", label=f"  {c}, measured")
    for i, c in enumerate(c for c in CONFIGS if c.startswith("shardopt") and (c, ns[0]) in worst):
        tot = [(n, worst[(c, n)]["total"] / n_params) for n in ns]
        est = [(n, sum(worst[(c, n)][f"predicted {k}"] for k in CATS) / n_params) for n in ns]
        right.plot(*zip(*est), "-", color=f"C{i}", linewidth=1)
        right.plot(*zip(*tot), "o", color=f"C{i}", mfc="none", label=c)
    for ax, title in ((left, "model states (ZeRO accounting): measured and formulas"),
                      (right, "shardopt incl. communication buffers (gloo): measured (circles), estimate (lines)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("data-parallel ranks N")
        ax.set_ylabel("bytes per parameter on each rank")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    left.set_yscale("log", base=2)
    left.legend(fontsize=6.5, ncol=2)
    right.set_ylim(bottom=0)
    right.legend(fontsize=7)
    fig.suptitle(f"Memory per rank, example GPT with {n_params:,} parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"wrote {path}"


def drive(args: argparse.Namespace) -> None:
    rows, skipped = [], {}
    for n in args.world_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                   os.path.abspath(__file__), "--worker", "--out", tmp, "--device", args.device, "--configs", *args.configs]
            for k in MODEL_ARGS + ("bucket_cap_mb", "warmup", "steps"):
                cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            # A fixed mmap threshold hands large freed blocks straight back, so RSS follows the tensors.
            env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
            if args.device == "cpu":  # the update kernel changes no byte held; compiling it on every rank is slow
                env.setdefault("SHARDOPT_KERNEL", "reference")
            t = time.perf_counter()
            code, stdout, stderr = launch.run(cmd, args.timeout, env=env)  # killed with its ranks on a timeout
            output = stdout + stderr
            failure = (f"timed out after {args.timeout} s" if code is None else
                       None if code == 0 else f"exit {code}: {output[-2000:]}")
            done = set()
            for r in range(n):  # each rank rewrites its file after every configuration
                path = os.path.join(tmp, f"rank{r}.json")
                for res in json.load(open(path)) if os.path.exists(path) else []:
                    done.add(res["config"])
                    if "skipped" in res:
                        skipped[f"{res['config']} (N={n})"] = res["skipped"]
                    else:
                        rows.append(res)
            if failure:
                for c in args.configs:
                    if c not in done:
                        skipped[f"{c} (N={n})"] = failure.splitlines()[0][:300]
                print(f"N={n}: {failure[-3000:]}", flush=True)
            print(f"N={n}: {time.perf_counter() - t:.0f}s", flush=True)
    for c, why in skipped.items():
        print(f"skipped {c}: {why}")
    os.makedirs(args.results, exist_ok=True)
    stem = os.path.join(args.results, "memory" + ("_cuda" if args.device == "cuda" else ""))
    text = tables(rows, skipped, args)
    print(text)
    with open(stem + ".md", "w") as f:
        f.write(text + f"\n![memory per rank]({os.path.basename(stem)}.png)\n")
    with open(stem + ".csv", "w", newline="") as f:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(plot(rows, stem + ".png"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS, metavar="CONFIG")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    for k, default in zip(MODEL_ARGS, (4, 256, 4, 64, 2)):  # the example GPT, about 3.2M parameters
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=default)
    p.add_argument("--bucket-cap-mb", type=float, default=1.0, help="shardopt's and DDP's buckets, MiB")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up")
    p.add_argument("--timeout", type=int, default=1800, help="seconds for one world size")
    p.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    worker(args) if args.worker else drive(args)


if __name__ == "__main__":
    main()
