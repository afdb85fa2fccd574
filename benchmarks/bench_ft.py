"""Replica groups under torchft: steps per second beside the same job without it, and what healing moves.

    python benchmarks/bench_ft.py                     # ~3 min on 2 CPU cores
    python benchmarks/bench_ft.py --rounds 3 --out benchmarks/results/ft.md

Two measurements, each run as real processes on this machine (gloo, loopback), a small byte-level
GPT (examples/gpt.py), stage 2, fp32:

* **Throughput**, alternating ``--rounds`` times: 4 ranks as 2 replicas x 2 shards, once as a 2-D
  ``DeviceMesh`` (``ShardedAdamW(device_mesh=...)``: shardopt's fixed hybrid sharding, one torchrun
  job, no torchft) and once as 2 torchft replica groups of 2 ranks (``replicas=manager``, torchft's
  ``OptimizerWrapper``: a quorum and a commit vote every step, the cross-group reductions through
  ``Manager.allreduce``). Steps per second of rank 0 over ``--steps`` steps after a warm-up.
* **Healing**: group 0 trains alone; group 1 starts late and heals from it at its first step.
  Reported: the bytes one rank receives (its shard of the optimizer state and the weights; from
  ``heal_state_dict``, what is sent), beside the model's weights and whole optimizer state; the
  time of the returning group's first step (quorum, transfer over torchft's HTTP transport, load
  in place) beside a steady step. Group 1 starts once group 0 has taken 3 steps alone.

A launch that fails or outlives ``--timeout`` is reported as such and the driver goes on.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def _model(layers: int, width: int):  # noqa: ANN202
    import torch
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=32, n_layer=layers, n_head=4, n_embd=width))


def _batch(step: int, rank: int):  # noqa: ANN202
    import torch

    g = torch.Generator().manual_seed(1009 * step + rank)
    x = torch.randint(256, (4, 32), generator=g)
    return x, torch.roll(x, -1, 1)


def worker() -> None:
    import torch
    import torch.distributed as dist

    import shardopt

    torch.set_num_threads(1)
    kind, out = os.environ["BENCH_KIND"], os.environ["BENCH_OUT"]
    steps, warmup = int(os.environ["BENCH_STEPS"]), 5
    layers, width = int(os.environ["BENCH_LAYERS"]), int(os.environ["BENCH_WIDTH"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    model = _model(layers, width)
    times: list[float] = []
    if kind == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, device_mesh=mesh)
        for step in range(warmup + steps):
            start = time.perf_counter()
            opt.zero_grad()
            model(*_batch(step, rank)).backward()
            opt.step()
            times.append(time.perf_counter() - start)
        record = {"steps_per_second": steps / sum(times[warmup:])}
    else:
        from torchft import Manager
        from torchft.optim import OptimizerWrapper
        from torchft.process_group import ProcessGroupGloo

        import shardopt.fault_tolerance
        from shardopt.checkpoint._rank_state import heal_state_dict

        group = int(os.environ["BENCH_GROUP"])
        manager = Manager(pg=ProcessGroupGloo(timeout=datetime.timedelta(seconds=30)), load_state_dict=None,
                          state_dict=None, min_replica_size=1, replica_id=f"group{group}", hostname="127.0.0.1",
                          init_sync=False, timeout=datetime.timedelta(seconds=60),
                          quorum_timeout=datetime.timedelta(seconds=120))
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, replicas=manager)
        shardopt.fault_tolerance.register(manager, opt)
        wrapped = OptimizerWrapper(manager, opt)
        healed_at, together = None, 0  # steps taken with both groups in the quorum
        # healing: group 0 trains alone until group 1 came and healed; both then take the same steps
        while together < warmup + steps if kind == "heal" else manager.current_step() < warmup + steps:
            before, start = manager.current_step(), time.perf_counter()
            wrapped.zero_grad()
            model(*_batch(before, 4 * group + rank)).backward()
            wrapped.step()
            times.append(time.perf_counter() - start)
            if healed_at is None and manager.current_step() > before + 1:
                healed_at = len(times) - 1
            together += manager.num_participants() == 2 and manager.current_step() == before + 1
            if kind == "heal" and group == 0 and rank == 0 and manager.current_step() == 3:
                open(os.path.join(out, "trained"), "w").close()  # the driver starts group 1 now
        record = {"steps_per_second": steps / sum(times[-steps:])}
        if kind == "heal" and group == 1:
            sd = heal_state_dict(opt)
            nbytes = sum(t.nbytes for b in sd["buffers"] for t in b.values() if isinstance(t, torch.Tensor))
            nbytes += sum(t.nbytes for t in sd["weights"])
            params = sum(p.numel() for p in model.parameters())
            record.update(heal_bytes=nbytes, params=params, healed_at=healed_at,
                          heal_seconds=times[healed_at] if healed_at is not None else None,
                          steady_seconds=statistics.median(times[-steps:]))
        manager.shutdown(wait=False)
    if rank == 0 or kind == "heal":
        name = f"{kind}-g{os.environ.get('BENCH_GROUP', '0')}-r{rank}.json"
        with open(os.path.join(out, name), "w") as f:
            json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_group(env: dict[str, str], group: int, ranks: int) -> list[subprocess.Popen]:
    """The ranks of one replica group, each its own process; their output goes to files (torchft logs
    every step: a pipe nobody reads would fill and stop them)."""
    port = _free_port()
    return [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, text=True,
                             stderr=open(os.path.join(env["BENCH_OUT"], f"err-g{group}-r{r}.txt"), "w"),
                             env={**env, "BENCH_GROUP": str(group), "RANK": str(r), "LOCAL_RANK": str(r),
                                  "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for r in range(ranks)]


def _wait(procs: list[subprocess.Popen], timeout: float) -> str | None:
    """None when every process exited 0 within ``timeout`` s; else why not (and they are killed)."""
    from _launch import kill_tree

    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                kill_tree(q.pid)
            return f"timed out after {timeout:g} s"
    bad = [p for p in procs if p.returncode != 0]
    if bad:
        with open(bad[0].stderr.name) as f:  # type: ignore[union-attr]
            return f"exit {bad[0].returncode}: {f.read()[-800:]}"
    return None


def run_config(kind: str, args: argparse.Namespace, layers: int, width: int) -> dict | str:
    """One launch of ``kind`` ("mesh", "torchft", "heal"); its records, or why it failed."""
    out = tempfile.mkdtemp(prefix=f"bench_ft_{kind}_")
    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_KIND=kind, BENCH_OUT=out, BENCH_STEPS=str(args.steps),
               BENCH_LAYERS=str(layers), BENCH_WIDTH=str(width),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if kind == "mesh":
        from _launch import run

        code, _, err = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                            os.path.abspath(__file__), "--worker"], args.timeout, env=env, cwd=ROOT)
        failed = None if code == 0 else ("timed out" if code is None else f"exit {code}: {err[-800:]}")
    else:
        from torchft.coordination import LighthouseServer

        # heal: group 0 may not wait for group 1 (it starts late on purpose); torchft: both groups join at once
        lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1 if kind == "heal" else 2,
                                      join_timeout_ms=2000)
        env["TORCHFT_LIGHTHOUSE"] = lighthouse.address()
        try:
            procs = _launch_group(env, 0, 2)
            until = time.monotonic() + args.timeout
            while kind == "heal" and not os.path.exists(os.path.join(out, "trained")) and time.monotonic() < until:
                time.sleep(0.1)  # group 1 comes once group 0 has taken 3 steps alone
            procs += _launch_group(env, 1, 2)
            failed = _wait(procs, args.timeout)
        finally:
            lighthouse.shutdown()
    if failed:
        return failed
    records = {}
    for name in [n for n in os.listdir(out) if n.endswith(".json")]:
        with open(os.path.join(out, name)) as f:
            records[name[:-5]] = json.load(f)
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--size", default="2x128", help="throughput model: LAYERSxWIDTH")
    p.add_argument("--heal-size", default="4x256", help="healing model: LAYERSxWIDTH")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        worker()
        return
    from _launch import emit

    layers, width = (int(v) for v in args.size.split("x"))
    lines = [f"# Replica groups under torchft ({datetime.date.today()}, `python benchmarks/bench_ft.py "
             f"--rounds {args.rounds} --steps {args.steps}`)", "",
             f"GPT {layers} layers x {width} wide, stage 2, fp32, 4 ranks as 2 replicas x 2 shards on this "
             "machine's loopback (gloo). `mesh`: a 2-D DeviceMesh, one job, no torchft. `torchft`: 2 replica "
             "groups of 2 ranks, a quorum and a commit vote each step. Steps per second of rank 0 over "
             f"{args.steps} steps after 5 warm-up steps; the two alternate.", "",
             "| round | mesh steps/s | torchft steps/s | torchft / mesh |", "|---:|---:|---:|---:|"]
    for r in range(args.rounds):
        got = {kind: run_config(kind, args, layers, width) for kind in ("mesh", "torchft")}
        if any(isinstance(v, str) for v in got.values()):
            lines.append(f"| {r + 1} | {got['mesh'] if isinstance(got['mesh'], str) else 'ok'} | "
                         f"{got['torchft'] if isinstance(got['torchft'], str) else 'ok'} | failed |")
            print(lines[-1], file=sys.stderr, flush=True)
            continue
        mesh = got["mesh"]["mesh-g0-r0"]["steps_per_second"]  # type: ignore[index]
        ft = got["torchft"]["torchft-g0-r0"]["steps_per_second"]  # type: ignore[index]
        lines.append(f"| {r + 1} | {mesh:.1f} | {ft:.1f} | {ft / mesh:.2f}x |")
        print(lines[-1], file=sys.stderr, flush=True)
    layers, width = (int(v) for v in args.heal_size.split("x"))
    healed = run_config("heal", args, layers, width)
    lines += ["", f"Healing: GPT {layers} layers x {width} wide; group 1 starts once group 0 took 3 steps alone, "
              "and heals from it at its first step.", ""]
    if isinstance(healed, str):
        lines.append(f"healing run failed: {healed}")
    else:
        lines += ["| rank | parameters | bytes received | weights + whole optimizer state | heal step s | "
                  "steady step s |", "|---:|---:|---:|---:|---:|---:|"]
        for r in range(2):
            rec = healed.get(f"heal-g1-r{r}")
            if rec is None or rec.get("heal_seconds") is None:
                lines.append(f"| {r} | | no heal seen | | | |")
                continue
            whole = rec["params"] * (4 + 12)
            lines.append(f"| {r} | {rec['params']:,} | {rec['heal_bytes']:,} ({rec['heal_bytes'] / whole:.0%}) | "
                         f"{whole:,} | {rec['heal_seconds']:.2f} | {rec['steady_seconds']:.3f} |")
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
