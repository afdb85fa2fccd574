"""Tier 1, one process: the per-parameter and per-bucket records (shardopt.core._records).

Catches records whose ranges disagree with the layout's own index math, a state that changes
without its guard, a record that says p.grad holds something other than what it holds, and a
question that changes what it asks about.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import shardopt
from shardopt.core._layout import build_layout
from shardopt.core._records import BucketState, GradSlot, Holds, ParamState, build_records

pytestmark = pytest.mark.usefixtures("one_rank_group")  # see tests/conftest.py


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3, bias=False), nn.Linear(3, 2))


@pytest.mark.parametrize("world,rank", [(1, 0), (3, 1), (4, 3)])
def test_records_hold_the_layouts_ranges(world: int, rank: int) -> None:
    params = list(_model().parameters())
    layout = build_layout([p.shape for p in params], world, bucket_numel=40)
    records, buckets = build_records(params, [f"p{i}" for i in range(len(params))], [0] * len(params), layout, rank, 2)
    local = layout.local_ranges(rank)  # the layout's own answer, independent of the records
    assert {r.index: r.local for r in records if r.local is not None} == local
    assert [b.local for b in buckets] == layout.bucket_local_ranges(rank)
    for b, lb in zip(buckets, layout.buckets):
        assert [r.index for r in b.params] == list(lb.params) and b.buffer == 2
        assert list(b.pieces) == layout.bucket_pieces(lb.index)
        assert list(b.gather_pieces) == layout.bucket_shard_ranges(lb.index)
        for r in b.params:
            assert r.bucket is b
            g = r.span.global_range
            assert (r.at.start + b.global_range.start, r.at.stop + b.global_range.start) == (g.start, g.end)


def test_a_state_changes_only_along_its_guarded_transitions() -> None:
    params = list(_model().parameters())
    layout = build_layout([p.shape for p in params], 1)
    records, buckets = build_records(params, ["a"] * len(params), [0] * len(params), layout, 0, 0)
    r, b = records[0], buckets[0]
    r.to(ParamState.TAKEN)
    with pytest.raises(AssertionError):
        r.to(ParamState.ABSENT)  # a taken gradient is not "not reached"
    r.to(ParamState.WAITING)
    with pytest.raises(AssertionError):
        b.to(BucketState.LANDED)  # not launched
    b.to(BucketState.LAUNCHED)
    b.to(BucketState.LANDED)
    b.to(BucketState.WAITING)


@pytest.mark.parametrize("stage", [1, 2])
def test_what_p_grad_holds_is_read_from_p_grad(stage: int) -> None:
    model = _model()
    opt = shardopt.ShardedAdamW(model.parameters(), lr=0.1, stage=stage)
    rec = opt.inspect().buffers[0].records[0]
    model(torch.ones(4, 5)).sum().backward()
    if stage == 1:
        assert rec.holds() is Holds.VIEW and rec.slot is GradSlot.OWN
    else:
        assert rec.holds() is Holds.PLACEHOLDER and rec.slot is GradSlot.PLACEHOLDER
        rec.param.grad.zero_()
        assert rec.holds() is Holds.ZEROED
    rec.param.grad = torch.ones_like(rec.param)
    assert rec.holds() is Holds.TENSOR
    rec.param.grad = None
    assert rec.holds() is Holds.NONE
    opt.close()


def test_asking_changes_nothing() -> None:
    model = _model()
    opt = shardopt.ShardedAdamW(model.parameters(), lr=0.1, stage=2)
    view = opt.inspect().buffers[0]
    reducer = opt._buffers[0].reducer
    asked = []

    def ask(grad: torch.Tensor) -> None:  # inside the backward pass, before any parameter's gradient
        states = view.param_states
        asked.append(reducer.unreached() == reducer.unreached() and view.param_states == states)

    for _ in range(2):  # two rounds: the fp32 sum of both is what the step reads
        out = model(torch.ones(4, 5))
        out.register_hook(ask)
        out.sum().backward()
    assert asked == [True, True]
    ref = _model()  # the same weights, torch's own accumulation in p.grad
    for _ in range(2):
        ref(torch.ones(4, 5)).sum().backward()
    for rec, p in zip(view.records, reversed(list(ref.parameters()))):  # buffers are laid out last layer first
        assert torch.allclose(view.local_grad[rec.local.as_slice()], p.grad.reshape(-1))
    for rec in view.records:
        rec.holds()
    assert [r.slot for r in view.records] == [GradSlot.PLACEHOLDER] * len(view.records)
    opt.close()


def test_no_table_by_parameter_or_bucket_outside_the_records() -> None:
    """tools/count_tables.py over this tree: in the reduction, step and update paths, every list or
    dict held as an attribute and indexed by parameter or bucket holds the records (or the
    parameters) themselves; a new parallel table fails here."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "tools", "count_tables.py")
    spec = importlib.util.spec_from_file_location("count_tables", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    _, per, holders = tool.count(os.path.join(os.path.dirname(__file__), ".."))
    assert [p for p in per if p not in holders] == []
    assert holders  # the tool still finds the records' own lists: it looks where it should


def test_stage1_an_empty_parameter_without_a_gradient_is_left_out_of_the_step() -> None:
    model = _model()
    empty = nn.Parameter(torch.empty(0))  # in the optimizer, never in the forward
    opt = shardopt.ShardedAdamW([*model.parameters(), empty], lr=0.1, stage=1)
    rec = next(r for r in opt.inspect().buffers[0].records if r.param is empty)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(4, 5)).sum().backward()
        opt.step()
    assert not rec.used and not rec.trained and rec.lag == 2  # as AdamW leaves a parameter without .grad
    opt.close()
