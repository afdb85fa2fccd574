"""One control message, as shardopt sends it (an exchange) and as a gloo all-reduce (a ring), by ranks.

    python benchmarks/bench_messages.py                        # ~1 min on 2 CPU cores
    python benchmarks/bench_messages.py --ranks 2,4,8,16 --repeats 300

shardopt's ranks agree through small messages on a gloo group of its own (round tags, the clip's
and the step's messages: ``comm._messages.StepMessage``, 39 fp32 numbers; comm._control [Note: a
message is an exchange]). Each is one collective. gloo's all-reduce runs its ring: 2 (N - 1) hops
one after the other, whatever the size; shardopt's exchange is one all-to-all (each rank sends its
numbers to every rank, then combines the N rows in rank order): one hop, N - 1 small sends per rank.
For each number of ranks, one ``torchrun`` launch on this machine's loopback times, alternating
in the same processes, ``--repeats`` messages of each kind after a warm-up:

* ``all-reduce``: ``ProcessGroupGloo.allreduce`` of the message on a gloo group (SUM, with the
  message's deadline as gloo's timeout): how the messages travelled before;
* ``exchange``: ``Comm.control_all_reduce`` of the same message, as the optimizer sends it
  (the all-to-all, its combination on the host, the deadline).

Median microseconds per message on rank 0, and the ratio. On one machine the hops are loopback
copies and N ranks share its cores (16 ranks on 2 cores are mostly waiting for a core), so the
numbers show how each grows with N here, not across hosts; docs/design.md has the arithmetic for
a cluster. A launch that fails or outlives ``--timeout`` is reported as such and the driver goes on.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def worker(repeats: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from shardopt.comm._collectives import Comm
    from shardopt.comm._messages import StepMessage

    comm = Comm(None)  # its control group: a gloo group of every rank
    ring = dist.new_group(backend="gloo")
    message = torch.arange(StepMessage.NUMEL, dtype=torch.float32) + dist.get_rank()

    def all_reduce() -> None:
        opts = dist.AllreduceOptions()
        opts.timeout = datetime.timedelta(seconds=60)
        ring.allreduce([message.clone()], opts).wait()

    def exchange() -> None:
        comm.control_all_reduce(message.clone(), deadline=60).wait()

    times: dict[str, list[float]] = {"all-reduce": [], "exchange": []}
    for _ in range(20):  # warm-up: connections, allocations
        all_reduce()
        exchange()
    for i in range(repeats):
        for name, fn in ((("all-reduce", all_reduce), ("exchange", exchange)) if i % 2 == 0
                         else (("exchange", exchange), ("all-reduce", all_reduce))):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print(json.dumps({k: statistics.median(v) * 1e6 for k, v in times.items()}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", default="2,4,8,16")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--timeout", type=int, default=300, help="seconds for one launch")
    ap.add_argument("--out", default="", help="write the table to this file too")
    args = ap.parse_args()
    if args.worker:
        worker(args.repeats)
        return
    from _launch import emit, run

    lines = ["| ranks | all-reduce us | exchange us | exchange / all-reduce |", "|---:|---:|---:|---:|"]
    for n in (int(r) for r in args.ranks.split(",")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", __file__,
               "--worker", "--repeats", str(args.repeats)]
        code, out, err = run(cmd, timeout=args.timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
        got = next((json.loads(line) for line in reversed(out.splitlines()) if line.startswith("{")), None)
        if code is None or code != 0 or got is None:
            last = err.strip().splitlines()[-1][:120] if err.strip() else ""
            why = f"timed out after {args.timeout} s" if code is None else f"failed (exit {code}) {last}"
            lines.append(f"| {n} | {why} | - | - |")
        else:
            lines.append(f"| {n} | {got['all-reduce']:.0f} | {got['exchange']:.0f} | "
                         f"{got['exchange'] / got['all-reduce']:.2f}x |")
        print(lines[-1], file=sys.stderr, flush=True)
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
