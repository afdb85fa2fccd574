"""Tier 2: ranks that build the optimizer differently are told so, on every rank, within seconds.

Catches settings that differ between ranks (``stage``, ``bucket_cap_mb``, ``loss_scale``, a
group's ``lr``), which used to end in a gloo abort naming nothing or in a silently wrong result,
and same-shape parameters passed in another order on one rank, which used to leave the ranks
with different models. Each case is built on rank 1 only differently; every rank must raise a
ValueError that names the setting (or the parameters) and both values.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn

import shardopt
from models import batch, make_model


def _timed(call, kind: type) -> tuple[str | None, float]:
    """(the message of the ``kind`` exception ``call()`` raised, or None; seconds it took)."""
    start = time.perf_counter()
    try:
        call()
        error = None
    except kind as e:
        error = str(e)
    return error, time.perf_counter() - start


def _load_into_another(path: str) -> tuple[str | None, bool]:
    """Load ``path`` into a differently initialised model: (the ValueError's message or None,
    whether the model was left unchanged)."""
    other = make_model(seed=9)
    opt = shardopt.ShardedAdamW(other.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    error, _ = _timed(lambda: shardopt.load_checkpoint(path, other, opt), ValueError)
    return error, all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def _after_one_backward(**kw) -> tuple:
    """A model and its ShardedAdamW with one backward done, on this rank's batch."""
    model = make_model(seed=2)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, **kw)
    opt.zero_grad()
    opt.backward(model(batch(dist.get_rank(), 0)))
    return model, opt


def differing_case(what: str) -> tuple:
    rank = dist.get_rank()
    model = make_model(seed=1)
    kw: dict = dict(lr=1e-3, stage=2, bucket_cap_mb=25.0, loss_scale="auto")
    params: object = model.parameters()
    if rank == 1:
        if what == "stage":
            kw["stage"] = 1
        elif what == "bucket_cap_mb":
            kw["bucket_cap_mb"] = 1e-4
        elif what == "loss_scale":
            kw["loss_scale"] = 1024.0
        elif what == "lr":
            kw["lr"] = 2e-3
    if what == "order":  # two parameters of the same shape, swapped on rank 1: told apart by name
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        a, b = [i for i, (n, p) in enumerate(named) if n in ("fc1.bias", "norm.weight")]
        if rank == 1:
            named[a], named[b] = named[b], named[a]
        params = named
    return _timed(lambda: shardopt.ShardedAdamW(params, **kw), ValueError)


def test_settings_and_parameter_order_must_agree_across_ranks(pools):
    pool = pools(2)
    expect = {"stage": ("stage", "2", "1"), "bucket_cap_mb": ("bucket_cap_mb", "25.0", "0.0001"),
              "loss_scale": ("loss_scale", "LossScaler", "StaticScaler"), "lr": ("param group 0 lr", "0.001", "0.002"),
              "order": ("fc1.bias", "norm.weight", "rank 1")}
    for what, words in expect.items():
        for rank, (error, seconds) in enumerate(pool.run(differing_case, what)):
            assert error is not None, (what, rank)
            assert all(w in error for w in words), (what, rank, error)
            assert seconds < 10, (what, seconds)


def test_equal_settings_still_build(pools):
    assert pools(2).run(_build_plain) == [1, 1]


def _build_plain() -> int:
    model = nn.Linear(3, 3)
    return len(shardopt.ShardedAdamW(model.named_parameters(), lr=1e-3).param_groups)


def clip_on_one_rank_case() -> tuple:
    """clip_grad_norm_ on rank 0 only (to log the norm there): its all-reduce meets rank 1's step."""
    _, opt = _after_one_backward(stage=2)
    return _timed(lambda: opt.clip_grad_norm_(1.0) if dist.get_rank() == 0 else opt.step(), RuntimeError)


def test_clipping_on_one_rank_only_is_refused_on_every_rank(pools):
    for rank, (error, seconds) in enumerate(pools(2).run(clip_on_one_rank_case)):
        assert error and "different optimizer calls" in error, (rank, error)
        assert ("clip_grad_norm_()" if rank == 0 else "step()") in error.split("another rank")[0], (rank, error)
        assert seconds < 10


# -- checkpoints: a path per rank, an extra that cannot be read back ------------------------------
def per_rank_path_case(root: str) -> tuple:
    model = make_model(seed=3)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3)
    where = os.path.join(root, f"ckpt-{dist.get_rank()}")  # e.g. a per-rank timestamp
    error, _ = _timed(lambda: shardopt.save_checkpoint(where, model, opt), ValueError)
    dist.barrier()
    return error, sorted(os.listdir(root))


def unreadable_extra_case(root: str) -> tuple:
    import numpy as np

    model = make_model(seed=3)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3)
    refused, _ = _timed(lambda: shardopt.save_checkpoint(os.path.join(root, "bad"), model, opt,
                                                         extra={"rng": np.random.get_state()}), ValueError)
    dist.barrier()
    listed = sorted(os.listdir(root))
    import shardopt.checkpoint as ck

    check, ck._check_loadable = ck._check_loadable, lambda extra: None  # as a version without the check saved
    good = os.path.join(root, "old")
    try:
        shardopt.save_checkpoint(good, model, opt, extra={"rng": np.random.get_state()})
    finally:
        ck._check_loadable = check
    return (refused, listed, *_load_into_another(good))


def test_a_checkpoint_path_that_differs_per_rank_is_refused(pools, tmp_path):
    for rank, (error, listed) in enumerate(pools(2).run(per_rank_path_case, str(tmp_path))):
        assert error and "different paths" in error and "ckpt-0" in error and "ckpt-1" in error, (rank, error)
        assert listed == [], listed  # nothing written, no stranded .tmp- directory


def test_an_extra_that_cannot_be_read_back_is_refused_at_save_and_a_load_changes_nothing(pools, tmp_path):
    for rank, (refused, listed, load_error, unchanged) in enumerate(pools(2).run(unreadable_extra_case,
                                                                                 str(tmp_path))):
        assert refused and "weights_only" in refused, (rank, refused)
        assert listed == [], listed  # nothing written
        assert load_error and "extra.pt" in load_error and "nothing was loaded" in load_error, load_error
        assert unchanged, rank


def flipped_bytes_case(root: str) -> tuple:
    rank = dist.get_rank()
    model, opt = _after_one_backward()
    opt.step()
    path = os.path.join(root, "ckpt")
    start = time.perf_counter()
    shardopt.save_checkpoint(path, model, opt)
    save_seconds = time.perf_counter() - start
    if rank == 0:  # 4 bytes in the middle of rank 1's tensor file, same size
        name = os.path.join(path, "__1_0.distcp")
        with open(name, "r+b") as f:
            f.seek(os.path.getsize(name) // 2)
            data = f.read(4)
            f.seek(-4, os.SEEK_CUR)
            f.write(bytes(b ^ 0xFF for b in data))
    dist.barrier()
    return (*_load_into_another(path), save_seconds)


def test_a_tensor_file_with_flipped_bytes_is_refused_before_anything_is_loaded(pools, tmp_path):
    for rank, (error, unchanged, _) in enumerate(pools(2).run(flipped_bytes_case, str(tmp_path))):
        assert error and "__1_0.distcp" in error and "checksum" in error, (rank, error)
        assert unchanged, rank


# -- last in this module: it leaves the pool's process group unusable ------------------------------
def skipped_step_case() -> tuple:
    """Rank 1 skips step(); with timeout=3 rank 0 raises a TimeoutError naming step() instead of
    waiting for the process group's 30 minutes."""
    _, opt = _after_one_backward(timeout=3.0)
    if dist.get_rank() == 1:
        time.sleep(6)
        return None, 0.0
    return _timed(opt.step, TimeoutError)


def test_a_rank_that_skips_step_times_out_with_the_call_named(pools):
    error, seconds = pools(2).run(skipped_step_case)[0]
    assert error and "step() waited 3 s" in error and "rank 0 of 2" in error, error
    assert 2.5 <= seconds < 10, seconds
