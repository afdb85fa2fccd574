"""Tiers 1 and 2: sharded checkpoints, resharding, the torch.optim.AdamW format and the converter.

Tier 1 (no process group): the cutting of flat pieces into N-D blocks, on every range of small
odd shapes. Tier 2 (real gloo ranks; one pool of 4, smaller worlds are subgroups of it): a
checkpoint saved at one world size loads at another (2 -> 1, 3, 4 and back) with the stage and
bucket size changed, for fp32, bf16 and fp16 weights and every master-weight mode on offer, after
a skipped step and with a growing loss scale; ``full_state_dict`` against a plain
``torch.optim.AdamW``; partial, corrupt and foreign checkpoints refused on every rank; paths
with a trailing slash, ``./`` or ``~`` saved and found under one name; the converter, with no
process group, in bounded memory, refusing what load_checkpoint refuses (a flipped bit); a tensor
``lr`` through a checkpoint, both state-dict formats and the converter, against torch's AdamW.

Catches: lost or misplaced pieces of parameters cut by shard boundaries (a rank's middle piece,
an empty piece, a scalar), pieces deduplicated as if replicated, padding that leaks into weights,
state that does not survive a change of world size, stage or bucket size (moments, step, skipped
steps, loss scale, the stochastic-rounding seed), a half-written checkpoint taken for a good one,
a path written with a trailing slash that saved into itself and then could not be found, and a
tensor ``lr`` that came back a float (a resume 7e-9 off).

Every rank trains on the same data, so the gradient average equals the local gradient and a run
does not depend on the world size. That makes an uninterrupted run the reference: bit for bit
where averaging is exact (1, 2 and 4 ranks: a sum of 1, 2 or 4 equal numbers in rank order,
divided by a power of two), within the rounding of x + x + x at 3 ranks. The state right after
loading is always compared bit for bit.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import shardopt
from models import batch, make_model, param_groups
from shardopt.checkpoint._blocks import boxes
from shardopt.core._layout import Range
from shardopt.checkpoint import (full_state_dict, latest_checkpoint, list_checkpoints, load_checkpoint,
                                 load_full_state_dict, save_checkpoint)
from shardopt.convert import convert_checkpoint
from shardopt.master import STRATEGIES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def reference_kernel():
    """Ranks spawned by this module use the reference update kernel: compiling the fused one costs
    seconds per process, and checkpoints do not depend on which kernel ran."""
    old = os.environ.get("SHARDOPT_KERNEL")
    os.environ["SHARDOPT_KERNEL"] = "reference"
    yield
    if old is None:
        del os.environ["SHARDOPT_KERNEL"]
    else:
        os.environ["SHARDOPT_KERNEL"] = old

K, STEPS = 3, 6  # save after K steps, compare after STEPS
POOL = 4  # one pool of 4 ranks; smaller worlds are subgroups of its first ranks
_GROUPS: dict[int, object] = {}


def _group(world: int):
    """The process group of the pool's first ``world`` ranks, or None on the ranks outside it.
    Every rank of the pool calls this (``new_group`` is collective), in the same order."""
    if world not in _GROUPS:
        _GROUPS[world] = dist.new_group(list(range(world)))
    return _GROUPS[world] if dist.get_rank() < world else None


def _run(pools, world: int, fn, *args, **kwargs) -> list:
    """``fn(group, *args)`` on ``world`` ranks; their results in rank order."""
    return pools(POOL).run(_in_group, world, fn, *args, **kwargs)[:world]


def _in_group(world: int, fn, *args):
    group = _group(world)
    return None if group is None else fn(group, *args)


# -- tier 1 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 4), (2, 3, 5), (4, 1, 3), (1, 1), (2, 1, 2, 3)])
def test_boxes_tile_every_flat_range(shape):
    numel = math.prod(shape)
    full = torch.arange(numel).view(shape)
    for a in range(numel + 1):
        for b in range(a, numel + 1):
            got = boxes(shape, Range(a, b))
            assert len(got) <= max(1, 2 * len(shape) - 1), (shape, a, b, got)
            flat = [full[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1) for off, size in got]
            assert torch.equal(torch.cat(flat) if flat else torch.zeros(0, dtype=torch.long), torch.arange(a, b))


def test_a_checkpoint_path_is_written_one_way(tmp_path, monkeypatch):
    """The form every checkpoint function takes a path in (checkpoint._files [Note: how a
    checkpoint path is written]): what a save returns and a listing finds."""
    from shardopt.checkpoint._files import checkpoint_path

    monkeypatch.setenv("HOME", str(tmp_path))
    assert checkpoint_path("ckpt/step_1/") == checkpoint_path("./ckpt//step_1") == "ckpt/step_1"
    assert checkpoint_path("ckpt/./step_1/.") == "ckpt/step_1"
    assert checkpoint_path(tmp_path / "ckpt") == str(tmp_path / "ckpt")  # os.PathLike
    assert checkpoint_path("~/ckpt/") == str(tmp_path / "ckpt")
    assert checkpoint_path("ckpt/../other") == "ckpt/../other"  # with a symlink, not the same as "other"
    monkeypatch.chdir(tmp_path)
    assert checkpoint_path(".") == str(tmp_path) and checkpoint_path("a/..") == str(tmp_path)


# -- tier 2: resharding ------------------------------------------------------------------------
# name: (dtype, master_weights, stage and bucket_cap_mb when saved, stage and bucket_cap_mb when loaded)
CONFIGS = {
    "fp32-stage1": ("float32", "fp32", (1, 1e-4), (1, 1e-4)),
    "fp32-stage2-rebucket": ("float32", "fp32", (2, 1e-4), (2, 25.0)),
    "bf16-stage1-to-2": ("bfloat16", "fp32", (1, 25.0), (2, 1e-4)),
    "bf16-stage2-to-1": ("bfloat16", "fp32", (2, 1e-4), (1, 25.0)),
    # The scale grows every clean step; it stays far below fp16 overflow, which would depend on the
    # world size (averaging sums the ranks' fp16 gradients first).
    "fp16-dynamic-scale": ("float16", "fp32", (2, 1e-4), (1, 1e-4)),
}
SCALER = {"float16": dict(init_scale=2.0**4, growth_interval=1)}
POISON = 1  # step whose loss is made inf in save_case: a skipped step before the checkpoint
for _mode in ("remainder", "stochastic"):  # the modes this version offers
    if _mode in STRATEGIES:
        CONFIGS[f"bf16-{_mode}"] = ("bfloat16", _mode, (2, 1e-4), (2, 25.0))
SEED = {"seed": 5} if "stochastic" in STRATEGIES else {}  # saved runs only: the checkpoint restores it


def _build(group, cfg: tuple, which: int, seed: int):
    dtype, master, *stages = cfg
    stage, cap = stages[which]
    model = make_model(seed=seed, dtype=getattr(torch, dtype))
    scaler = shardopt.DynamicScaler(**SCALER[dtype]) if dtype in SCALER else "auto"
    opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, stage=stage,
                                master_weights=master, bucket_cap_mb=cap, process_group=group, loss_scale=scaler,
                                **(SEED if which == 0 else {}))
    return model, opt


def _train(model, opt, steps, poison: int | None = None) -> None:
    for step in steps:  # the same batch on every rank
        opt.zero_grad()
        loss = model(batch(0, step))
        opt.backward(loss * float("inf") if step == poison else loss)
        opt.step()


def _counters(opt) -> tuple:
    return opt.step_count, opt.skipped_steps, opt.loss_scale, opt.inspect().scaler_state


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save_case(group, root: str) -> dict:
    """Train K steps, save, keep going to STEPS: the state at K and the uninterrupted result."""
    out = {}
    for name, cfg in CONFIGS.items():
        model, opt = _build(group, cfg, 0, seed=3)
        _train(model, opt, range(K), poison=POISON)
        assert opt.skipped_steps == 1
        save_checkpoint(os.path.join(root, name), model, opt)
        at_k, fsd, counters = _weights(model), full_state_dict(opt), _counters(opt)
        _train(model, opt, range(K, STEPS))
        out[name] = (at_k, fsd, counters, _weights(model))
    return out if dist.get_rank(group) == 0 else {}


def load_case(group, root: str) -> dict:
    """Load each checkpoint into a differently initialised model, then continue to STEPS."""
    out = {}
    for name, cfg in CONFIGS.items():
        model, opt = _build(group, cfg, 1, seed=4)
        load_checkpoint(os.path.join(root, name), model, opt)
        at_k, fsd, counters = _weights(model), full_state_dict(opt), _counters(opt)
        _train(model, opt, range(K, STEPS))
        out[name] = (at_k, fsd, counters, _weights(model))
    return out  # every rank's: all must hold the same weights


TOLERANCE_3_RANKS = {torch.float32: 1e-6, torch.bfloat16: 2e-3, torch.float16: 5e-4}


@pytest.fixture(scope="module")
def saved_at(pools, tmp_path_factory):
    """``saved_at(world)``: (directory, rank 0's ``save_case`` result), saved once per world size."""
    cache: dict[int, tuple[str, dict]] = {}

    def get(world: int) -> tuple[str, dict]:
        if world not in cache:
            root = str(tmp_path_factory.mktemp(f"saved_at_{world}"))
            cache[world] = root, _run(pools, world, save_case, root)[0]
        return cache[world]
    return get


@pytest.mark.parametrize("save_world,load_world", [(2, 1), (2, 3), (2, 4), (1, 2), (3, 2), (4, 2)])
def test_reshard_and_continue_equals_uninterrupted_run(pools, saved_at, save_world, load_world):
    root, saved = saved_at(save_world)
    exact = 3 not in (save_world, load_world)
    for rank, loaded in enumerate(_run(pools, load_world, load_case, root)):
        for name, (at_k, fsd, counters, end) in loaded.items():
            ref_k, ref_fsd, ref_counters, ref_end = saved[name]
            assert counters == ref_counters, (name, rank)  # steps, skipped steps, loss scaler
            for key in ref_k:  # the state right after loading: bit for bit
                assert torch.equal(at_k[key], ref_k[key]), (name, rank, key)
            if rank == 0:
                assert fsd["param_groups"] == ref_fsd["param_groups"], name
                for i, s in ref_fsd["state"].items():
                    for k, v in s.items():
                        assert torch.equal(fsd["state"][i][k], v), (name, i, k)
            for key in ref_end:
                diff = (end[key].float() - ref_end[key].float()).abs().max().item()
                # 3 ranks: the averaging rounds, x + x + x != 3x; a difference of rounding, not of state.
                assert diff == 0 if exact else diff <= TOLERANCE_3_RANKS[end[key].dtype], (name, rank, key, diff)


def consolidate_case(group, root: str) -> None:
    """``save_case``'s runs, saved the way frameworks save an optimizer: ``consolidate_state_dict``,
    then ``state_dict()`` written by rank 0 alone, next to the model's weights."""
    for name, cfg in CONFIGS.items():
        model, opt = _build(group, cfg, 0, seed=3)
        _train(model, opt, range(K), poison=POISON)
        opt.consolidate_state_dict()
        if dist.get_rank(group) == 0:
            torch.save({"model": _weights(model), "optim": opt.state_dict()}, os.path.join(root, name + ".pt"))


def load_consolidated_case(group, root: str) -> dict:
    """Every rank loads the same file into a differently initialised model, then goes on to STEPS."""
    out = {}
    for name, cfg in CONFIGS.items():
        model, opt = _build(group, cfg, 1, seed=4)
        saved = torch.load(os.path.join(root, name + ".pt"), weights_only=True)
        opt.load_state_dict(saved["optim"])  # before the weights: either order keeps the exact master
        model.load_state_dict(saved["model"])
        counters = _counters(opt)
        _train(model, opt, range(K, STEPS))
        out[name] = (counters, _weights(model))
    return out


@pytest.mark.parametrize("load_world", [1, 3])
def test_consolidated_state_dict_resumes_at_another_world_size(pools, saved_at, tmp_path, load_world):
    _, saved = saved_at(2)
    _run(pools, 2, consolidate_case, str(tmp_path))
    plain = torch.load(os.path.join(tmp_path, "bf16-stage1-to-2.pt"), weights_only=True)["optim"]
    torch.optim.AdamW(param_groups(make_model(dtype=torch.bfloat16))).load_state_dict(plain)  # still AdamW's format
    for rank, loaded in enumerate(_run(pools, load_world, load_consolidated_case, str(tmp_path))):
        for name, (counters, end) in loaded.items():
            _, _, ref_counters, ref_end = saved[name]
            assert counters == ref_counters, (name, rank)
            for key in ref_end:
                diff = (end[key].float() - ref_end[key].float()).abs().max().item()
                assert diff == 0 if load_world == 1 else diff <= TOLERANCE_3_RANKS[end[key].dtype], (name, key, diff)


# -- tier 2: torch.optim.AdamW format --------------------------------------------------------------
def adamw_case(group, path: str) -> dict:
    """K steps, export, then one more step here and in a plain AdamW on rank 0."""
    model, opt = _build(group, CONFIGS["fp32-stage2-rebucket"], 0, seed=5)
    _train(model, opt, range(K))
    fsd = full_state_dict(opt)
    weights = _weights(model)
    if dist.get_rank(group) == 0:
        torch.save({"model": weights, "optim": fsd}, path)
    ref = make_model(seed=0) if dist.get_rank(group) == 0 else None
    if ref is not None:
        ref.load_state_dict(weights)
    _train(model, opt, [K])
    out = {"mine": _weights(model), "fsd_after": full_state_dict(opt)}
    if ref is not None:
        ref_opt = torch.optim.AdamW(param_groups(ref), lr=0.5)  # hyperparameters come from the state dict
        ref_opt.load_state_dict(fsd)
        ref.zero_grad()
        ref(batch(0, K)).backward()  # the unused parameter keeps grad=None: no state, no update, in both
        ref_opt.step()
        out["ref"], out["ref_state"] = _weights(ref), ref_opt.state_dict()
    return out


def adamw_import_case(group, path: str) -> dict:
    """Load the exported state at this world size, then take the same extra step."""
    model, opt = _build(group, CONFIGS["fp32-stage2-rebucket"], 1, seed=6)
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    load_full_state_dict(opt, saved["optim"] if dist.get_rank(group) == 0 else {})
    again = full_state_dict(opt)
    _train(model, opt, [K])
    return {"again": again, "after": _weights(model)}


def test_full_state_dict_round_trips_through_torch_adamw(pools, tmp_path):
    path = str(tmp_path / "adamw.pt")
    out = _run(pools, 2, adamw_case, path)[0]
    for key, ref in out["ref"].items():
        assert (out["mine"][key] - ref).abs().max() <= 2e-6, key
    assert out["ref_state"]["param_groups"] == out["fsd_after"]["param_groups"]
    for i, s in out["ref_state"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert (s[k] - out["fsd_after"]["state"][i][k]).abs().max() <= 1e-7, (i, k)
        assert float(s["step"]) == float(out["fsd_after"]["state"][i]["step"]) == K + 1
    exported = torch.load(path, weights_only=True)["optim"]
    for world in (3, 1):
        got = _run(pools, world, adamw_import_case, path)
        again = got[0]["again"]
        assert again["param_groups"] == exported["param_groups"]
        for i, s in exported["state"].items():
            for k, v in s.items():
                assert torch.equal(again["state"][i][k], v), (world, i, k)
        for r in got:
            for key, ref in out["mine"].items():
                assert (r["after"][key] - ref).abs().max() <= (0 if world == 1 else 1e-5), (world, key)


# -- tier 2: refusals -------------------------------------------------------------------------------
def save_steps_case(group, root: str, steps: list[int]) -> dict:
    model, opt = _build(group, CONFIGS["bf16-stage2-to-1"], 0, seed=7)
    done = 0
    for step in steps:
        _train(model, opt, range(done, step))
        done = step
        save_checkpoint(os.path.join(root, f"step_{step:05d}"), model, opt, extra={"step": step})
    return {"weights": _weights(model), "fsd": full_state_dict(opt)}


def load_error_case(group, path: str, hidden: int) -> tuple[str, str] | None:
    model = make_model(seed=1, dtype=torch.bfloat16, hidden=hidden)
    opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, process_group=group)
    try:
        load_checkpoint(path, model, opt)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return None


def save_error_case(group, path: str) -> tuple[str, str] | None:
    model = make_model(seed=1)
    opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, process_group=group)
    try:
        save_checkpoint(path, model, opt)
    except (FileExistsError, ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return None


def test_partial_corrupt_or_foreign_checkpoints_are_refused_on_every_rank(pools, tmp_path):
    root = str(tmp_path)
    _run(pools, 2, save_steps_case, root, [1, 2])
    good = os.path.join(root, "step_00002")
    assert list_checkpoints(root) == [os.path.join(root, "step_00001"), good]

    def variant(name: str, damage) -> str:
        path = os.path.join(root, "bad", name)
        shutil.copytree(good, path)
        damage(path)
        return path

    no_marker = variant("no_marker", lambda p: os.remove(os.path.join(p, "complete.json")))
    no_shard = variant("no_shard", lambda p: os.remove(os.path.join(p, "__1_0.distcp")))
    truncated = variant("truncated", lambda p: os.truncate(os.path.join(p, "__0_0.distcp"), 100))
    cases = {  # path, hidden size of the model, expected error, text it must contain
        "no_marker": (no_marker, 29, "FileNotFoundError", os.path.join(no_marker, "complete.json")),
        "no_shard": (no_shard, 29, "FileNotFoundError", os.path.join(no_shard, "__1_0.distcp")),
        "truncated": (truncated, 29, "ValueError", os.path.join(truncated, "__0_0.distcp")),
        "absent": (os.path.join(root, "nothing"), 29, "FileNotFoundError", "does not exist"),
        "other_model": (good, 30, "ValueError", "'fc1.weight'"),
    }
    for name, (path, hidden, kind, needle) in cases.items():
        for rank, got in enumerate(_run(pools, 3, load_error_case, path, hidden, timeout=60)):
            assert got is not None and got[0] == kind and needle in got[1], (name, rank, got)
    # An interrupted save's directory is never listed; the good ones still load.
    os.rename(no_marker, os.path.join(root, "step_00003.tmp-0123abcd"))
    assert latest_checkpoint(root) == good
    assert _run(pools, 2, load_error_case, good, 29) == [None, None]
    # A save replaces a checkpoint, never anything else.
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    for got in _run(pools, 2, save_error_case, str(tmp_path / "notes")):
        assert got is not None and got[0] == "FileExistsError" and "notes" in got[1], got
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    assert _run(pools, 2, save_error_case, good) == [None, None]


# -- tier 2: how a path is written ---------------------------------------------------------------------
def paths_case(group, root: str) -> dict:
    model, opt = _build(group, CONFIGS["bf16-stage2-to-1"], 0, seed=7)
    ckpt = os.path.join(root, "ckpt")
    saved = []
    _train(model, opt, range(1))
    saved.append(save_checkpoint(ckpt + "/step_1/", model, opt))  # a trailing slash
    _train(model, opt, range(1, 2))
    saved.append(save_checkpoint(f"{root}/./ckpt//step_2", model, opt))
    home = os.environ["HOME"]
    os.environ["HOME"] = root
    try:
        _train(model, opt, range(2, 3))
        saved.append(save_checkpoint("~/ckpt/step_3", model, opt))
    finally:
        os.environ["HOME"] = home
    if dist.get_rank() == 0:  # what a save given "ckpt/step_4/" left inside it, before paths were written one way
        os.makedirs(os.path.join(ckpt, "step_4", ".tmp-0123abcd"))
        with open(os.path.join(ckpt, "step_4", ".tmp-0123abcd", "__0_0.distcp"), "wb") as f:
            f.write(b"x")
    dist.barrier(group)
    _train(model, opt, range(3, 4))
    saved.append(save_checkpoint(os.path.join(ckpt, "step_4"), model, opt))
    weights = _weights(model)
    load_checkpoint(ckpt + "/step_4/", model, opt)
    return {"saved": saved, "latest": latest_checkpoint(ckpt + "/"), "listed": list_checkpoints(f"{root}/./ckpt//"),
            "same": all(torch.equal(w, model.state_dict()[k]) for k, w in weights.items())}


def test_paths_with_a_trailing_slash_dots_or_a_tilde_save_and_are_found(pools, tmp_path):
    """``save_checkpoint("ckpt/step_1/")`` wrote every shard and then failed to rename the
    directory into itself (OSError: [Errno 22]), leaving ``step_1/.tmp-*``; the next save to
    ``ckpt/step_1`` refused the directory as foreign, and ``latest_checkpoint`` found nothing."""
    root = str(tmp_path)
    expected = [os.path.join(root, "ckpt", f"step_{i}") for i in (1, 2, 3, 4)]
    for rank, got in enumerate(_run(pools, 2, paths_case, root)):
        assert got["saved"] == got["listed"] == expected and got["latest"] == expected[-1], (rank, got)
        assert got["same"], rank
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_1", "step_2", "step_3", "step_4"]
    assert ".tmp-0123abcd" not in os.listdir(tmp_path / "ckpt" / "step_4")


# -- tier 2 + converter: no process group, bounded memory ---------------------------------------------
def test_converter_writes_plain_state_dicts(pools, tmp_path):
    root = str(tmp_path)
    ref = _run(pools, 2, save_steps_case, root, [2])[0]
    out = str(tmp_path / "plain.pt")
    convert_checkpoint(os.path.join(root, "step_00002"), out)  # this process has no process group
    assert not dist.is_initialized()
    plain = torch.load(out, weights_only=True)
    assert plain["model"].keys() == ref["weights"].keys()
    for key, w in ref["weights"].items():
        assert plain["model"][key].dtype == w.dtype and torch.equal(plain["model"][key], w), key
    assert plain["optim"]["param_groups"] == ref["fsd"]["param_groups"]
    for i, s in ref["fsd"]["state"].items():
        for k, v in s.items():
            assert torch.equal(plain["optim"]["state"][i][k], v), (i, k)
    model = make_model(seed=9, dtype=torch.bfloat16)
    model.load_state_dict(plain["model"])
    torch.optim.AdamW(param_groups(model)).load_state_dict(plain["optim"])
    # The fp32 master as weights, two ways: the converter, and loading into an fp32 model without optimizer.
    convert_checkpoint(os.path.join(root, "step_00002"), out, fp32_weights=True)
    master = torch.load(out, weights_only=True)["model"]
    for rank, weights in enumerate(_run(pools, 3, model_only_case, os.path.join(root, "step_00002"))):
        for key, w in master.items():
            assert w.dtype == weights[key].dtype == torch.float32 and torch.equal(weights[key], w), (rank, key)


def _assert_converted(out: str, ref: dict) -> None:
    plain = torch.load(out, weights_only=True)
    assert plain["model"].keys() == ref["weights"].keys()
    for key, w in ref["weights"].items():
        assert torch.equal(plain["model"][key], w), key
    for i, s in ref["fsd"]["state"].items():
        for k, v in s.items():
            assert torch.equal(plain["optim"]["state"][i][k], v), (i, k)


def test_converter_finds_a_checkpoint_as_load_checkpoint_does(pools, tmp_path, monkeypatch, capsys):
    """The converter took its path as written: ``~`` stayed a directory named ``~``, a commit that a
    kill interrupted between its renames was not finished (``no checkpoint at ...``), the CLI
    re-read a path it had not resolved, and a directory of checkpoints was called an interrupted
    save. Each is compared with the live optimizer's weights and full_state_dict()."""
    from shardopt.convert import main

    root = str(tmp_path / "ckpt")
    ref = _run(pools, 2, save_steps_case, root, [1, 2])[0]
    step = os.path.join(root, "step_00002")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for given, found in (("~/ckpt/step_00002/", step), ("./ckpt//step_00002", "ckpt/step_00002"),
                         ("ckpt/step_00002/.", "ckpt/step_00002")):
        assert convert_checkpoint(given, "~/plain.pt") == found, given
        _assert_converted(str(tmp_path / "plain.pt"), ref)
        os.remove(tmp_path / "plain.pt")
    os.rename(step, step + ".tmp-0123abcd")  # killed between the renames of its commit: complete, not renamed yet
    assert convert_checkpoint(step, str(tmp_path / "plain.pt")) == step and os.path.isdir(step)
    _assert_converted(str(tmp_path / "plain.pt"), ref)
    main(["~/ckpt/step_00002/", "~/cli.pt"])
    assert f"wrote {tmp_path / 'cli.pt'} from {step}:" in capsys.readouterr().out
    _assert_converted(str(tmp_path / "cli.pt"), ref)
    with pytest.raises(FileNotFoundError, match=f"ckpt is not a checkpoint but a directory of 2 .*the latest, {step}"):
        convert_checkpoint("~/ckpt/", str(tmp_path / "never.pt"))
    with pytest.raises(SystemExit):
        main(["ckpt", "never.pt"])
    assert f"the latest, {os.path.join('ckpt', 'step_00002')}" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "never.pt")


def _flip_first_data_byte(path: str, name: str = "__0_0.distcp") -> None:
    """XOR 0x01 into the first byte of the data of the first tensor DCP stored in ``name`` (each
    tensor is a ``torch.save`` zip archive there; its data the ``data/0`` record): the file keeps its
    size, and the archive still reads, as a flipped bit on a disk does."""
    import io
    import struct
    import zipfile

    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(path).read_metadata().storage_data
    offset, length = min((s.offset, s.length) for s in storage.values() if s.relative_path == name)
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(offset)
        item = f.read(length)
        record = next(e for e in zipfile.ZipFile(io.BytesIO(item)).infolist() if e.filename.endswith("/data/0"))
        name_len, extra_len = struct.unpack("<HH", item[record.header_offset + 26:record.header_offset + 30])
        at = offset + record.header_offset + 30 + name_len + extra_len  # past the record's local header
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))


def test_the_converter_refuses_a_flipped_bit_as_load_checkpoint_does(pools, tmp_path, capsys):
    """The converter checked the files' sizes and the small files' hashes, never the tensor files'
    CRCs: a bit flipped in a shard converted silently into wrong state, while load_checkpoint
    refused the same checkpoint. Both must raise the same ValueError, naming the file."""
    from shardopt.convert import main

    root = str(tmp_path)
    _run(pools, 2, save_steps_case, root, [2])
    flipped = str(tmp_path / "flipped")
    shutil.copytree(os.path.join(root, "step_00002"), flipped)
    _flip_first_data_byte(flipped)
    loads = _run(pools, 2, load_error_case, flipped, 29)
    shard = os.path.join(flipped, "__0_0.distcp")
    for rank, got in enumerate(loads):  # the reference: load_checkpoint refuses it on every rank
        assert got is not None and got[0] == "ValueError" and shard in got[1], (rank, got)
    out = str(tmp_path / "plain.pt")
    with pytest.raises(ValueError) as refused:
        convert_checkpoint(flipped, out)
    assert str(refused.value) == loads[0][1]  # rank 0 checks __0_0.distcp: its own words
    with pytest.raises(SystemExit):
        main([flipped, out])
    assert shard in capsys.readouterr().err
    assert not os.path.exists(out)


# -- tier 2: a tensor lr through every format ---------------------------------------------------------
def _lr_groups(model) -> list[dict]:
    """A group on the optimizer's tensor lr, and one with a float lr of its own."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2]},
            {"params": [p for p in model.parameters() if p.dim() < 2], "lr": 5e-3, "weight_decay": 0.0}]


def _lr_optimizer(model, group=None):
    """ShardedAdamW (``group``: its process group) or torch's single-tensor AdamW with a tensor
    ``lr``, under a StepLR (which keeps ``initial_lr`` a tensor too)."""
    hp = dict(lr=torch.tensor(1e-2), weight_decay=0.1)
    opt = (shardopt.ShardedAdamW(_lr_groups(model), **hp, process_group=group) if group is not None else
           torch.optim.AdamW(_lr_groups(model), **hp, foreach=False))
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)


def _lr_train(model, opt, sched, steps) -> None:
    for step in steps:  # the same batch on every rank: the average is the batch's own gradient
        opt.zero_grad()
        loss = model(batch(0, step))
        loss.backward() if isinstance(opt, torch.optim.AdamW) else opt.backward(loss)
        opt.step()
        sched.step()


def _lr_kinds(groups) -> list:
    """Each group's lr and initial_lr: (type, dtype or None, value)."""
    return [[(type(g[k]).__name__, str(g[k].dtype) if isinstance(g[k], torch.Tensor) else None, float(g[k]))
             for k in ("lr", "initial_lr")] for g in groups]


def tensor_lr_case(group, path: str) -> dict:
    """K steps with a tensor lr, then the state kept three ways (a checkpoint, the rank state dict,
    torch's format) and the run on to STEPS; each kept state restored into a fresh optimizer that
    goes on to STEPS, and whether the dict a state-dict load was given still holds what it held
    (torch deep-copies it). On rank 0 also the reference, torch's AdamW uninterrupted, and torch's
    AdamW resumed from the converter's output: in this process, whose kernels add in the order the
    ranks' do."""
    import copy

    model = make_model(seed=3)
    opt, sched = _lr_optimizer(model, group)
    _lr_train(model, opt, sched, range(K))
    save_checkpoint(path, model, opt, extra={"sched": sched.state_dict()})
    weights, sched_sd = _weights(model), sched.state_dict()
    dicts = {"load_state_dict": copy.deepcopy(opt.state_dict()),
             "load_full_state_dict": copy.deepcopy(full_state_dict(opt))}  # {} on rank 1
    _lr_train(model, opt, sched, range(K, STEPS))
    out: dict = {"uninterrupted": {"end": _weights(model)}}
    for way in ("load_checkpoint", "load_state_dict", "load_full_state_dict"):
        fresh = make_model(seed=4)
        fresh_opt, fresh_sched = _lr_optimizer(fresh, group)
        given = dicts.get(way)
        held = copy.deepcopy(given["param_groups"]) if given else None  # what the dict holds before the load
        if way == "load_checkpoint":
            fresh_sched.load_state_dict(load_checkpoint(path, fresh, fresh_opt)["sched"])
        else:
            fresh.load_state_dict(weights)
            if way == "load_state_dict":
                fresh_opt.load_state_dict(given)
            else:
                load_full_state_dict(fresh_opt, given)
            fresh_sched.load_state_dict(sched_sd)
        kinds = _lr_kinds(fresh_opt.param_groups)
        _lr_train(fresh, fresh_opt, fresh_sched, range(K, STEPS))
        out[way] = {"kinds": kinds, "end": _weights(fresh),
                    "dict_kept": held is None or _lr_kinds(given["param_groups"]) == _lr_kinds(held)}
    if dist.get_rank(group) == 0:
        ref = make_model(seed=3)
        ref_opt, ref_sched = _lr_optimizer(ref)
        _lr_train(ref, ref_opt, ref_sched, range(K))
        out["torch"] = {"kinds": _lr_kinds(ref_opt.param_groups)}
        _lr_train(ref, ref_opt, ref_sched, range(K, STEPS))
        out["torch"]["end"] = _weights(ref)
        plain_path = os.path.join(os.path.dirname(path), "plain.pt")
        convert_checkpoint(path, plain_path)
        plain = torch.load(plain_path, weights_only=True)
        resumed = make_model(seed=9)
        resumed.load_state_dict(plain["model"])
        resumed_opt, resumed_sched = _lr_optimizer(resumed)
        resumed_opt.load_state_dict(plain["optim"])
        resumed_sched.load_state_dict(sched_sd)
        out["converted"] = {"kinds": _lr_kinds(resumed_opt.param_groups)}
        _lr_train(resumed, resumed_opt, resumed_sched, range(K, STEPS))
        out["converted"]["end"] = _weights(resumed)
    return out


def test_a_tensor_lr_comes_back_a_tensor_and_resumes_bit_for_bit(pools, tmp_path):
    """A tensor lr came back from load_checkpoint (and the converter) as a Python float: the resumed
    run took float-lr steps, 7e-9 off the uninterrupted tensor-lr run. The state-dict loads kept the
    dict's own tensor, so the loaded optimizer's scheduler wrote into the dict. The reference is
    torch's AdamW with the same tensor lr and StepLR, uninterrupted: the lr's kind at step K (a
    tensor of the optimizer's dtype for the tensor lr, a float for a group's float lr), and the
    weights at STEPS, bit for bit."""
    got = _run(pools, 2, tensor_lr_case, str(tmp_path / "ckpt"))
    ref = got[0]["torch"]
    assert ref["kinds"][0][0][:2] == ("Tensor", "torch.float32") and ref["kinds"][1][0][0] == "float", ref["kinds"]
    for rank, out in enumerate(got):
        for way in ("uninterrupted", "load_checkpoint", "load_state_dict", "load_full_state_dict", "converted"):
            if way not in out:
                continue  # the converter's, on rank 0 only
            assert out[way].get("kinds", ref["kinds"]) == ref["kinds"], (rank, way, out[way]["kinds"])
            assert out[way].get("dict_kept", True), (rank, way)
            for key, w in ref["end"].items():
                assert torch.equal(out[way]["end"][key], w), (rank, way, key)


def model_only_case(group, path: str) -> dict:
    model = make_model(seed=8)  # fp32: every parameter from the checkpoint's fp32 master
    load_checkpoint(path, model, process_group=group)
    return _weights(model)


def big_save_case(group, path: str, n: int, side: int) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(n)])
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, process_group=group)
    model(torch.randn(2, side)).sum().backward()
    opt.step()
    save_checkpoint(path, model, opt)
    return sum(p.numel() for p in model.parameters())


_LIMITED_CONVERT = """
import resource, sys
import torch
from shardopt.convert import adamw_defaults, main
adamw_defaults()  # first use of torch.optim imports more modules: count them in the baseline
def data_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
limit = data_bytes() + int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
main(sys.argv[1:3])
"""


@pytest.mark.launch
def test_converter_memory_stays_near_one_parameter(pools, tmp_path):
    """32 parameters of 1 MiB: 96 MiB of weights and moments, converted with 24 MiB of headroom
    for private memory (RLIMIT_DATA; file-backed scratch mappings do not count)."""
    ckpt, out = str(tmp_path / "big"), str(tmp_path / "big.pt")
    numel = _run(pools, 2, big_save_case, ckpt, 32, 512)[0]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", _LIMITED_CONVERT, ckpt, out, str(24 * 2**20)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    plain = torch.load(out, weights_only=True, mmap=True)
    assert sum(t.numel() for t in plain["model"].values()) == numel
    assert len(plain["optim"]["state"]) == 32
