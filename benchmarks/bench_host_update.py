"""The host update of ``offload="cpu"`` next to the best host AdamW updates, per thread count.

    python benchmarks/bench_host_update.py                         # 16M elements, 1 and 2 threads
    python benchmarks/bench_host_update.py --numel 4e6 --threads 1 2 --rounds 9

With ``offload="cpu"`` every bucket of the shard is updated on the host by shardopt's fused CPU
kernel, from the gradient's host copy (in the gradient's dtype) into the host master, moments and
the host copy of the 16-bit weights; the shardopt rows hold their state in an offload host buffer
(``update._offload.HostBuffer``) as offload does (the remainder planes excepted). Its peers, each as a careful user runs it on host-resident
state:

- ``torch.optim.AdamW(fused=True)`` on the CPU, on an fp32 master; with 16-bit weights the
  gradient is first copied into a persistent fp32 buffer and the result ``copy_``-ed back;
- DeepSpeed's ``DeepSpeedCPUAdam`` (``deepspeed==0.19.8``, its AVX C++ Adam, built once), the
  same way, as ZeRO-Offload runs it (skipped with a note when deepspeed is not installed).

Each thread count runs in its own worker process (``OMP_NUM_THREADS`` is read at start-up by the
compiled kernels and by DeepSpeed's OpenMP loop); a worker that fails or runs past ``--timeout``
is reported and the driver moves on. Inside a worker the paths are timed in alternating rounds
(each round: every path once, median of ``--repeats`` calls), with the memory bandwidth probed in
every round (bench_kernels.Bound: the best of a copy, a triad and a compiled stream); the table
gives the median over rounds, and "% of bound" divides the elements per second by (the highest
probe / 28 bytes per element), the least that AdamW with an fp32 master must read and write
(master 4 + 4, moments 8 + 8, gradient 4). Results go to stdout and
benchmarks/results/host_update.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ADAMW_BYTES = 28  # bytes per element AdamW with an fp32 master must move at least


def worker(numel: int, rounds: int, repeats: int) -> dict:
    import torch

    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(HERE, ".."))
    from bench_kernels import Bound, make_state, shardopt_path, timed, torch_path  # noqa: E402
    from shardopt.kernels import select  # noqa: E402
    from shardopt.update._offload import HostBuffer  # noqa: E402

    def host_state(n: int, dtype: torch.dtype) -> dict:
        """make_state's tensors moved into one offload host buffer, as offload="cpu" holds them."""
        st = make_state(n, dtype)
        buffer = HostBuffer(sum(t.numel() * t.element_size() + 64 for t in st.values()), pin=False)
        return {k: buffer.take(t.numel(), t.dtype).copy_(t) for k, t in st.items()}

    def deepspeed_path(st: dict, dtype: torch.dtype):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return torch_path("deepspeed", st, dtype, lambda params, **hp: DeepSpeedCPUAdam(params, adamw_mode=True, **hp))

    paths = {}
    notes = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype)[6:]
        cast = "" if dtype == torch.float32 else " + cast"
        paths[f"{name}|shardopt host kernel, fp32 master"] = shardopt_path(
            select("fused"), "fp32", host_state(numel, dtype), dtype)
        if dtype != torch.float32:
            paths[f"{name}|shardopt host kernel, remainder master"] = shardopt_path(
                select("fused"), "remainder", host_state(numel, dtype), dtype)
        paths[f"{name}|torch AdamW(fused=True){cast}"] = torch_path("fused", make_state(numel, dtype), dtype)
        try:
            paths[f"{name}|DeepSpeedCPUAdam{cast}"] = deepspeed_path(make_state(numel, dtype), dtype)
        except Exception as e:  # noqa: BLE001 - an optional peer: say why it is missing
            notes.append(f"DeepSpeedCPUAdam ({name}): not run: {type(e).__name__}: {str(e)[:120]}")
    bound = Bound(numel, repeats)
    for fn in paths.values():  # compile and warm up every path before the first round
        fn()
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(rounds):
        bound.measure()
        for k, fn in paths.items():
            times[k].append(timed(fn, repeats))
    bound.measure()
    return {"threads": torch.get_num_threads(), "bandwidth": max(bound.seen), "bandwidth_min": min(bound.seen),
            "times": {k: statistics.median(v) for k, v in times.items()},
            "spread": {k: (min(v), max(v)) for k, v in times.items()}, "notes": notes}


def run_worker(threads: int, args: argparse.Namespace) -> dict | str:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--numel", str(args.numel),
           "--rounds", str(args.rounds), "--repeats", str(args.repeats)]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {args.timeout:g} s"
    if done.returncode != 0:
        return f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}"
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    print(f"  {threads} thread(s): {time.perf_counter() - start:.0f} s", flush=True)
    return json.loads(line[len("RESULT "):])


def table(results: dict[int, dict | str], numel: int) -> str:
    rows = ["| threads | weights | path | ms/step (min-max over rounds) | Melem/s | vs torch fused | vs DeepSpeed | "
            "% of bound (28 B/elem) |", "|---:|---|---|---:|---:|---:|---:|---:|"]
    for threads, res in results.items():
        if isinstance(res, str):
            rows.append(f"| {threads} | - | {res} | | | | | |")
            continue
        bw = res["bandwidth"]
        for key, t in res["times"].items():
            dtype, path = key.split("|")
            cast = "" if dtype == "float32" else " + cast"
            ref = res["times"].get(f"{dtype}|torch AdamW(fused=True){cast}")
            ds = res["times"].get(f"{dtype}|DeepSpeedCPUAdam{cast}")
            lo, hi = res["spread"][key]
            rate = numel / t
            rows.append(f"| {threads} | {dtype} | {path} | {t * 1e3:.1f} ({lo * 1e3:.1f}-{hi * 1e3:.1f}) | "
                        f"{rate / 1e6:,.0f} | {ref / t if ref else float('nan'):.2f}x | "
                        f"{ds / t if ds else float('nan'):.2f}x | {100 * rate * ADAMW_BYTES / bw:.0f}% |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=float, default=16e6, help="elements of the shard")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds; the table gives the median")
    ap.add_argument("--repeats", type=int, default=5, help="calls per path per round (their median)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one thread count may take")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "host_update.md"))
    args = ap.parse_args()
    n = int(args.numel)
    if args.worker:
        print("RESULT " + json.dumps(worker(n, args.rounds, args.repeats)), flush=True)
        return
    import torch

    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores | torch {torch.__version__} | "
               f"shard {n:,} elements | {datetime.date.today().isoformat()}")
    print(machine, flush=True)
    results = {t: run_worker(t, args) for t in args.threads}
    out = table(results, n)
    bws = [f"{t} thread(s): {r['bandwidth_min'] / 1e9:.1f}-{r['bandwidth'] / 1e9:.1f} GB/s"
           for t, r in results.items() if isinstance(r, dict)]
    notes = sorted({x for r in results.values() if isinstance(r, dict) for x in r["notes"]})
    text = (f"# Host update (offload=\"cpu\")\n\nCommand: `python benchmarks/bench_host_update.py --numel {args.numel:g} "
            f"--threads {' '.join(map(str, args.threads))} --rounds {args.rounds} --repeats {args.repeats}`\n\n"
            f"machine: {machine}\n\nmemory bandwidth probed in the same run (read+write, best of copy, triad and a "
            f"compiled stream): {'; '.join(bws)}\n\n{out}\n\n"
            "shardopt host kernel: the fused CPU kernel offload runs per bucket (gradient read in the weights' "
            "dtype; with 16-bit weights it also writes the 16-bit weight copy). torch / DeepSpeed rows: the step on "
            "an fp32 master; `+ cast`: the 16-bit gradient copied into a persistent fp32 buffer first and the "
            "result copied into the 16-bit weight after, both timed. % of bound: elements/s x 28 B / the highest "
            "bandwidth probe of the worker.\n" + "".join(f"\n- {x}" for x in notes))
    print("\n" + out)
    for x in notes:
        print(x)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
