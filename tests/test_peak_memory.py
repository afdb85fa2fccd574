"""Tier 2: the peak bytes per rank during backward, counted independently of shardopt.

Catches a first backward pass that holds more than later ones (it used to keep every 16-bit
gradient until its end: 2 B/param more than the steady state), a parameter unused on one rank
that holds back that rank's buckets, a report whose peak is not what a rank holds, and a steady
state above the ZeRO-2 formula plus the stated bound on buffers (at 2, 4 and 8 ranks). The count
walks every live weight, gradient, state and buffer tensor (``gc``, activations left out) and
every ``.grad``, from a gradient hook registered after the optimizer's, so it sees each gradient
as the optimizer leaves it, and right after every reduction is issued.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardopt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from live_tensors import LiveTensors  # noqa: E402  (the same count as benchmarks/bench_memory.py)

BUCKET_MB = 0.02  # about one 96 x 96 bf16 weight per bucket
_GROUPS: dict[int, object] = {}


def _group(world_size: int) -> object:
    """A process group of the first ``world_size`` ranks of the pool; created once, on every rank."""
    if world_size not in _GROUPS:
        _GROUPS[world_size] = dist.new_group(list(range(world_size)))
    return _GROUPS[world_size]


@contextlib.contextmanager
def sampled_collectives(sample: Callable[[], None]) -> Iterator[None]:
    """Call ``sample`` right after each torch.distributed collective that reduces a bucket into
    a receive buffer (gloo's all-to-all, NCCL's reduce-scatter)."""
    names = ("all_to_all_single", "reduce_scatter")
    originals = {n: getattr(dist, n) for n in names}

    def wrap(fn: Callable) -> Callable:
        def call(*args: object, **kwargs: object) -> object:
            out = fn(*args, **kwargs)
            sample()
            return out
        return call

    for n in names:
        setattr(dist, n, wrap(originals[n]))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


class Stack(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(96, 96) for _ in range(10)).to(dtype)

    def forward(self, x: torch.Tensor, skip: int | None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i != skip:
                x = torch.tanh(layer(x))
        return x.float().square().mean()


def peak_case(world_size: int, stage: int, dtype: str, how: str, unused: int | None) -> dict | None:
    """Per step, the most bytes live during backward on this rank, and the report's peak."""
    group = _group(world_size)
    rank = dist.get_rank()
    if rank >= world_size:
        return None
    xs = [torch.randn(2, 96, generator=torch.Generator().manual_seed(10 * step + rank)).to(getattr(torch, dtype))
          for step in range(3)]
    with LiveTensors(graph=False) as live:  # activations left out: weights, gradients, state, buffers
        base = live.bytes()
        model = Stack(getattr(torch, dtype))
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=stage, bucket_cap_mb=BUCKET_MB,
                                    loss_scale=None, process_group=group)
        peaks = [0]

        def sample(*_: object) -> None:
            peaks[-1] = max(peaks[-1], live.bytes() - base)

        for layer in model.layers:  # after each weight's gradient (a bias's follows it at once)
            layer.weight.register_post_accumulate_grad_hook(sample)
        steps = []
        for step in range(3):
            loss = model(xs[step], skip=6 if rank == unused else None)  # a middle layer unused on that rank
            with sampled_collectives(sample):  # and right after each reduction is issued (buffers in flight)
                opt.backward(loss) if how == "opt.backward" else loss.backward()
            steps.append(peaks[-1])
            peaks.append(0)
            opt.step()
            opt.zero_grad()
    rep = opt.memory_report()
    return {"steps": steps, "report_peak": rep.peak_total, "buffers": rep.buffers, "report": str(rep)}


CASES = [(s, "bfloat16", h, None) for s in (1, 2) for h in ("opt.backward", "loss.backward")]
CASES += [(1, "float32", "opt.backward", None), (2, "float32", "loss.backward", None)]
# A middle layer unused on one rank (after the cases without, whose peaks they are held to).
CASES += [(2, "bfloat16", "loss.backward", 1), (1, "bfloat16", "opt.backward", 1), (2, "bfloat16", "opt.backward", 0)]
# At 4 ranks (4 processes on 2 cores: the count is slow), the cases that differ most.
CASES_AT = {2: CASES, 4: [(2, "bfloat16", "loss.backward", None), (1, "float32", "opt.backward", None),
                          (2, "bfloat16", "loss.backward", 1)]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_first_backward_holds_no_more_than_later_ones(pools, world_size):
    pool = pools(4)
    steady = {}
    for case in CASES_AT[world_size]:
        stage, dtype, how, unused = case
        for rank, r in enumerate(pool.run(peak_case, world_size, *case)[:world_size]):
            first, later = r["steps"][0], max(r["steps"][1:])
            where = (case, world_size, rank, r["steps"])
            bucket = (96 * 96 + 96) * getattr(torch, dtype).itemsize  # a layer: one bucket here
            # The count moves by up to two buckets with the ranks' timing: gloo releases a finished
            # collective's buffers on its own thread, a moment after the wait returns. In the first backward a rank ahead of rank 0
            # also holds one complete bucket while it waits for the announcement of the next.
            # Unused on rank 0 only, a layer's buckets (its weight and its bias fall in two here)
            # wait on the other ranks for the end of the first backward, in which rank 0 announces
            # them; later passes reduce them where they complete (see _rounds [Note: launch order]).
            # Unused on rank 1, nothing waits there: the first backward reduces the unused layer's
            # bucket without it once a later bucket is complete (held back, the 6 buckets after it
            # would stay until backward ends).
            held = {0: 2 * bucket}.get(unused, 0)
            assert first <= later + 2 * bucket + held, where
            if unused is None:
                steady[(stage, dtype, rank)] = later
            else:  # nothing waits for the unused layer (held back, the buckets after it would stay until
                # backward ends: 6 here)
                assert later <= steady[(stage, dtype, rank)] + 2 * bucket, (where, steady)
            # The report's peak total (since construction) is what the count sees at its highest,
            # give or take the buffers of finished collectives that gloo's worker thread has not
            # released yet (the count sees them as tensors that only C++ holds): up to two buckets
            # in about one run in three, about 4% of this small model and a rounding error on one
            # with hundreds of buckets.
            small = 256  # the round tag and the announcements: a few elements each
            # The report also sees, inside the optimizer's hook, the moment a staging buffer is
            # allocated while autograd's .grad is still alive (up to one bucket), which the count,
            # sampled outside it, cannot.
            assert -2 * bucket - small <= r["report_peak"] - max(r["steps"]) <= bucket + small, (where, r["report"])


# The steady state against the ZeRO-2 formula: 2 + (2 + 12)/N bytes per parameter (16-bit weights,
# fp32 master, stage 2) plus the stated bound on what reduction holds beyond the gradient shard:
# 4 buckets staged, 3 collectives' receive buffers of about a bucket each (gloo), and the one
# 16-bit .grad autograd produced before the optimizer takes it (see the `buffers` paragraph of docs/memory.md).
BOUND_BUCKETS = 4 + 3 + 1


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_the_steady_state_peak_follows_the_zero2_formula(pools, world_size):
    pool = pools(8 if world_size == 8 else 4)
    numel = 10 * (96 * 96 + 96)
    bucket = (96 * 96 + 96) * 2
    for rank, r in enumerate(pool.run(peak_case, world_size, 2, "bfloat16", "loss.backward", None)[:world_size]):
        later = max(r["steps"][1:])
        assert later <= (2 + 14 / world_size) * numel + BOUND_BUCKETS * bucket, (world_size, rank, r["steps"])
        # and what the bound leaves out is really held (the formula is not a loose upper bound)
        assert later >= (2 + 14 / world_size) * numel, (world_size, rank, r["steps"])


class Mixed(nn.Module):
    """bf16 layers with fp32 LayerNorms in front of each: two flat buffers (one per dtype), whose
    buckets are reduced interleaved in one backward pass."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(96, 96) for _ in range(6)).to(torch.bfloat16)
        self.norms = nn.ModuleList(nn.LayerNorm(96) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, norm in zip(self.layers, self.norms):
            x = torch.tanh(layer(norm(x.float()).to(torch.bfloat16)))
        return x.float().square().mean()


def buffers_by_dtype_case(stage: int, bucket_mb: float) -> dict:
    """Per flat buffer, the report's ``buffers`` and the most bytes of that buffer's dtype held
    during backward beyond what was held before it (the count, by dtype: each flat buffer's staging
    and receive buffers have its dtype)."""
    rank = dist.get_rank()
    xs = [torch.randn(2, 96, generator=torch.Generator().manual_seed(10 * step + rank)) for step in range(3)]
    dtypes = (torch.bfloat16, torch.float32)
    with LiveTensors(graph=False) as live:
        model = Mixed()
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=stage, bucket_cap_mb=bucket_mb,
                                    loss_scale=None)
        counted = dict.fromkeys(dtypes, 0)
        before: dict = {}

        def sample(*_: object) -> None:
            now = live.bytes_by_dtype()
            for d in dtypes:
                counted[d] = max(counted[d], now.get(d, 0) - before.get(d, 0))

        for p in model.parameters():  # after the optimizer's hooks: each gradient as the optimizer leaves it
            p.register_post_accumulate_grad_hook(sample)
        for step in range(3):
            opt.zero_grad()
            loss = model(xs[step])
            before = live.bytes_by_dtype()  # weights, gradient storage, state: what backward adds to
            with sampled_collectives(sample):
                opt.backward(loss)
            opt.step()
    return {"reported": {str(b.dtype): b.memory_report().buffers for b in opt._buffers},
            "counted": {str(d): n for d, n in counted.items()}, "total": opt.memory_report().buffers}


@pytest.mark.parametrize("stage", [1, 2])
def test_each_flat_buffer_counts_its_own_communication_buffers(pools, stage):
    """Two flat buffers on one Comm: each buffer's ``buffers`` is its own staging and its own
    reductions' receive buffers, never the other's in flight beside them, and the report's total is
    their sum, as the count by dtype finds."""
    small = 256  # the round tags and the step's messages: a few fp32 elements each
    for bucket_mb in (0.02, 0.05):
        for rank, r in enumerate(pools(2).run(buffers_by_dtype_case, stage, bucket_mb)):
            where = (stage, bucket_mb, rank, r)
            assert set(r["reported"]) == {"torch.bfloat16", "torch.float32"}, where
            for d, reported in r["reported"].items():
                bucket = min(bucket_mb * 2**20, 6 * (96 * 96 + 96) * 2 if d == "torch.bfloat16" else 6 * 192 * 4)
                # gloo releases a finished collective's buffers a moment after the wait returns: the count
                # can see up to two buckets of those, which the report does not
                assert reported <= r["counted"][d] + small, where
                assert r["counted"][d] <= reported + 2 * bucket + small, where
            assert r["total"] == sum(r["reported"].values()) <= sum(r["counted"].values()) + 2 * small, where
