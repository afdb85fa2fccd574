"""Update-kernel throughput on one flat shard, next to torch's own AdamW paths and the memory bound.

    python benchmarks/bench_kernels.py                      # 32M elements, 1 thread (one rank's view)
    python benchmarks/bench_kernels.py --numel 8e6 --threads 2

Every path is first checked against the eager reference on the same inputs, then timed (median of
--repeats after a warm-up). Melem/s counts elements of the shard updated per second; "% of bound"
compares with the memory bound measured beside each row (see ``Bound``): the bandwidth of this
machine (bytes read + written per second by a large copy, a triad or a compiled streaming kernel,
whichever is fastest), the higher of the probes just before and just after the row, divided by the
bytes the path must read + write per element. "in-cache ms" times the same path on shards small
enough to stay in this core's L2 cache (the slope between 8K and 32K elements, so the fixed cost of
a call drops out), scaled to the row's elements: its arithmetic with the memory traffic taken out.
Where it is above the bound's time ("bound ms"), the row is compute-bound on this core and no
scheduling of memory can bring it to the bound; "limit" says which of the two is higher (CPU only).
The torch rows are what a careful mixed-precision trainer writes: a persistent fp32 gradient
buffer the 16-bit gradient is copied into, torch.optim.AdamW(fused=True) (or foreach) on the fp32
master, and a copy_ back into the 16-bit weight. ``--moments`` adds a table of every master-weight
mode with each moments mode (bf16 weights). Results go to stdout and benchmarks/results/kernels.md.
"""
from __future__ import annotations

import datetime
import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from shardopt.core._layout import Range  # noqa: E402
from shardopt.kernels import codecs, make_scalars, select  # noqa: E402
from shardopt.moments import make_moments  # noqa: E402

HP = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


DEVICE = torch.device("cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    fn()  # warm-up (compiles the fused path)
    fn()
    times = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class Bound:
    """The memory bound, measured again beside every row: bytes read + written per second, the
    best of a large fp32 copy, a triad c = a + s * b, and a compiled streaming kernel that reads
    three arrays and writes two (the code generator of the fused update, doing the least possible
    arithmetic). This machine's bandwidth drifts by 2x within minutes (a shared host), so one probe
    at the start made rows run later read above 100%; each row is compared with the higher of the
    probes taken just before and just after it (:meth:`measure` returns that), and ``seen`` keeps
    every probe for the header."""

    def __init__(self, numel: int, repeats: int) -> None:
        self.n, self.repeats, self.seen = numel, max(3, repeats), []
        self.a, self.b, self.c = (torch.randn(numel, device=DEVICE) for _ in range(3))

        def stream(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> None:
            x.copy_(x * 0.5 + y)
            z.copy_(z * 0.5 + y)

        self.stream = torch.compile(stream, fullgraph=True)

    def measure(self) -> float:
        a, b, c, n = self.a, self.b, self.c, self.n
        copy = 2 * 4 * n / timed(lambda: c.copy_(a), self.repeats)
        triad = 3 * 4 * n / timed(lambda: torch.add(a, b, alpha=0.5, out=c), self.repeats)
        streamed = 5 * 4 * n / timed(lambda: self.stream(a, b, c), self.repeats)
        self.seen.append(max(copy, triad, streamed))
        return max(self.seen[-2:])

    def header(self) -> str:
        lo, hi = min(self.seen) / 1e9, max(self.seen) / 1e9
        return (f"memory bandwidth {lo:.1f}-{hi:.1f} GB/s over {len(self.seen)} probes (read+write, best of copy, "
                "triad and a compiled stream, probed between rows)")


IN_CACHE = (8192, 32768)  # elements: both sizes' state (at most 28 bytes per element) fits a 1 MB L2


def in_cache(make, calls: int = 100, repeats: int = 9) -> float:
    """Seconds per element of the path ``make(n)`` builds, with its state resident in cache: for
    each size of ``IN_CACHE`` the best of ``repeats`` batches of ``calls`` calls (the two sizes'
    batches interleaved, so a drift of the host's speed hits both), then the difference over the
    difference in elements (a call's fixed cost cancels). CPU only."""
    fns = [make(n) for n in IN_CACHE]
    for fn in fns:
        for _ in range(3):  # compile (a new shape) and warm up
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t) / calls)
    return max(best[1] - best[0], 0.0) / (IN_CACHE[1] - IN_CACHE[0])


def measure(make, n: int, repeats: int, bound: Bound, arith: bool = True) -> tuple[float, float, float | None]:
    """The path ``make(n)`` builds, timed: (seconds per call, the bandwidth probed beside it in
    bytes/s, its :func:`in_cache` seconds per element, or None off the CPU or without ``arith``)."""
    t = timed(make(n), repeats)
    return t, bound.measure(), in_cache(make) if arith and DEVICE.type == "cpu" else None


def speed(n: int, t: float, by: float, bw: float) -> str:
    """The "ms/step | Melem/s | bytes/elem | bound GB/s | % of bound" cells of a row: ``n`` elements
    in ``t`` seconds, ``by`` bytes per element, ``bw`` bytes/s."""
    rate = n / t
    return f"{t * 1e3:.1f} | {rate / 1e6:,.0f} | {by:g} | {bw / 1e9:.1f} | {100 * rate * by / bw:.0f}%"


def limits(n: int, bw: float, by: float, per_elem: float | None) -> str:
    """The "in-cache ms | bound ms | limit" cells of a row of ``n`` elements: ``bw`` bytes/s, ``by``
    bytes per element, ``per_elem`` from :func:`in_cache` (None: not measured)."""
    bound = n * by / bw
    if per_elem is None:
        return f"n/a | {bound * 1e3:.1f} | n/a"
    arith = per_elem * n
    return f"{arith * 1e3:.1f} | {bound * 1e3:.1f} | {'compute' if arith > bound else 'memory'}"


def make_state(n: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=g) * 0.02
    st = {"master": master, "param": master.to(dtype), "grad": (torch.randn(n, generator=g) * 1e-3).to(dtype),
          "m": torch.randn(n, generator=g).abs() * 1e-4, "v": torch.randn(n, generator=g).abs() * 1e-8,
          "rem": torch.zeros(n, dtype=torch.int16)}
    return {k: v.to(DEVICE) for k, v in st.items()}


def shardopt_path(kernels, mode: str, st: dict, dtype: torch.dtype, moments: str = "fp32"):
    s = make_scalars(**HP, step=10, grad_scale=1.0, device=DEVICE)
    if mode == "remainder":  # as RemainderMaster keeps it: two int8 planes (see codecs.split_remainder_)
        st["param"], rem = (codecs.encode_bf16 if dtype == torch.bfloat16 else codecs.encode_fp16)(st["master"])
        st["rem"] = (torch.empty_like(rem, dtype=torch.int8), torch.empty_like(rem, dtype=torch.int8))
        codecs.split_remainder_(st["rem"], rem.to(torch.int32))
    rkey = codecs.make_key(0, 10, 0, DEVICE)
    out = st["param"] if dtype != torch.float32 else None
    held, key = None, None
    if moments != "fp32":
        held = make_moments(moments, st["m"].numel(), DEVICE)
        held.load_(st["m"], st["v"])
        st["moments"] = held
        key = rkey
    whole = Range(0, st["m"].numel())

    def mom():  # the moments' operands, after the pass an 8-bit step makes first (timed with the step)
        return (st["m"], st["v"]) if held is None else held.prepare(whole, st["grad"], s, kernels)

    return {
        "fp32": lambda: kernels.step_fp32(st["master"], st["grad"], *mom(), s, out, key),
        "remainder": lambda: kernels.step_remainder(st["param"], st["rem"], st["grad"], *mom(), s, key),
        "stochastic": lambda: kernels.step_stochastic(st["param"], st["grad"], *mom(), s, rkey),
        "none": lambda: kernels.step_none(st["param"], st["grad"], *mom(), s, key),
    }[mode]


def torch_path(kind: str, st: dict, dtype: torch.dtype, optimizer=None):  # noqa: ANN001 - a torch.optim class
    """torch.optim.AdamW (or ``optimizer``, built as ``optimizer(params, **hyperparameters)``) on
    the fp32 master; 16-bit: the gradient copied into a persistent fp32 buffer first (as it needs
    fp32), the result copied back into the 16-bit weight."""
    p = torch.nn.Parameter(st["master"])
    hp = dict(lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"])
    opt = optimizer([p], **hp) if optimizer is not None else \
        torch.optim.AdamW([p], **hp, fused=kind == "fused", foreach=kind == "foreach")
    g32 = st["grad"].float()
    p.grad = g32

    def run() -> None:
        if dtype != torch.float32:
            g32.copy_(st["grad"])
        opt.step()
        if dtype != torch.float32:
            st["param"].copy_(p.detach())

    return run


# Bytes the moments move per element (read + write both): fp32, bf16, 8-bit codes plus block scales.
MOMENT_RW = {"fp32": 16.0, "bf16": 8.0, "8bit": 4.0 + 4 * 4 / 64}


# Bytes each path must move per element (read + write): master/params, moments, gradient, 16-bit copy.
def bytes_per_elem(path: str, dtype: torch.dtype, moments: str = "fp32") -> float:
    g = torch.empty((), dtype=dtype).element_size()
    mom = MOMENT_RW[moments]
    if path in ("fp32", "reference") or path.startswith("torch"):
        base = 8 + mom + g  # master r/w, moments r/w, grad r
        extra = 2 if dtype != torch.float32 else 0  # write the 16-bit weight
        if path.startswith("torch") and dtype != torch.float32:
            extra += 2 + 4 + 4  # grad copied into the fp32 buffer (r 2, w 4), weight copied back (r 4)
        return base + extra
    if path == "remainder":
        return mom + g + 2 * 2 + 2 * 2  # moments, grad, weight r/w, remainder r/w
    return mom + g + 2 * 2  # stochastic / none: moments, grad, weight r/w


def validate(dtype: torch.dtype) -> list[str]:
    """Each shardopt path (fused) against the reference on 100k elements: fp32 close, 16-bit within one ulp."""
    notes = []
    for mode in (["fp32"] if dtype == torch.float32 else ["fp32", "remainder", "stochastic", "none"]):
        a, b = make_state(100_003, dtype), make_state(100_003, dtype)
        shardopt_path(select("reference"), mode, a, dtype)()
        shardopt_path(select("fused"), mode, b, dtype)()
        if dtype != torch.float32:
            ia, ib = a["param"].view(torch.int16).int(), b["param"].view(torch.int16).int()
            worst = int((ia - ib).abs().max())
            assert worst <= 1, f"{mode} {dtype}: fused differs from reference by {worst} ulps"
        assert torch.allclose(a["master"], b["master"], rtol=1e-6, atol=1e-7), f"{mode} {dtype}: master differs"
        notes.append(mode)
    return notes


def moments_table(n: int, bound: Bound, repeats: int, kinds: list[str]) -> str:
    """Every master mode with each moments mode, bf16 weights, fused; each checked first."""
    rows = ["| moments | master | ms/step | Melem/s | bytes/elem | bound GB/s (probes beside) | % of bound | "
            "in-cache ms | bound ms | limit |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    dtype, n = torch.bfloat16, n - n % 64  # whole 8-bit blocks
    for moments in kinds:
        for mode in ("fp32", "remainder", "stochastic", "none"):
            a, b = make_state(100_032, dtype), make_state(100_032, dtype)
            shardopt_path(select("reference"), mode, a, dtype, moments)()
            shardopt_path(select("fused"), mode, b, dtype, moments)()
            worst = int((a["param"].view(torch.int16).int() - b["param"].view(torch.int16).int()).abs().max())
            assert worst <= 1, f"{mode}/{moments}: fused weights differ from the reference by {worst} ulps"
            def make(k: int, mode: str = mode, moments: str = moments):
                return shardopt_path(select("fused"), mode, make_state(k, dtype), dtype, moments)

            t, bw, arith = measure(make, n, repeats, bound)
            by = bytes_per_elem(mode, dtype, moments)
            rows.append(f"| {moments} | {mode} | {speed(n, t, by, bw)} | {limits(n, bw, by, arith)} |")
            print(rows[-1], flush=True)
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=float, default=32e6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--moments", nargs="*", default=["fp32", "bf16", "8bit"],
                    help="moments modes of the second table (none: skip it)")
    ap.add_argument("--out", default="", help="results file (default benchmarks/results/kernels[_cuda].md)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    torch.set_num_threads(args.threads)
    n = int(args.numel)
    bound = Bound(n, args.repeats)
    bound.measure()
    where = torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else \
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} thread(s)"
    machine = f"machine: {where} | torch {torch.__version__} | shard {n:,} elements | {datetime.date.today().isoformat()}"
    print(f"{machine} | first bandwidth probe {bound.seen[0] / 1e9:.1f} GB/s", flush=True)
    rows = ["| param dtype | path | ms/step | Melem/s | bytes/elem | bound GB/s (probes beside) | % of bound | "
            "vs torch fused+cast | in-cache ms | bound ms | limit |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        validate(dtype)
        results = {}
        modes = ["fp32"] if dtype == torch.float32 else ["fp32", "remainder", "stochastic", "none"]
        def fused_path(mode: str):
            return lambda k: shardopt_path(select("fused"), mode, make_state(k, dtype), dtype)

        paths = [(f"shardopt {m} (fused)", fused_path(m), m) for m in modes]
        paths.append(("shardopt fp32 (eager reference)",
                      lambda k: shardopt_path(select("reference"), "fp32", make_state(k, dtype), dtype), "reference"))
        cast = "" if dtype == torch.float32 else " + cast"
        paths += [(f"torch AdamW fused{cast}", lambda k: torch_path("fused", make_state(k, dtype), dtype), "torch"),
                  (f"torch AdamW foreach{cast}", lambda k: torch_path("foreach", make_state(k, dtype), dtype), "torch")]
        for name, make, kind in paths:
            results[name] = (kind, *measure(make, n, args.repeats, bound, arith=kind != "reference"))
            print(f"  {str(dtype)[6:]:>8} {name:<34} {results[name][1] * 1e3:8.1f} ms "
                  f"(bound probed beside: {results[name][2] / 1e9:.1f} GB/s)", flush=True)
        base = results[f"torch AdamW fused{cast}"][1]
        for name, (kind, t, bw, arith) in results.items():
            b = bytes_per_elem(kind, dtype)
            rows.append(f"| {str(dtype)[6:]} | {name} | {speed(n, t, b, bw)} | {base / t:.2f}x | "
                        f"{limits(n, bw, b, arith)} |")
    table = "\n".join(rows)
    print("\n" + table)
    if args.moments:
        print("\nmoments modes (bf16 weights, fused):", flush=True)
        table += ("\n\n## Moments modes, bf16 weights (fused)\n\n" + moments_table(n, bound, args.repeats, args.moments))
    header = f"{machine} | {bound.header()}"
    args.out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        "kernels_cuda.md" if DEVICE.type == "cuda" else "kernels.md")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(f"# Update kernels\n\nCommand: `python benchmarks/bench_kernels.py --numel {args.numel:g} --threads "
                f"{args.threads} --device {args.device} --moments {' '.join(args.moments)}`\n\n{header}\n\n{table}\n\n% of bound: elements per second divided by (the higher bandwidth of the "
                "probes just before and just after the row / the bytes the path moves per element). in-cache ms: the path's "
                "time per element with its state in L2 (the slope between "
                f"{IN_CACHE[0]:,} and {IN_CACHE[1]:,} elements), times the row's elements; bound ms: the row's bytes "
                "at the probed bandwidth; limit: the higher of the two. Every fused path was checked against the "
                "eager reference first.\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
