"""Tier 1, one process: shardopt's work shows in a torch.profiler trace under its own names
(shardopt.core._ranges [Note: profiler ranges]).

Catches a stage whose range went missing (a refactor that moved the work out of it), and ranges
around per-parameter work (more ranges than buckets)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import shardopt

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_rank_group")]  # see tests/conftest.py

EVERY_STEP = {"shardopt::reduce_launch", "shardopt::reduce_land", "shardopt::finish_round", "shardopt::step",
              "shardopt::step_agreement", "shardopt::update", "shardopt::all_gather", "shardopt::gather_wait"}


def _events(stage: int, overlap: bool) -> tuple[list, int]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])  # 12 parameters
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=stage, bucket_cap_mb=0.01,
                                overlap_param_gather=overlap)  # 0.01 MB: a few layers a bucket
    x = torch.randn(4, 32)
    model(x).sum().backward()  # the first round agrees on the launch order outside the profile
    opt.step()
    opt.zero_grad()
    opt.finish_param_gather()  # the warm-up's gathers land outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        model(x)  # with overlap: the forward waits for the gathers
    buckets = len(opt.inspect().buffers[0].buckets)
    opt.close()
    return [e for e in prof.events() if e.name.startswith("shardopt::")], buckets


@pytest.mark.parametrize("stage,overlap", [(2, True), (2, False), (1, False)])
def test_a_profiled_step_shows_shardopts_work_by_name(stage: int, overlap: bool) -> None:
    events, buckets = _events(stage, overlap)
    names = [e.name for e in events]
    assert set(names) == EVERY_STEP, set(names) ^ EVERY_STEP
    assert 1 < buckets < 12  # several buckets, several parameters each
    for name in ("shardopt::reduce_launch", "shardopt::update", "shardopt::all_gather", "shardopt::gather_wait"):
        assert names.count(name) == buckets, (name, names.count(name), buckets)  # one per bucket, none per parameter
    assert names.count("shardopt::step") == 1 and names.count("shardopt::step_agreement") == 1
