"""Tier 1, one process: each torch internal of shardopt.core._compat removed on the pinned torch, and
its fallback checked: the same training result as torch.optim.AdamW where a slower path exists,
a clear error at construction naming the torch version where none does.
"""
from __future__ import annotations


import pytest
import torch
from torch import nn

import shardopt
from shardopt.core import _compat

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
    assert _compat.will_execute_each([object()]) == [True]  # the fallback is in use
    model = _net()
    _trains_like_adamw(model, shardopt.ShardedAdamW(model.parameters(), lr=0.05, bucket_cap_mb=1e-4), 4)  # a bucket each


def _trains_like_adamw(model: nn.ModuleDict, opt: shardopt.ShardedAdamW, steps: int) -> None:
    """``steps`` steps of ``opt`` over ``model`` equal torch.optim.AdamW's over the same net; closes ``opt``."""
    ref = _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for step in range(steps):
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


@pytest.mark.parametrize("seed", range(6))
def test_checkpoint_reads_match_dcp_resharding(seed):
    """shardopt's own read planning (public DCP types only) asks for exactly the reads DCP's
    internal create_read_items_for_chunk_list computes, on random saved and wanted box layouts."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from shardopt.checkpoint._dcp import read_items

    g = torch.Generator().manual_seed(seed)
    shape = tuple(int(x) for x in torch.randint(1, 7, (1 + seed % 3,), generator=g))

    def split() -> list[tuple[tuple[int, ...], tuple[int, ...]]]:  # a random grid of boxes over shape
        cuts = [sorted({0, n, *torch.randint(0, n + 1, (2,), generator=g).tolist()}) for n in shape]
        grid = [[(a, b - a) for a, b in zip(c, c[1:])] for c in cuts]
        boxes = [((), ())]
        for dim in grid:
            boxes = [(o + (a,), s + (n,)) for o, s in boxes for a, n in dim]
        return boxes

    saved = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in split()]
    wanted = split()
    md = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size(shape), chunks=saved)
    theirs = create_read_items_for_chunk_list(
        "k", md, [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in wanted])

    def key(r) -> tuple:
        return (r.type, r.dest_index, tuple(r.dest_offsets), r.storage_index, tuple(r.storage_offsets), tuple(r.lengths))

    ours = read_items("k", saved, wanted)
    assert len(ours) >= len(wanted)
    assert sorted(map(key, ours), key=repr) == sorted(map(key, theirs), key=repr)


@pytest.mark.parametrize("internal", ["wrapper subclass", "disabled torch function", "version counter",
                                      "compiled wrapper"])
def test_without_the_placeholder_or_wrapper_internals_construction_names_the_torch_version(monkeypatch, internal):
    from torch._dynamo.eval_frame import OptimizedModule

    original_init = OptimizedModule.__init__

    def init_elsewhere(self, *args, **kwargs):  # a wrapper that keeps the module under another name
        return original_init(self, *args, **kwargs)

    if internal == "wrapper subclass":
        monkeypatch.setattr(torch.Tensor, "_make_wrapper_subclass", None)
    elif internal == "disabled torch function":
        monkeypatch.delattr(torch._C, "_disabled_torch_function_impl")
    elif internal == "version counter":
        monkeypatch.setattr(torch.Tensor, "_version", None)
    else:
        monkeypatch.setattr(OptimizedModule, "__init__", init_elsewhere)
    with pytest.raises(RuntimeError, match=rf"does not have; install torch {_compat.TESTED}"):
        shardopt.ShardedAdamW(_net().parameters(), lr=0.05)


def test_an_out_of_place_accumulation_into_the_stage2_placeholder_says_to_zero_first():
    """AccumulateGrad adds out of place under create_graph=True (as compiled autograd may): the
    placeholder cannot, and the error says what to do; zeroing first makes the same pass work."""
    net = _net()
    opt = shardopt.ShardedAdamW(net.parameters(), lr=0.05, stage=2)
    _forward(net, 0).backward()
    with pytest.raises(RuntimeError, match=r"out of place .*create_graph=True, or compiled autograd.*opt.zero_grad"):
        _forward(net, 0).backward(create_graph=True)
    opt.zero_grad()
    _forward(net, 0).backward(create_graph=True)
    opt.step()
    opt.close()


def test_the_control_groups_timeout_is_its_parents_or_torchs_default():
    import datetime
    from types import SimpleNamespace

    made = datetime.timedelta(seconds=77)
    parent = SimpleNamespace(_get_backend=lambda device: SimpleNamespace(options=SimpleNamespace(_timeout=made)))
    assert _compat.group_timeout(parent) == made
    assert _compat.group_timeout(object()) == datetime.timedelta(minutes=30)  # where the backend is hidden


# The dicts torch keeps hooks in: shardopt removes its hooks through their RemovableHandles only.
_TORCH_HOOK_DICTS = {"_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_hooks",
                     "_global_backward_pre_hooks", "_post_accumulate_grad_hooks", "_forward_pre_hooks",
                     "_forward_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_pre_hooks",
                     "_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"}


def reaches_into_torch(root: str) -> list[str]:
    """``file:line: code`` for every assignment to an object's ``__class__`` and every use of one of
    torch's hook dicts in the package's modules (their syntax trees, comments and strings aside)."""
    import ast
    from pathlib import Path

    found = []
    package = Path(root) / "shardopt"
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            swap = isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
                isinstance(t, ast.Attribute) and t.attr == "__class__"
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                for t in ast.walk(target))
            setattr_swap = (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr"
                            and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                            and node.args[1].value == "__class__")
            hook_dict = (isinstance(node, ast.Attribute) and node.attr in _TORCH_HOOK_DICTS) or (
                isinstance(node, ast.Constant) and node.value in _TORCH_HOOK_DICTS)
            if swap or setattr_swap or hook_dict:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return found


def test_no_class_swap_and_no_torch_hook_dict_in_the_package(tmp_path) -> None:
    """No live object's class is swapped (``type(p) is nn.Parameter`` holds, dynamo's guards see what
    torch made) and no torch hook dict is read or changed: hooks go through RemovableHandles. The
    scan finds both kinds where they are (a copy of the package with one of each added). One
    exception, by name: ``group._rounds._rewire_hooks`` assigns a parameter's post-accumulate-grad
    hook dict to itself, unchanged, which is how torch wires it into the parameter's autograd data
    again after a ``torch.utils.swap_tensors`` (``model.to`` of a DTensor parameter) left it wired to
    the swapped-out tensor; no public call does that."""
    import inspect
    import os
    import shutil

    from shardopt.group._rounds import _rewire_hooks

    root = os.path.join(os.path.dirname(__file__), "..")
    first = inspect.getsourcelines(_rewire_hooks)[1]
    rewire = range(first, first + len(inspect.getsourcelines(_rewire_hooks)[0]))

    def outside_rewire(where: str) -> list[str]:
        return [f for f in reaches_into_torch(where)
                if not (f.startswith(os.path.join("shardopt", "group", "_rounds.py") + ":")
                        and int(f.split(":")[1]) in rewire)]

    assert outside_rewire(root) == []
    shutil.copytree(os.path.join(root, "shardopt"), tmp_path / "shardopt", ignore=shutil.ignore_patterns("__pycache__"))
    bad = tmp_path / "shardopt" / "core" / "_ownership.py"
    bad.write_text(bad.read_text() + "\n\ndef _bad(p, m):\n    p.__class__ = object\n"
                   "    getattr(m, '_forward_pre_hooks').clear()\n    m._post_accumulate_grad_hooks.pop(0)\n")
    assert len(outside_rewire(str(tmp_path))) == 3


def test_without_the_mode_stack_functions_overlap_is_refused_and_the_rest_trains(monkeypatch):
    monkeypatch.delattr(torch._C, "_push_on_torch_function_stack")
    with pytest.raises(RuntimeError, match=r"overlap_param_gather=True needs torch\._C\._push_on_torch_function_stack, "
                                           r"which torch .* leave overlap_param_gather off"):
        shardopt.ShardedAdamW(_net().parameters(), lr=0.05, overlap_param_gather=True)
    model = _net()
    _trains_like_adamw(model, shardopt.ShardedAdamW(model.parameters(), lr=0.05), 2)


class _Mode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _stack() -> list:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def test_a_mode_inserted_at_the_bottom_lets_every_other_mode_leave_as_its_own():
    """What the read guard of group._gather_wait needs from the mode-stack functions: it goes beneath
    the modes entered before it (a ``with torch.device`` block, a user's mode), which then leave
    with their own ``__exit__`` (it pops the top one); above ``torch.set_default_device``'s, which
    must be at the bottom when it leaves; and it comes out from wherever it is."""
    guard, user = _Mode(), _Mode()
    with torch.device("cpu"), user:
        device = _stack()[0]
        _compat.insert_function_mode(guard)
        assert _stack() == [guard, device, user]
    assert _stack() == [guard]
    with _Mode() as later:  # entered after it: above it, and it can leave from beneath
        assert _compat.remove_function_mode(guard) and _stack() == [later]
    assert not _compat.remove_function_mode(guard) and _stack() == []
    try:
        torch.set_default_device("cpu")
        default = _stack()[0]
        _compat.insert_function_mode(guard)
        assert _stack() == [default, guard]
        torch.set_default_device("meta")  # leaves and enters at the bottom: no error, the guard kept above
        assert len(_stack()) == 2 and _stack()[1] is guard and torch.empty(1).device.type == "meta"
    finally:
        torch.set_default_device(None)
    assert _stack() == [guard]
    assert _compat.remove_function_mode(guard) and _stack() == []
