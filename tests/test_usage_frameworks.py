"""Tier 2: what frameworks do around an optimizer: DDP wrappers, state dicts saved by rank
0, a second optimizer over the same parameters. Torch's result (``usage_reference``) or a clear
error on every rank.
"""
from __future__ import annotations

import gc
import warnings

import torch
import torch.distributed as dist
from torch import nn

import shardopt
from models import batch, make_model
from usage_reference import HP, error_of, param_diff, ref_step


# -- frameworks: DDP wrappers, state dicts saved by rank 0 ---------------------------------------
def ddp_wrapper_case(stage: int, freeze_first: bool = False) -> tuple:
    model = make_model(seed=2)
    next(model.parameters()).requires_grad_(not freeze_first)  # a frozen parameter first must not hide it
    opt = shardopt.ShardedAdamW([p for p in model.parameters() if p.requires_grad], **HP, stage=stage)
    wrapped = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = error_of(lambda: wrapped(batch(dist.get_rank(), 0)))
    plain = make_model(seed=2)  # a DDP model trained by a plain AdamW is none of shardopt's business
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        nn.parallel.DistributedDataParallel(plain)(batch(dist.get_rank(), 0))
    del opt
    return error, [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)], \
        [str(w.message) for w in quiet if "shardopt" in str(w.message)]


def test_a_ddp_wrapper_is_refused_in_stage2_and_warned_about_in_stage1(pools):
    pool = pools(2)
    for freeze_first in (False, True):
        for error, warned, quiet in pool.run(ddp_wrapper_case, 2, freeze_first):
            assert error and error[0] == "RuntimeError" and "ShardedTrainer" in error[1] and not quiet, error
        for error, warned, quiet in pool.run(ddp_wrapper_case, 1, freeze_first):
            assert error is None and len(warned) == 1 and "doubling the communication" in warned[0], (error, warned)


def dropped_optimizer_case() -> tuple:
    """A stage-2 optimizer built and dropped before its first step (a learning-rate finder, a
    framework's dry run), then the same model wrapped in DDP under a stage-1 optimizer: the dropped
    optimizer's watch must not speak for the model any more."""
    model = make_model(seed=2)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=2)
    del opt
    gc.collect()  # freed, not superseded: nothing releases it but its own hooks' weak reference
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=1)
    wrapped = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = error_of(lambda: wrapped(batch(dist.get_rank(), 0)))
    return error, [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)]


def test_an_optimizer_dropped_before_its_first_step_leaves_no_watch_behind(pools):
    for error, warned in pools(2).run(dropped_optimizer_case):
        assert error is None and len(warned) == 1 and "doubling the communication" in warned[0], (error, warned)


def rank0_state_dict_case(path: str) -> tuple:
    """What a framework does: rank 0 saves state_dict(), every rank loads that file."""
    rank = dist.get_rank()
    model = make_model(seed=3, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=2)
    for step in range(2):
        opt.zero_grad()
        opt.backward(model(batch(rank, step)))
        opt.step()
    if rank == 0:
        torch.save(opt.state_dict(), path)
    dist.barrier()
    refused = error_of(lambda: opt.load_state_dict(torch.load(path, weights_only=True)))
    opt.consolidate_state_dict()
    whole = opt.state_dict()
    fsd = opt.full_state_dict()
    if rank == 0:
        torch.save(whole, path)
        assert set(whole) == {"state", "param_groups", "shardopt"}
        for i, s in fsd["state"].items():  # the same moments as full_state_dict, plus the masters
            assert all(torch.equal(s[k], whole["state"][i][k]) for k in s), i
        trained = {i for i, p in enumerate(model.parameters()) if p.requires_grad}
        assert set(whole["shardopt"]["master"]) == trained, (sorted(whole["shardopt"]["master"]), trained)
    dist.barrier()
    master = torch.cat([b.master_fp32.clone() for b in opt.inspect().buffers])
    other = make_model(seed=8, dtype=torch.bfloat16)
    opt2 = shardopt.ShardedAdamW(other.parameters(), lr=1e-3, stage=1)
    opt2.load_state_dict(torch.load(path, weights_only=True))
    exact = torch.equal(torch.cat([b.master_fp32 for b in opt2.inspect().buffers]), master)
    weights_equal = all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()) if p.requires_grad)
    opt.zero_grad()
    opt.backward(model(batch(rank, 5)))
    opt.step()
    after_step = opt.state_dict().get("format")  # the consolidated copy is stale after a step
    return refused, exact, weights_equal, after_step


def test_state_dict_saved_by_rank0_is_refused_everywhere_unless_consolidated(pools, tmp_path):
    for rank, (refused, exact, weights_equal, after_step) in enumerate(
            pools(2).run(rank0_state_dict_case, str(tmp_path / "opt.pt"))):
        assert refused and refused[0] == "ValueError", (rank, refused)  # on rank 0 too: no rank hangs
        assert "consolidate_state_dict" in refused[1], refused
        assert exact and weights_equal, rank  # the exact fp32 master, at another stage
        assert after_step == "shardopt.rank_shard.v1"


def superseded_case(stage: int) -> tuple:
    """A second ShardedAdamW over the same parameters (a framework's second fit, a learning-rate
    finder first): it trains as a fresh AdamW would, and the first one refuses to step."""
    model, ref = make_model(seed=4), make_model(seed=4)
    first = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    ref_first = torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(2):
        first.zero_grad()
        first.backward(model(batch(dist.get_rank(), step)))
        first.step()
        ref_step(ref, ref_first, step)
    second = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    ref_second = torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(2, 5):
        second.zero_grad()
        second.backward(model(batch(dist.get_rank(), step)))
        second.step()
        ref_step(ref, ref_second, step)
    worst = param_diff(model, ref)
    refused = error_of(first.step)
    second.close()
    plain = torch.optim.AdamW(model.parameters(), **HP)  # after close(), p.grad is torch's again
    plain.zero_grad()
    model(batch(dist.get_rank(), 5)).backward()
    real_grads = all(p.grad is None or p.grad.untyped_storage().nbytes() > 0 for p in model.parameters())
    return worst, refused, real_grads


def test_a_second_optimizer_over_the_same_parameters_takes_them_over(pools):
    for stage in (1, 2):
        for worst, refused, real_grads in pools(2).run(superseded_case, stage):
            assert worst <= 2e-6, (stage, worst)
            assert refused and refused[0] == "RuntimeError" and "superseded" in refused[1], refused
            assert real_grads, stage
