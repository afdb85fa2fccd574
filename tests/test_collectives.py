"""Tier 2: the collectives one step makes, counted from torch's profiler on real gloo ranks.

On the native path (NCCL's default; ``SHARDOPT_COLLECTIVES=native`` runs it on gloo here) a bucket
is reduced by exactly one ``reduce_scatter_tensor`` and gathered by exactly one
``all_gather_into_tensor`` of equal pieces (``c10d::_reduce_scatter_base_`` and
``c10d::_allgather_base_``, the records torch's own process group leaves, whatever shardopt calls
them through); stage 1 all-reduces each bucket in place. No all-to-all, no broadcast, no
reduce-scatter of a list of pieces. On the rank-order path (gloo's default) a bucket is two
all-to-alls of the other ranks' pieces and one broadcast per rank. The two paths train to the same bits at two
ranks. Catches a bucket cut into several collectives, unequal pieces, and a path that does not
run the calls it names (comm._bucket_paths [Note: the bucket paths]). shardopt's own messages (the
round's tag, the step's) are all-to-alls of a (ranks, numbers) table on its control group (comm._control
[Note: a message is an exchange]), told apart by that 2-D shape (a bucket's tensors are flat) and
counted on their own: exactly the round's tag and the step's message.
"""
from __future__ import annotations

from collections import Counter

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

import shardopt

BUCKET_OPS = {"c10d::_reduce_scatter_base_", "c10d::_allgather_base_", "c10d::allreduce_"}
NEVER = {"c10d::alltoall_base_", "c10d::alltoall_", "c10d::broadcast_", "c10d::reduce_scatter_",
         "c10d::allgather_", "c10d::reduce_"}


def step_case(stage: int, path: str) -> dict:
    """One profiled step after a warm-up on bucket path ``path``: the c10d records, their element
    counts, the buckets'."""
    os.environ["SHARDOPT_COLLECTIVES"] = path
    try:
        return _step(stage)
    finally:
        del os.environ["SHARDOPT_COLLECTIVES"]


def _step(stage: int) -> dict:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 31) if i % 2 else nn.Linear(31, 32) for i in range(6)])  # odd sizes
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=stage, bucket_cap_mb=0.01)
    x = torch.randn(4, 31 if model[0].in_features == 31 else 32)
    for _ in range(2):
        opt.zero_grad()
        model(x * (dist.get_rank() + 1)).sum().backward()
        opt.step()
    opt.zero_grad()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model(x * (dist.get_rank() + 1)).sum().backward()
        opt.step()
    layout = opt.inspect().buffers[0].layout
    opt.close()
    every = [(e.name, [s for s in e.input_shapes if s]) for e in prof.events() if e.name.startswith("c10d::")]
    ops = [op for op in every if not _message(op)]
    gloo = [(e.name, e.input_shapes) for e in prof.events() if e.name.startswith("gloo:")]  # with the tensors' shapes
    return {"counts": Counter(name for name, _ in ops), "ops": ops, "gloo": gloo, "world": world, "rank": dist.get_rank(),
            "messages": len(every) - len(ops),
            "buckets": [b.global_range.size for b in layout.buckets],
            "equal": all(len({p.size for p in layout.bucket_pieces(b.index)}) == 1 for b in layout.buckets)}


def _message(op: tuple[str, list]) -> bool:
    """A control message: an all-to-all of a (ranks, numbers) table (a bucket's tensors are flat)."""
    name, shapes = op
    return name == "c10d::alltoall_base_" and bool(shapes) and len(shapes[0]) == 2 and shapes[0][0] == dist.get_world_size()


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_stage2_step_makes_one_reduce_scatter_and_one_all_gather_per_bucket(pools, world_size):
    for r in pools(world_size).run(step_case, 2, "native"):
        buckets, counts = r["buckets"], r["counts"]
        assert r["messages"] == 2, r["messages"]  # the round's tag and the step's message
        assert len(buckets) > 2 and r["equal"], buckets
        assert counts["c10d::_reduce_scatter_base_"] == len(buckets), counts
        assert counts["c10d::_allgather_base_"] == len(buckets), counts
        assert not NEVER & set(counts), counts
        shapes = sorted((name, sh[0][0], sh[1][0]) for name, sh in r["ops"] if name != "c10d::allreduce_")
        # reduce-scatter: (this rank's piece, the bucket); all-gather: (the bucket, this rank's piece)
        want = sorted([("c10d::_reduce_scatter_base_", n // world_size, n) for n in buckets]
                      + [("c10d::_allgather_base_", n, n // world_size) for n in buckets])
        assert shapes == want, (shapes, want)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_stage1_step_all_reduces_each_bucket_in_place_and_gathers_it_once(pools, world_size):
    for r in pools(world_size).run(step_case, 1, "native"):
        buckets, counts = r["buckets"], r["counts"]
        assert counts["c10d::_allgather_base_"] == len(buckets), counts
        assert "c10d::_reduce_scatter_base_" not in counts and not NEVER & set(counts), counts
        reduced = sorted(sh[0][0] for name, sh in r["gloo"] if name == "gloo:all_reduce" and sh and sh[0][0] in buckets)
        assert reduced == sorted(buckets), (reduced, buckets)  # the control messages are other sizes


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_rank_order_path_makes_two_all_to_alls_per_bucket_and_gathers_by_broadcasts(pools, world_size):
    for stage in (1, 2):
        for r in pools(world_size).run(step_case, stage, "rank-order"):
            buckets, counts = r["buckets"], r["counts"]
            assert counts["c10d::alltoall_base_"] == 2 * len(buckets), (stage, counts)  # to the ranks below, above
            gathers = 2 if stage == 1 else 1  # stage 1 also gathers the averaged gradient's pieces
            assert counts["c10d::broadcast_"] == gathers * world_size * len(buckets), (stage, counts)
            assert not {"c10d::_reduce_scatter_base_", "c10d::_allgather_base_", "c10d::reduce_scatter_"} & set(counts)
            rank, world = r["rank"], r["world"]
            sent = sorted(sh[1][0] for name, sh in r["ops"] if name == "c10d::alltoall_base_" and len(sh) > 1 and sh[1][0])
            below, above = [n // world * rank for n in buckets], [n // world * (world - 1 - rank) for n in buckets]
            assert sent == sorted(x for x in below + above if x), (sent, buckets)  # the other ranks' pieces


def train_case(path: str, dtype: str, steps: int = 4) -> list[torch.Tensor]:
    """A few stage-2 steps on different data per rank, on bucket path ``path``: the weights."""
    os.environ["SHARDOPT_COLLECTIVES"] = path
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(31, 32), nn.Linear(32, 31), nn.Linear(31, 32)).to(getattr(torch, dtype))
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, stage=2, bucket_cap_mb=0.004)
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 31, generator=g).to(getattr(torch, dtype))).float().square().sum().backward()
            opt.step()
        opt.close()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        del os.environ["SHARDOPT_COLLECTIVES"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_native_and_rank_order_paths_train_to_the_same_bits_at_two_ranks(pools, dtype):
    pool = pools(2)
    native, rank_order = pool.run(train_case, "native", dtype), pool.run(train_case, "rank-order", dtype)
    for a, b in zip(native, rank_order):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), dtype
    assert not all(torch.equal(x, y) for x, y in zip(native[0], train_case_reference()))  # the data differ per rank


def train_case_reference() -> list[torch.Tensor]:
    """The initial weights: training moved them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(31, 32), nn.Linear(32, 31), nn.Linear(31, 32))
    return [p.detach() for p in model.parameters()]


def noncontiguous_case(exchange_bytes: int) -> tuple:
    """``control_all_reduce`` of a strided view, as an exchange (the default for small messages)
    and as an all-reduce (``EXCHANGE_BYTES`` 0): (the view's sum, the columns outside it)."""
    import shardopt.comm._collectives as collectives

    previous, collectives.EXCHANGE_BYTES = collectives.EXCHANGE_BYTES, exchange_bytes
    try:
        comm = collectives.Comm(None)
        base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * dist.get_rank()
        comm.control_all_reduce(base[:, ::2]).wait()
        return base[:, ::2].clone(), base[:, 1::2].clone()
    finally:
        collectives.EXCHANGE_BYTES = previous


def test_a_strided_view_is_reduced_in_place_and_nothing_beside_it_changes(pools):
    for exchange_bytes in (1 << 20, 0):
        for rank, (reduced, beside) in enumerate(pools(2).run(noncontiguous_case, exchange_bytes)):
            whole = torch.arange(12, dtype=torch.float32).reshape(3, 4)
            assert torch.equal(reduced, 2 * whole[:, ::2] + 100), (exchange_bytes, rank, reduced)  # ranks 0 and 1
            assert torch.equal(beside, whole[:, 1::2] + 100 * rank), (exchange_bytes, rank, beside)  # untouched
