"""Tier 2: what the layout before equal-pieced buckets wrote still loads, or is refused clearly.

``tests/data/before_equal_pieces`` was written by the version whose shards were one range of the
flat buffer (``make.py`` there says how): a checkpoint of two ranks, each rank's
``opt.state_dict()``, and rank 0's ``full_state_dict`` and weights as that version read them back.
A checkpoint keeps each parameter's state whole, so it loads into today's layout at any world size,
bit for bit; a rank state dict is one rank's raw shard, which the new layout fills differently
(several buckets, two ranks), so it is refused on every rank with what to do.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import shardopt
from distpool import in_first_ranks
from models import make_model, param_groups
from shardopt.checkpoint import full_state_dict, load_checkpoint

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "before_equal_pieces")
BUCKET_MB = 1 / 1024  # as make.py
POOL = 4  # one pool; smaller worlds are its first ranks (distpool.in_first_ranks)


def _build(group):
    model = make_model(seed=4, dtype=torch.bfloat16)  # another start than the saved run's
    opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, stage=2,
                                master_weights="fp32", bucket_cap_mb=BUCKET_MB, process_group=group)
    return model, opt


def load_case(group) -> dict:
    model, opt = _build(group)
    load_checkpoint(os.path.join(DATA, "checkpoint"), model, opt)
    return {"fsd": full_state_dict(opt), "weights": {k: v.clone() for k, v in model.state_dict().items()},
            "buckets": len(opt.inspect().buffers[0].layout.buckets)}


def rank_state_case(group) -> str:
    model, opt = _build(group)
    sd = torch.load(os.path.join(DATA, f"rank{dist.get_rank(group)}.pt"), weights_only=False)
    try:
        opt.load_state_dict(sd)
    except ValueError as e:
        return str(e)
    return ""


def _same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_checkpoint_of_the_earlier_layout_loads_bit_for_bit(pools, world):
    reference = torch.load(os.path.join(DATA, "reference.pt"), weights_only=False)
    assert reference["buckets"] > 1  # the layouts differ: several buckets over two ranks
    results = pools(POOL).run(in_first_ranks, world, load_case)[:world]
    for r in results:
        assert r["buckets"] == reference["buckets"]
        _same(reference["weights"], r["weights"], "weights")
    _same(reference["fsd"], results[0]["fsd"], "full_state_dict")  # rank 0's (full_state_dict's to=0)


def test_a_rank_state_dict_of_the_earlier_layout_is_refused_on_every_rank(pools):
    messages = pools(POOL).run(in_first_ranks, 2, rank_state_case)[:2]
    for m in messages:
        assert "shards were one range of the flat buffer" in m and "save_checkpoint" in m, m
