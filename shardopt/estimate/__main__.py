"""Memory per rank before you rent a cluster: ``python -m shardopt.estimate``.

    python -m shardopt.estimate --params 7e9 --world-size 64
    python -m shardopt.estimate --params 7e9 --world-size 64 --stage 2 --master-weights remainder --detail
    python -m shardopt.estimate --params 1.5B 7B 70B --world-size 8 64 1024 --largest-param 262e6 --compact
    python -m shardopt.estimate --params 7B --world-size 64 1024 --shard-size 8 --stage 2 --master-weights remainder

Prints, for each parameter count and world size, the bytes one rank holds under DDP + AdamW and
under each ShardedAdamW stage and master-weight mode, the bytes each rank sends per step, and
the floor that puts on the step time at the given per-rank bandwidth. ``--compact`` prints one
row per (parameters, world size) instead, for projection tables. ``--shard-size S`` adds hybrid
sharding (``world_size / S`` replicas of S ranks) beside flat sharding, with the bytes sent inside
the shard group and across replicas, and the ring steps that cross nodes of ``--gpus-per-node``.
"""
from __future__ import annotations

import argparse
import re
import sys

from shardopt.estimate import BACKENDS, DTYPES, MemoryEstimate, estimate_memory
from shardopt.update._master import STRATEGIES
from shardopt.update._moments import MOMENTS

GIB = 2.0**30
_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> int:
    """``7e9``, ``7B``, ``1.5b``, ``350M`` or ``1000`` as an integer count."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (try 7e9, 7B or 350M)")
    return round(float(m.group(1)) * _SUFFIX[m.group(2)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m shardopt.estimate", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Categories and the staging and communication models: shardopt/estimate/__init__.py")
    p.add_argument("--params", type=parse_count, nargs="+", required=True, help="trainable parameters (7e9, 7B)")
    p.add_argument("--world-size", type=int, nargs="+", required=True, help="data-parallel ranks")
    p.add_argument("--stage", type=int, nargs="+", choices=(1, 2), default=[1, 2])
    p.add_argument("--master-weights", nargs="+", choices=sorted(STRATEGIES),
                   default=["fp32", "remainder", "stochastic", "none"])
    p.add_argument("--moments", choices=sorted(MOMENTS), default="fp32",
                   help="how the Adam moments are stored (ShardedAdamW's moments=)")
    p.add_argument("--amsgrad", action="store_true",
                   help="amsgrad=True: exp_avg_sq's running maximum too (fp32 or bf16 moments)")
    p.add_argument("--param-dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="MiB, as in ShardedAdamW")
    p.add_argument("--backend", choices=BACKENDS, default="nccl", help="collectives whose buffers to count")
    p.add_argument("--largest-param", type=parse_count, default=None,
                   help="elements of the largest parameter tensor (e.g. the embedding); sizes the staging buckets")
    p.add_argument("--bandwidth", type=float, default=50.0,
                   help="GB/s each rank can send (1e9 bytes/s); 50 = one 400 Gb/s NIC per GPU")
    p.add_argument("--gpu-memory", type=float, default=None, help="GiB per device; marks what does not fit")
    p.add_argument("--shard-size", type=int, default=None,
                   help="hybrid sharding: shard over S ranks (typically one node), replicate across world_size / S")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node, for the ring steps that cross nodes")
    p.add_argument("--offload", action="store_true",
                   help="offload='cpu': master weights and moments in host memory; adds a host column, and "
                        "the totals count the accelerator")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per model: each rank holds 1/TP of each (split) matrix")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages: each rank holds one stage, 1/PP of the layers")
    p.add_argument("--detail", action="store_true", help="also print every category of each estimate")
    p.add_argument("--compact", action="store_true", help="one row per (parameters, world size)")
    args = p.parse_args(argv)
    if args.tp < 1 or args.pp < 1:
        p.error(f"--tp and --pp must be >= 1, got --tp {args.tp} --pp {args.pp}")
    if args.amsgrad and args.moments == "8bit":
        p.error("--amsgrad keeps exp_avg_sq's running maximum, which --moments 8bit cannot store; use fp32 or bf16")
    return args


def _fmt_gib(nbytes: float, limit: float | None) -> str:
    mark = "*" if limit is not None and nbytes > limit * GIB else ""
    return f"{nbytes / GIB:,.2f}{mark}"


def _markdown(rows: list[list[str]]) -> str:
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, width))) + " |"
           for r in rows]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in width) + "|")
    return "\n".join(out)


def _part(n: float, args: argparse.Namespace) -> float:
    """Parameters one rank holds of an ``n``-parameter model split over ``--tp`` x ``--pp`` ranks."""
    return n / (args.tp * args.pp)


def _split_note(args: argparse.Namespace) -> str:
    if args.tp == 1 and args.pp == 1:
        return ""
    return (f"; split over --tp {args.tp} x --pp {args.pp}: each rank holds its part, 1/{args.tp * args.pp} of the "
            f"parameters (its tensor-parallel shard of its pipeline stage; LayerNorms and biases that every "
            f"tensor-parallel rank keeps whole add a little), and 1/(data-parallel ranks) of that part's optimizer "
            f"state; a job of W data-parallel ranks uses W x {args.tp * args.pp} devices")


def scheme_table(n: float, world: int, args: argparse.Namespace) -> tuple[str, list[MemoryEstimate]]:
    """Rows DDP + AdamW and each (stage, mode); bytes on one rank and bytes sent per step."""
    whole, n = n, _part(n, args)
    kw = dict(param_dtype=args.param_dtype, bucket_cap_mb=args.bucket_cap_mb, largest_param=args.largest_param,
              backend=args.backend, moments=args.moments, offload="cpu" if args.offload else None,
              amsgrad=args.amsgrad)
    shards = [None] + ([args.shard_size] if args.shard_size and args.shard_size != world else [])
    ests = [estimate_memory(n, world, s, m, shard_size=sh, **kw) for s in args.stage for m in args.master_weights
            for sh in shards]
    hybrid = len(shards) > 1
    head = ["scheme", "params", "grads", "master", "moments", "extra", "buffers", "total GiB", "B/param",
            "sent/step GB", f"floor @{args.bandwidth:g} GB/s"]
    if args.offload:  # the state moves to the host: the totals are the accelerator's
        head[7:9] = ["accelerator GiB", "B/param", "host GiB"]
    if hybrid:
        head += ["in rings across nodes GB", f"inter-node ring steps ({args.gpus_per_node}/node)"]
    rows = [head]
    first = ests[0]
    d = first.ddp
    rows.append(["DDP + AdamW"] + [_fmt_gib(v, None) for v in (d["params"], d["grads"], d["master"],
                                                                d["exp_avg"] + d["exp_avg_sq"], d["extra"], d["buffers"])]
                + [_fmt_gib(first.ddp_total, args.gpu_memory), f"{first.ddp_total / n:.2f}"]
                + (["0.00"] if args.offload else []) + [
                   f"{first.ddp_comm / 1e9:,.2f}", f"{first.ddp_comm / (args.bandwidth * 1e9):.3f} s"]
                + (["-", "-"] if hybrid else []))
    for e in ests:
        layout = f", {e.replicas}x{e.shard_size} hybrid" if e.shard_size != e.world_size else (", flat" if hybrid else "")
        rows.append([f"stage {e.stage}, {e.master_weights}" + (f", {e.moments} moments" if e.moments != "fp32" else "")
                     + (", amsgrad" if args.amsgrad else "")
                     + layout + (", offload='cpu'" if e.offload else "")]
                    + [_fmt_gib(v, None) for v in (e.params, e.grads, e.master, e.exp_avg + e.exp_avg_sq,
                                                   e.extra, e.buffers)]
                    + [_fmt_gib(e.accelerator, args.gpu_memory), f"{e.accelerator / n:.2f}"]
                    + ([_fmt_gib(e.host, None)] if args.offload else []) + [f"{e.comm_bytes / 1e9:,.2f}",
                       f"{e.comm_seconds(args.bandwidth):.3f} s"]
                    + ([f"{_across(e, args.gpus_per_node) / 1e9:,.2f}", f"{e.ring_hops(args.gpus_per_node)[1]:,}"]
                       if hybrid else []))
    title = (f"{whole:,} parameters ({args.param_dtype} weights), {world} ranks: GiB (2^30 bytes) on each rank; "
             f"sent/step = bytes each rank sends per step (ring algorithms)" + _split_note(args))
    if hybrid:
        title += (f"; in rings across nodes = bytes each rank sends in ring collectives whose ranks sit on "
                  f"several nodes of {args.gpus_per_node} (flat: all of them; hybrid: the cross-replica all-reduce); "
                  "inter-node ring steps = steps of such rings per training step, each at least one network latency")
    return title + "\n" + _markdown(rows), ests


def compact_table(args: argparse.Namespace) -> str:
    """One row per (parameters, world size): total GiB per rank for each scheme (on the accelerator
    with ``--offload``), traffic and floor."""
    kw = dict(param_dtype=args.param_dtype, bucket_cap_mb=args.bucket_cap_mb, largest_param=args.largest_param,
              backend=args.backend, moments=args.moments, offload="cpu" if args.offload else None,
              amsgrad=args.amsgrad)
    modes = list(dict.fromkeys("stochastic/none" if m in ("stochastic", "none") else m for m in args.master_weights))
    schemes = [(s, m) for s in args.stage for m in modes]
    if args.shard_size:
        return _compact_hybrid(args, kw, schemes)
    mom = ("" if args.moments == "fp32" else f" ({args.moments} moments)") + (", offload" if args.offload else "") \
        + (", amsgrad" if args.amsgrad else "")
    head = ["params", "GPUs", "DDP + AdamW"] + [f"S{s} {m}{mom}" for s, m in schemes]
    head += [f"sent/step GB (DDP, {', '.join(f'S{s}' for s in args.stage)})",
             f"floor @{args.bandwidth:g} GB/s (DDP, {', '.join(f'S{s}' for s in args.stage)})"]
    rows = [head]
    for n in args.params:
        for world in args.world_size:
            by = {(s, m): estimate_memory(_part(n, args), world, s, m.split("/")[0], **kw) for s, m in schemes}
            any_est = next(iter(by.values()))
            per_stage = [estimate_memory(_part(n, args), world, s, "fp32", **kw) for s in args.stage]
            rows.append([f"{n / 1e9:g}B", str(world), _fmt_gib(any_est.ddp_total, args.gpu_memory)]
                        + [_fmt_gib(by[k].accelerator, args.gpu_memory) for k in schemes]
                        + [", ".join([f"{any_est.ddp_comm / 1e9:,.1f}"] + [f"{e.comm_bytes / 1e9:,.1f}" for e in per_stage]),
                           ", ".join([f"{any_est.ddp_comm / (args.bandwidth * 1e9):.2f} s"]
                                     + [f"{e.comm_seconds(args.bandwidth):.2f} s" for e in per_stage])])
    return _markdown(rows)


def _across(e: MemoryEstimate, gpus_per_node: int) -> int:
    """Bytes each rank sends per step in ring collectives that span nodes."""
    inside = e.comm_inside if e.shard_size > gpus_per_node else 0
    return inside + (e.comm_cross if e.replicas > 1 and e.world_size > gpus_per_node else 0)


def _compact_hybrid(args: argparse.Namespace, kw: dict, schemes: list[tuple[int, str]]) -> str:
    """One row per (parameters, world size): flat and hybrid side by side, per scheme."""
    s_ = args.shard_size
    head = ["params", "GPUs", "DDP + AdamW"]
    for s, m in schemes:
        off = ", offload" if args.offload else ""
        head += [f"S{s} {m} flat{off}", f"S{s} {m} hybrid x{s_}{off}"]
    traffic = max(args.stage)  # the traffic columns: of this stage (stage 1 moves more inside the shard group)
    head += [f"in rings across nodes GB (flat, hybrid; S{traffic})",
             f"inter-node ring steps (flat, hybrid; S{traffic}, {args.gpus_per_node}/node)"]
    rows = [head]
    for n in args.params:
        for world in args.world_size:
            if world % s_:
                continue
            cells = []
            for s, m in schemes:
                for shard in (None, s_):
                    cells.append(_fmt_gib(estimate_memory(_part(n, args), world, s, m.split("/")[0], shard_size=shard,
                                                          **kw).accelerator, args.gpu_memory))
            flat, hyb = (estimate_memory(_part(n, args), world, traffic, "fp32", shard_size=shard, **kw)
                         for shard in (None, s_))
            rows.append([f"{n / 1e9:g}B", str(world), _fmt_gib(flat.ddp_total, args.gpu_memory)] + cells
                        + [f"{_across(flat, args.gpus_per_node) / 1e9:,.1f}, {_across(hyb, args.gpus_per_node) / 1e9:,.1f}",
                           f"{flat.ring_hops(args.gpus_per_node)[1]:,}, {hyb.ring_hops(args.gpus_per_node)[1]:,}"])
    return _markdown(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bad = [w for w in args.world_size if w < 1]
    if bad:
        print(f"error: --world-size must be >= 1, got {bad}", file=sys.stderr)
        return 2
    if args.shard_size is not None:
        uneven = [w for w in args.world_size if args.shard_size < 1 or w % args.shard_size]
        if uneven:
            print(f"error: --shard-size {args.shard_size} must divide every --world-size (got {uneven}): a hybrid "
                  "mesh is world_size / shard_size replicas of shard_size ranks", file=sys.stderr)
            return 2
    note = (f"bf16/fp16 weights hold 2 bytes, fp32 4; buffers = {args.backend} communication buffers with "
            f"{args.bucket_cap_mb:g} MiB buckets" + (f"; * = more than {args.gpu_memory:g} GiB" if args.gpu_memory else ""))
    if args.compact:
        print(compact_table(args))
        print(note + "; GiB per rank, totals of all categories" + _split_note(args) +
              (" left on the accelerator (offload='cpu' moves master weights and moments to host memory)"
               if args.offload else ""))
        return 0
    for n in args.params:
        for world in args.world_size:
            table, ests = scheme_table(n, world, args)
            print(table)
            if args.detail:
                for e in ests:
                    print("\n" + str(e))
            print(note + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
