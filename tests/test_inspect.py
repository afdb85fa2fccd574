"""Tier 1, one process: ``ShardedAdamW.inspect()`` is read-only and tells what the optimizer holds.

Its values are checked against facts known without it: the parameters given, the constructor's
arguments, a world of one rank (the whole buffer is this rank's shard).
"""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import shardopt
from shardopt.group._rounds import RoundState

pytestmark = pytest.mark.usefixtures("one_rank_group")  # see tests/conftest.py


def _model() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(5, 3), "b": nn.Linear(3, 2).to(torch.bfloat16)})


def _loss(model: nn.ModuleDict) -> torch.Tensor:
    return model["b"](model["a"](torch.ones(2, 5)).bfloat16()).float().square().sum()


@pytest.mark.parametrize("stage", [1, 2])
def test_the_view_agrees_with_the_parameters_and_the_arguments(stage):
    model = _model()
    opt = shardopt.ShardedAdamW(model.parameters(), lr=0.1, stage=stage, moments="bf16", loss_scale=None)
    view = opt.inspect()
    ranks = (view.rank, view.world_size, view.shard_rank, view.shard_size, view.replica, view.replicas)
    assert ranks == (0, 1, 0, 1, 0, 1)
    assert view.stage == stage and view.step_count == 0 and view.gather_handles == ()
    assert view.scaler_state == {"kind": "none", "scale": 1.0}
    assert {b.dtype for b in view.buffers} == {torch.float32, torch.bfloat16}
    for b in view.buffers:
        mine = [p for p in model.parameters() if p.dtype == b.dtype]
        assert {id(p) for p in b.params} == {id(p) for p in mine} and len(b.names) == len(mine)
        assert b.param_numel == sum(p.numel() for p in mine) <= b.numel
        assert b.shard_numel == b.numel  # one rank holds every shard: each bucket whole, in place
        assert [local for local, _ in b.shard_runs] == [glob for _, glob in b.shard_runs]
        assert sum(local.size for local, _ in b.shard_runs) == b.numel
        assert b.weights.numel() == b.numel and b.shard_weights.numel() == b.shard_numel
        assert all(p.untyped_storage().data_ptr() == b.weights.untyped_storage().data_ptr() for p in b.params)
        assert b.master_weights == "fp32" and b.moments == "bf16"
        assert {k: (t.dtype, t.numel()) for k, t in b.moment_tensors.items()} == {
            "exp_avg": (torch.bfloat16, b.shard_numel), "exp_avg_sq": (torch.bfloat16, b.shard_numel)}
        assert (b.master_copy is None) == (b.dtype == torch.float32)  # fp32 weights are their own master
        assert torch.equal(b.master_fp32, b.shard_weights.float())
        assert (b.flat_grad is None, b.grad_shard is None) == ((False, True) if stage == 1 else (True, False))
        assert len(b.may_nest) == len(b.layout.buckets) and b.bucket_order is None
    opt.backward(_loss(model))
    assert view.round_state is RoundState.IDLE and view.total_rounds == 1 and not view.lost_round
    for b in view.buffers:
        assert sorted(b.bucket_order) == sorted(b.forward_order) == list(range(len(b.layout.buckets)))
        assert b.local_grad.numel() == b.shard_numel and b.local_grad.dtype == b.dtype
        mine = [p for p in model.parameters() if p.dtype == b.dtype]
        assert b.local_grad.float().abs().sum() > 0 and all(p.grad is not None for p in mine)
    opt.step()
    assert view.step_count == opt.step_count == 1 and view.held_bytes >= 0
    opt.close()


def test_the_view_is_read_only_and_does_not_keep_the_optimizer():
    model = _model()
    opt = shardopt.ShardedAdamW(model.parameters(), lr=0.1, loss_scale=None)
    view = opt.inspect()
    buf = view.buffers[0]
    for obj, name in ((view, "stage"), (view, "rank"), (view, "buffers"), (view, "step_count"), (view, "anything"),
                      (buf, "numel"), (buf, "shard_runs"), (buf, "moment_tensors"), (buf, "master_fp32")):
        with pytest.raises(AttributeError):
            setattr(obj, name, 0)
    with pytest.raises(TypeError):
        buf.moment_tensors["exp_avg"] = torch.zeros(1)  # type: ignore[index]
    assert isinstance(view.buffers, tuple) and isinstance(buf.params, tuple) and isinstance(buf.forward_order, tuple)
    state = view.scaler_state
    state["scale"] = 4.0  # a copy
    assert opt.loss_scale == 1.0 and view.scaler_state["scale"] == 1.0
    opt.close()
    del opt
    gc.collect()
    for read in (lambda: view.stage, lambda: buf.numel):  # views do not keep the optimizer alive
        with pytest.raises(ReferenceError):
            read()
