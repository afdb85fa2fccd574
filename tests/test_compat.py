"""Tier 1, one process: each torch internal of shardopt._compat removed on the pinned torch, and
its fallback checked: the same training result as torch.optim.AdamW where a slower path exists,
a clear error at construction naming the torch version where none does.
"""
from __future__ import annotations


import pytest
import torch
from torch import nn

import shardopt
from shardopt import _compat

pytestmark = pytest.mark.usefixtures("one_rank_group")  # see tests/conftest.py


def _net() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4), "side": nn.Linear(4, 4)})


def _forward(net: nn.ModuleDict, step: int) -> torch.Tensor:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
    y = net["b"](torch.relu(net["a"](x)))
    if step % 2:  # every other step the side layer takes part: a pass that skips parameters
        y = y + net["side"](x)
    return y.square().mean()


def test_without_will_engine_execute_node_every_parameter_counts_as_reached(monkeypatch):
    monkeypatch.delattr(torch._C, "_will_engine_execute_node")
    assert _compat.will_execute(object()) is True  # the fallback is in use
    model, ref = _net(), _net()
    opt = shardopt.ShardedAdamW(model.parameters(), lr=0.05, bucket_cap_mb=1e-4)  # a bucket per parameter
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for step in range(4):
        for net, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            _forward(net, step).backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    opt.close()


@pytest.mark.parametrize("internal", ["graph task id", "end-of-backward callback"])
def test_without_an_internal_that_has_no_fallback_construction_names_the_torch_version(monkeypatch, internal):
    if internal == "graph task id":
        monkeypatch.delattr(torch._C, "_current_graph_task_id")
    else:
        monkeypatch.setattr(torch.autograd.Variable, "_execution_engine", object())
    with pytest.raises(RuntimeError, match=rf"does not have; install torch {_compat.TESTED}"):
        shardopt.ShardedAdamW(_net().parameters(), lr=0.05)
