"""Tier 2: bytes held per rank, measured from the optimizer's tensors, against the ZeRO formulas.

Catches state that is not sharded (or sharded twice), a gradient buffer that is full where it
should be a shard, padding that grows with the world size, and staging that keeps whole-model
gradients alive in stage 2. Expected figures are computed here from the parameter count.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardopt

BUCKET_MB = 0.125


def _model() -> nn.Module:
    torch.manual_seed(0)  # about 2M parameters in odd shapes, each below the bucket cap
    layers = [nn.Linear(250, 251)] + [nn.Sequential(nn.GELU(), nn.Linear(251, 251)) for _ in range(31)]
    return nn.Sequential(*layers, nn.LayerNorm(251)).to(torch.bfloat16)


def memory_case(stage: int) -> dict:
    model = _model()
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=stage, bucket_cap_mb=BUCKET_MB)
    x = torch.randn(4, 250, dtype=torch.bfloat16)
    opt.backward(model(x).float().pow(2).mean())
    opt.step()
    rep = opt.memory_report()
    # Independent measurement: bytes of every tensor reachable from the optimizer's buffers.
    held = {}
    for b in opt.inspect().buffers:
        held["master"] = held.get("master", 0) + (b.master_copy.numel() * 4 if b.master_copy is not None else 0)
        held["exp"] = held.get("exp", 0) + sum(t.untyped_storage().nbytes() for t in b.moment_tensors.values())
        g = b.flat_grad if stage == 1 else b.grad_shard
        held["grads"] = held.get("grads", 0) + g.untyped_storage().nbytes()
        held["params"] = held.get("params", 0) + b.weights.untyped_storage().nbytes()
    return {"report": {c: getattr(rep, c) for c in ("params", "grads", "master", "exp_avg", "exp_avg_sq",
                                                      "extra", "buffers", "total")},
            "predicted": dict(rep.predicted), "held": held,
            "numel": sum(p.numel() for p in model.parameters())}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_bytes_per_rank_follow_zero_formula(pools, world_size):
    pool = pools(world_size)
    for stage in (1, 2):
        for r in pool.run(memory_case, stage):
            n, rep, held = r["numel"], r["report"], r["held"]
            state = rep["master"] + rep["exp_avg"] + rep["exp_avg_sq"]
            assert state == held["master"] + held["exp"]
            expected_state = 12 * n / world_size
            assert expected_state <= state <= expected_state * 1.001, (state, expected_state)
            assert 2 * n <= rep["params"] == held["params"] <= 2 * n * 1.001
            expected_grads = 2 * n if stage == 1 else 2 * n / world_size
            assert expected_grads <= rep["grads"] == held["grads"] <= expected_grads * 1.001
            # Communication buffers are a few buckets: three reductions in flight, each receiving up to
            # world_size copies of this rank's piece, and in stage 2 their staging plus one bucket filling;
            # none at one rank in stage 1 (nothing comes from another rank, nothing is staged).
            buckets = 3 * world_size + (0 if stage == 1 else 4)
            assert 0 <= rep["buffers"] <= buckets * (BUCKET_MB * 2**20 + 16 * world_size)
            assert (rep["buffers"] > 0) == (world_size > 1 or stage == 2), rep
            if world_size <= 2:  # ... which stays below the whole gradient
                assert rep["buffers"] < 2 * n
            # The report's prediction is the formula, without padding.
            assert r["predicted"]["master"] + r["predicted"]["exp_avg"] + r["predicted"]["exp_avg_sq"] == \
                pytest.approx(expected_state, abs=12)


def tiny_case(numel: int, stage: int) -> list:
    """A model smaller than the world size still trains, and matches a plain AdamW."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(numel))
    ref = p.detach().clone().requires_grad_(True)
    opt = shardopt.ShardedAdamW([p], lr=0.1, stage=stage)
    ref_opt = torch.optim.AdamW([ref], lr=0.1)
    for step in range(3):
        opt.zero_grad()
        (p * (rank + 1 + step)).sum().backward()
        opt.step()
        ref.grad = torch.full_like(ref, sum(r + 1 + step for r in range(world)) / world)
        ref_opt.step()
    return (p.detach() - ref.detach()).abs().max().item()


def test_model_smaller_than_world(pools):
    pool = pools(4)
    for numel in (1, 3, 17):
        for stage in (1, 2):
            assert max(pool.run(tiny_case, numel, stage)) <= 1e-6
