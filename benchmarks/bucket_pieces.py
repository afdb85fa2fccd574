"""How GPT-2 small's buckets split over the data-parallel ranks: equal pieces and padding.

GPT-2 small (124M parameters, bf16, 25 MB buckets, laid out as ``ShardedAdamW`` lays them, in
reverse registration order) at 8, 64 and 1024 ranks: the buckets, how many have equal per-rank
pieces (what ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` take), how many ranks own a
piece of each, and the padding. Pure layout math, no process group; ``--baseline DIR`` runs the
same with the shardopt checked out in DIR, for a before/after table.

    python benchmarks/bucket_pieces.py [--baseline DIR]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

VOCAB, WIDTH, LAYERS, CONTEXT = 50257, 768, 12, 1024


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """GPT-2 small's parameter shapes in registration order (the head tied to the embedding)."""
    d = WIDTH
    shapes: list[tuple[int, ...]] = [(VOCAB, d), (CONTEXT, d)]
    for _ in range(LAYERS):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def table() -> None:
    from shardopt.core._layout import build_layout

    shapes = gpt2_small_shapes()[::-1]
    print("| ranks | buckets | with equal pieces | ranks owning a piece of a bucket | padding (elements) | padding / params |")
    print("|---|---|---|---|---|---|")
    for world in (8, 64, 1024):
        layout = build_layout(shapes, world, bucket_numel=25 * 2**20 // 2)
        params = sum(p.numel for p in layout.params)
        equal = sum(1 for b in layout.buckets if len({p.size for p in layout.bucket_pieces(b.index)}) == 1)
        owners = [sum(1 for p in layout.bucket_pieces(b.index) if p.size) for b in layout.buckets]
        print(f"| {world} | {len(layout.buckets)} | {equal} | {min(owners)}-{max(owners)} | {layout.numel - params:,} "
              f"| {(layout.numel - params) / params:.1e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="", help="a checkout of an earlier shardopt: its table too")
    args = ap.parse_args()
    print("this tree:")
    table()
    if args.baseline:
        print(f"\n{args.baseline}:", flush=True)
        env = dict(os.environ, PYTHONPATH=os.path.abspath(args.baseline))
        subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import bucket_pieces; "
                        "bucket_pieces.table()", os.path.dirname(os.path.abspath(__file__))],
                       env=env, check=True, cwd=os.path.abspath(args.baseline))


if __name__ == "__main__":
    main()
