"""Tier 1, one process: the per-parameter and per-bucket records (shardopt.core._records).

Catches records whose ranges disagree with the layout's own index math, a state that changes
without its guard (also under ``python -O``), a record that says p.grad holds something other than
what it holds, a question that changes what it asks about, and a record field written outside the
record's own verbs.
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
    group = opt._buffers[0]
    asked = []

    def ask(grad: torch.Tensor) -> None:  # inside the backward pass, before any parameter's gradient
        states = view.param_states
        asked.append(group.unreached() == group.unreached() and view.param_states == states)

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


def _record_fields() -> set[str]:
    import dataclasses

    from shardopt.core._records import BucketRecord, HostCopy, ParamRecord

    return {f.name for c in (ParamRecord, BucketRecord, HostCopy) for f in dataclasses.fields(c)}


def record_field_writes(root: str) -> list[str]:
    """Every assignment (plain, augmented, annotated, tuple, or ``del``) in the package's modules
    to an attribute named like a field of a record, on an object other than ``self`` (a class's
    own attribute of the same name is its own), outside ``core/_records.py``: ``file:line: code``."""
    import ast
    from pathlib import Path

    fields, found = _record_fields(), []
    package = Path(root) / "shardopt"
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).as_posix() == "core/_records.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for t in ast.walk(target):
                    if (isinstance(t, ast.Attribute) and t.attr in fields and isinstance(t.ctx, (ast.Store, ast.Del))
                            and not (isinstance(t.value, ast.Name) and t.value.id == "self")):
                        found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return found


def test_record_fields_change_only_through_the_records_own_verbs() -> None:
    """Each field of ParamRecord, BucketRecord and HostCopy is written in core/_records.py only
    (build_records and the records' verbs); every other module calls a verb. The one exception is
    the torch attribute ``.grad`` of a parameter (``r.param.grad = ...``), which is torch's, not a
    record field: no record field is named ``grad``."""
    import os

    assert "grad" not in _record_fields()  # see the docstring: p.grad writes must stay distinguishable
    root = os.path.join(os.path.dirname(__file__), "..")
    assert record_field_writes(root) == []


def test_record_field_writes_are_found(tmp_path) -> None:
    """The scan above finds a write where there is one: a copy of the package with one added."""
    import os
    import shutil

    src = os.path.join(os.path.dirname(__file__), "..", "shardopt")
    shutil.copytree(src, tmp_path / "shardopt", ignore=shutil.ignore_patterns("__pycache__"))
    before = record_field_writes(str(tmp_path))
    target = tmp_path / "shardopt" / "group" / "_intake.py"
    target.write_text(target.read_text() + "\n\ndef _bad(r):\n    r.lag += 1\n    b, r.used = 1, True\n")
    found = [f for f in record_field_writes(str(tmp_path)) if f not in before]
    assert len(found) == 2 and all("group/_intake.py" in f for f in found), found


_TRANSITIONS_UNDER_O = """
import pytest, torch
from torch import nn
from shardopt.core._layout import build_layout
from shardopt.core._records import BucketState, ParamState, build_records
params = list(nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)).parameters())
records, buckets = build_records(params, ["a"] * len(params), [0] * len(params),
                                 build_layout([p.shape for p in params], 1), 0, 0)
r, b = records[0], buckets[0]
r.to(ParamState.TAKEN)
with pytest.raises(AssertionError, match="cannot go from ParamState.TAKEN to ParamState.ABSENT"):
    r.to(ParamState.ABSENT)
with pytest.raises(AssertionError, match="cannot go from BucketState.WAITING to BucketState.LANDED"):
    b.to(BucketState.LANDED)
assert __debug__ is False  # really under -O: a bare assert would have been removed
print("guarded")
"""


@pytest.mark.launch
def test_the_transitions_stay_guarded_under_python_O() -> None:
    """``python -O`` removes ``assert`` statements: the records' guards are explicit raises."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-O", "-c", _TRANSITIONS_UNDER_O], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "guarded", out.stderr[-2000:]
