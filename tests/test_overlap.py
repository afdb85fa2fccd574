"""Tier 2: bucketed, asynchronous communication on gloo ranks.

Catches bucket boundaries that change results (a lost or doubled gradient at a boundary, tied or
unused parameters mishandled), overlapped parameter gathers that let a module run on stale
weights, an fp32 reduction option that does not reduce in fp32, and communication counters that
do not add up to the bytes actually moved.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardopt
from models import batch, make_model, param_groups

ONE_ELEMENT_MB = 4 / 2**20  # one fp32 element's worth: every parameter in a bucket of its own


def bucket_case(stage: int, bucket_cap_mb: float, steps: int = 4) -> list[torch.Tensor]:
    rank = dist.get_rank()
    model = make_model(seed=11)
    opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, stage=stage, bucket_cap_mb=bucket_cap_mb)
    for step in range(steps):
        opt.zero_grad()
        opt.backward(model(batch(rank, step)))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_bucketed_equals_unbucketed_bit_for_bit(pools):
    for world in (2, 3):
        pool = pools(world)
        for stage in (1, 2):
            whole = pool.run(bucket_case, stage, 1e3)  # one bucket larger than the model
            for cap in (ONE_ELEMENT_MB, 1e-3, 4e-3):
                got = pool.run(bucket_case, stage, cap)
                for a, b in zip(whole, got):
                    assert all(torch.equal(x, y) for x, y in zip(a, b)), (world, stage, cap)


def overlap_case(overlap: bool, stage: int) -> dict:
    rank = dist.get_rank()
    model = make_model(seed=12)
    opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, stage=stage, bucket_cap_mb=ONE_ELEMENT_MB,
                                overlap_param_gather=overlap)
    stale_reads, pending_at_start, losses = [], [], []

    def check(module, args):  # registered after the optimizer's hook: runs once it has waited
        pending = set(opt.pending_param_buckets())
        if module is model:
            pending_at_start.append(len(pending))
        for p in module.parameters(recurse=False):
            if opt.bucket_of(p) in pending:
                stale_reads.append(type(module).__name__)

    handles = [m.register_forward_pre_hook(check) for m in model.modules()]
    for step in range(4):
        opt.zero_grad()
        loss = model(batch(rank, step))
        losses.append(loss.item())
        opt.backward(loss)
        opt.step()
    opt.finish_param_gather()
    for h in handles:
        h.remove()
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "stale": stale_reads, "pending_at_start": pending_at_start}


def test_overlapped_gather_same_results_and_never_stale(pools):
    pool = pools(2)
    for stage in (1, 2):
        plain = pool.run(overlap_case, False, stage)
        over = pool.run(overlap_case, True, stage)
        for a, b in zip(plain, over):
            assert a["losses"] == b["losses"]
            assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
            assert b["stale"] == []  # no module ran before the gather of its own weights was waited
            # After the first step, the next forward starts with gathers still in flight: real overlap.
            assert all(n > 0 for n in b["pending_at_start"][1:]), b["pending_at_start"]
            assert all(n == 0 for n in a["pending_at_start"])


def state_dict_after_step_case() -> tuple:
    """model.state_dict() right after an overlapped step (to save weights): the gathers are waited
    for first, so what it returns is the updated weights, not half-gathered ones."""
    model = make_model(seed=4)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, overlap_param_gather=True, bucket_cap_mb=ONE_ELEMENT_MB)
    for step in range(2):
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()
    pending_before = len(opt.pending_param_buckets())
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    pending_after = len(opt.pending_param_buckets())
    opt.finish_param_gather()
    settled = model.state_dict()
    return pending_before, pending_after, all(torch.equal(saved[k], settled[k]) for k in saved)


def test_state_dict_right_after_an_overlapped_step_is_up_to_date(pools):
    for before, after, equal in pools(2).run(state_dict_after_step_case):
        assert before > 0 and after == 0 and equal, (before, after, equal)


def reduce_dtype_case(reduce_fp32: bool) -> bool:
    """Stage 1, bf16: p.grad after backward equals the fp32 average of the ranks' bf16 gradients,
    rounded once (compared with an all_reduce done here in fp32)."""
    rank = dist.get_rank()
    model = make_model(seed=13, dtype=torch.bfloat16)
    ref = make_model(seed=13, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), stage=1, bucket_cap_mb=1e-4,
                                reduce_dtype=torch.float32 if reduce_fp32 else None)
    opt.backward(model(batch(rank, 0)))
    ref(batch(rank, 0)).backward()
    same = True
    for p, q in zip(model.parameters(), ref.parameters()):
        if not p.requires_grad:
            continue
        g = (q.grad if q.grad is not None else torch.zeros_like(q)).float()
        dist.all_reduce(g, op=dist.ReduceOp.AVG)
        same &= torch.equal(p.grad, g.to(torch.bfloat16))
    return same


def test_reduce_in_fp32(pools):
    """Three ranks: a bf16 sum of three values rounds, an fp32 one does not. On gloo the rank-order
    sum always runs in fp32 (at no cost on the wire), so both settings match the fp32 average."""
    pool = pools(3)
    assert all(pool.run(reduce_dtype_case, True))
    assert all(pool.run(reduce_dtype_case, False))


def counters_case(stage: int) -> dict:
    rank = dist.get_rank()
    model = make_model(seed=14, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), stage=stage, bucket_cap_mb=1e-4)
    for step in range(2):
        opt.zero_grad()
        opt.backward(model(batch(rank, step)))
        opt.step()
    c = opt.last_step_comm
    return {"reduce": c.reduce_bytes, "gather": c.gather_bytes, "collectives": c.collectives,
            "wait": c.wait_seconds, "numel": opt.inspect().buffers[0].numel}


def test_comm_counters_add_up(pools):
    for stage in (1, 2):
        for r in pools(2).run(counters_case, stage):
            padded_bytes = r["numel"] * 2  # bf16: the whole padded buffer is reduced once and gathered once,
            # and stage 1's gradient all-reduce gathers the averaged gradient pieces too
            assert r["reduce"] == padded_bytes, r
            assert r["gather"] == padded_bytes * (2 if stage == 1 else 1), r
            assert r["collectives"] > 2 and r["wait"] >= 0.0


def test_a_handle_is_waited_once():
    from shardopt.comm._collectives import Pending

    kept = torch.ones(3)
    p = Pending([], keep_alive=[kept])
    p.wait()
    assert p.keep_alive == []  # buffers are released only once the collective has completed
    with pytest.raises(AssertionError, match="waited twice"):
        p.wait()
