"""Tier 2: hybrid sharding over a 2-D DeviceMesh (replicate x shard) on 4 real gloo ranks.

Catches a cross-replica average that is missing or counted twice, replicas whose shards drift
apart, state that is not 1/S per rank, a clipping norm that counts every replica's shard, an
overflow on one rank that does not skip the step everywhere, and checkpoints that do not move
between flat and hybrid layouts. Each rank trains on different data; the reference is the same
run with flat sharding over all 4 ranks (summation order differs, so: within fp32 rounding).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardopt
from models import batch, gpt_steps, make_model, param_groups, small_gpt
from shardopt.estimate import estimate_memory
from shardopt.memory import CATEGORIES

STEPS = 4


def _mesh(shape):
    if shape is None:
        return None
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _train(shape, *, stage: int, dtype: torch.dtype, steps: int = STEPS, clip: float | None = None,
           master: str = "fp32", moments: str = "fp32", bucket_cap_mb: float = 1e-4):
    model = make_model(seed=3, dtype=dtype)
    opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, stage=stage,
                                bucket_cap_mb=bucket_cap_mb, device_mesh=_mesh(shape), master_weights=master,
                                moments=moments)
    return model, opt, _steps(model, opt, range(steps), clip)


def _steps(model, opt, steps, clip: float | None = None) -> list[float]:
    """Train on this rank's batches of ``steps``; returns the clip norms (when clipping)."""
    norms = []
    for step in steps:
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)).float())
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        assert not opt.step_was_skipped
    return norms


def hybrid_equals_flat_case(stage: int, dtype: torch.dtype, clip: float | None) -> dict:
    flat, _, flat_norms = _train(None, stage=stage, dtype=dtype, clip=clip)
    hyb, opt, norms = _train((2, 2), stage=stage, dtype=dtype, clip=clip)
    worst = max((p.detach().float() - q.detach().float()).abs().max().item()
                for p, q in zip(flat.parameters(), hyb.parameters()))
    # Every rank holds the same weights bit for bit: replicas did not drift apart.
    mine = torch.cat([p.detach().float().reshape(-1) for p in hyb.parameters()])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    same = all(torch.equal(e, every[0]) for e in every)
    grads = stage == 1 and all(p.grad is not None for p in hyb.parameters() if p.requires_grad)
    view = opt.inspect()
    return {"worst": worst, "same": same, "norms": (flat_norms, norms), "stage1_grads": grads,
            "shard": (view.shard_size, view.replicas, view.shard_rank, view.replica)}


@pytest.mark.parametrize("stage", [1, 2])
def test_hybrid_2x2_equals_flat_4(pools, stage):
    pool = pools(4)
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-3)):
        res = pool.run(hybrid_equals_flat_case, stage, dtype, 1.0 if dtype == torch.float32 else None)
        for r, got in enumerate(res):
            # bf16 weights: the averaged gradient is rounded to bf16 once in both runs; the fp32
            # master stays within fp32 rounding, which bf16 weights do not show
            assert got["worst"] <= tol, (stage, dtype, r, got["worst"])
            assert got["same"], (stage, dtype, r)
            if stage == 1:
                assert got["stage1_grads"], r
            flat_norms, norms = got["norms"]
            for a, b in zip(flat_norms, norms):
                assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (stage, r, flat_norms, norms)
        # rank = replica * 2 + shard rank, as init_device_mesh lays a (2, 2) mesh out
        assert [g["shard"] for g in res] == [(2, 2, 0, 0), (2, 2, 1, 0), (2, 2, 0, 1), (2, 2, 1, 1)]


def memory_case(stage: int, master: str, moments: str) -> dict:
    """The example GPT, 2 x 2 mesh: bytes measured after two steps, and what the estimate needs."""
    model = small_gpt()
    groups = model.param_groups(0.1)
    opt = shardopt.ShardedAdamW(groups, lr=1e-3, stage=stage, master_weights=master, moments=moments,
                                bucket_cap_mb=0.05, loss_scale=None, device_mesh=_mesh((2, 2)))
    gpt_steps(model, opt, dist.get_rank())
    rep = opt.memory_report()
    in_opt = [p for grp in groups for p in grp["params"]]
    index = {id(p): i for i, p in enumerate(in_opt)}
    view = opt.inspect()
    held = sum(t.numel() for b in view.buffers for t in b.moment_tensors.values() if t.dtype == torch.float32)
    return {"measured": {c: getattr(rep, c) for c in CATEGORIES}, "shapes": [tuple(p.shape) for p in in_opt],
            "grad_order": [index[id(p)] for p in reversed(list(model.parameters()))], "shard_rank": view.shard_rank,
            "numel": sum(p.numel() for p in in_opt), "fp32_moment_elems": held, "text": str(rep),
            "predicted_buffers": rep.predicted["buffers"]}


def test_each_rank_holds_half_the_state_and_the_estimate_is_exact(pools):
    pool = pools(4)
    for stage, master, moments in ((1, "fp32", "fp32"), (2, "remainder", "fp32"), (2, "remainder", "8bit")):
        for rank, r in enumerate(pool.run(memory_case, stage, master, moments)):
            where = (stage, master, moments, rank)
            if moments == "fp32":  # 1/S of each of the two moments, counted from the tensors held (padding: < 8 per tensor)
                assert r["numel"] <= r["fp32_moment_elems"] <= r["numel"] + 8 * len(r["shapes"]) + 16, where
            est = estimate_memory(None, 4, stage, master, "bf16", param_shapes=r["shapes"], bucket_cap_mb=0.05,
                                  backend="gloo", rank=r["shard_rank"], grad_order=r["grad_order"], moments=moments,
                                  shard_size=2)
            assert r["measured"] == est.by_category(), (where, r["measured"], est)
            assert r["predicted_buffers"] == r["measured"]["buffers"], where  # memory_report's own model
            flat = estimate_memory(None, 2, stage, master, "bf16", param_shapes=r["shapes"], bucket_cap_mb=0.05,
                                   moments=moments)
            # the state of a hybrid 2 x 2 rank is a flat 2-rank one
            for c in ("grads", "master", "exp_avg", "exp_avg_sq", "extra"):
                assert r["measured"][c] == getattr(flat, c), (where, c)
            assert "sharded over 2" in r["text"]


def checkpoint_case(path: str, save_shape, load_shape, stage: int) -> dict:
    """Train 3 steps on ``save_shape``, save, train 2 more; load the checkpoint on ``load_shape``
    (another stage and master mode too) and train the same 2 steps: the weights must agree."""
    rank = dist.get_rank()
    model, opt, _ = _train(save_shape, stage=stage, dtype=torch.bfloat16, steps=3, master="remainder")
    shardopt.save_checkpoint(path, model, opt)
    saved_state = opt.full_state_dict()
    _steps(model, opt, (3, 4))
    other = make_model(seed=9, dtype=torch.bfloat16)
    opt2 = shardopt.ShardedAdamW(param_groups(other), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, stage=3 - stage,
                                 bucket_cap_mb=1e-3, device_mesh=_mesh(load_shape), master_weights="remainder")
    shardopt.load_checkpoint(path, other, opt2)
    loaded_state = opt2.full_state_dict()
    _steps(other, opt2, (3, 4))
    worst = max((p.detach().float() - q.detach().float()).abs().max().item()
                for p, q in zip(model.parameters(), other.parameters()))
    same = True
    if rank == 0:
        for i, st in saved_state["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                same &= torch.equal(st[k], loaded_state["state"][i][k])
    return {"worst": worst, "same_state": same}


@pytest.mark.parametrize("save_shape,load_shape", [((2, 2), None), (None, (2, 2)), ((2, 2), (4, 1))])
def test_checkpoints_move_between_flat_and_hybrid(pools, tmp_path, save_shape, load_shape):
    pool = pools(4)
    res = pool.run(checkpoint_case, str(tmp_path / "ckpt"), save_shape, load_shape, 2)
    for r, got in enumerate(res):
        assert got["same_state"], r
        # the next two steps in another layout: the bf16 weights agree to within bf16 rounding of the
        # summation-order difference of the averaged gradient
        assert got["worst"] <= 1e-2, (r, got["worst"])


def overflow_case(bad_rank: int) -> dict:
    rank = dist.get_rank()
    model, opt, _ = _train((2, 2), stage=2, dtype=torch.float32, steps=1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    loss = model(batch(rank, 7))
    opt.backward(loss * float("inf") if rank == bad_rank else loss)
    opt.clip_grad_norm_(1.0)
    opt.step()
    unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    return {"skipped": opt.step_was_skipped, "unchanged": unchanged}


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(pools):
    pool = pools(4)
    for bad in (0, 3):  # a rank of the first replica, and one of the second
        for r, got in enumerate(pool.run(overflow_case, bad)):
            assert got == {"skipped": True, "unchanged": True}, (bad, r, got)


def rank_state_case() -> dict:
    model, opt, _ = _train((2, 2), stage=2, dtype=torch.float32, steps=2)
    sd = opt.state_dict()
    model2 = make_model(seed=3)
    model2.load_state_dict(model.state_dict())
    opt2 = shardopt.ShardedAdamW(param_groups(model2), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, stage=2,
                                 bucket_cap_mb=1e-4, device_mesh=_mesh((2, 2)))
    opt2.load_state_dict(sd)
    for m, o in ((model, opt), (model2, opt2)):
        _steps(m, o, (5,))
    exact = all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    flat = shardopt.ShardedAdamW(param_groups(make_model(seed=3)), lr=1e-2, stage=2)
    try:
        flat.load_state_dict(sd)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"exact": exact, "refused": refused}


def test_rank_state_dict_round_trip_and_refusal_on_another_mesh(pools):
    for r, got in enumerate(pools(4).run(rank_state_case)):
        assert got["exact"], r
        assert "sharded over 2" in got["refused"] and "sharded over 4" in got["refused"], got["refused"]


def errors_case() -> list[str]:
    model = make_model(seed=1)
    msgs = []
    for kw in (dict(device_mesh=_mesh((2, 2)), process_group=dist.group.WORLD),
               dict(device_mesh=init_device_mesh("cpu", (1, 2, 2)))):
        try:
            shardopt.ShardedAdamW(model.parameters(), **kw)
            msgs.append("")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_bad_meshes_are_refused_with_a_clear_error(pools):
    for msgs in pools(4).run(errors_case):
        assert "not both" in msgs[0], msgs
        assert "3-D mesh" in msgs[1] and "replicate" in msgs[1], msgs


def submesh_case() -> dict:
    """The data-parallel part of a 3-D (replicate, shard, tp) mesh of shape (2, 1, 2): two data-
    parallel worlds of 2 ranks (one per tp rank), each 2 replicas x 1 shard, against flat over
    the same 2 ranks (a process group of them)."""
    rank = dist.get_rank()
    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    dp = mesh3["replicate", "shard"]
    tp_rank = mesh3.get_local_rank("tp")
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both, in the same order
    runs = {}
    for kind, kw in (("flat", dict(process_group=groups[tp_rank])), ("sub", dict(device_mesh=dp))):
        model = make_model(seed=4 + tp_rank)  # the two data-parallel worlds train different models
        opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, stage=2, bucket_cap_mb=1e-4, **kw)
        for step in range(3):
            opt.zero_grad()
            opt.backward(model(batch(rank, step)))
            opt.step()
        runs[kind] = (model, opt)
    worst = max((p - q).abs().max().item() for p, q in zip(runs["flat"][0].parameters(), runs["sub"][0].parameters()))
    c = runs["sub"][1]._comm
    return {"worst": worst, "comm": (c.world_size, c.shard_size, c.replicas, c.rank)}


def test_the_data_parallel_part_of_a_larger_mesh(pools):
    res = pools(4).run(submesh_case)
    for r, got in enumerate(res):
        assert got["worst"] <= 2e-6, (r, got)
    # ranks 0, 2 (tp rank 0) and 1, 3 (tp rank 1) are each a data-parallel world of 2
    assert [g["comm"] for g in res] == [(2, 1, 2, 0), (2, 1, 2, 0), (2, 1, 2, 1), (2, 1, 2, 1)]


def submesh_without_flatten_case() -> dict:
    """submesh_case with DeviceMesh._flatten() removed (see shardopt.core._compat.flat_mesh_group)."""
    from torch.distributed.device_mesh import DeviceMesh

    flatten = DeviceMesh._flatten
    del DeviceMesh._flatten
    try:
        return {**submesh_case(), "had_flatten": hasattr(DeviceMesh, "_flatten")}
    finally:
        DeviceMesh._flatten = flatten


def test_without_device_mesh_flatten_the_data_parallel_group_comes_from_public_calls(pools):
    """The fallback for a torch without DeviceMesh._flatten(): all_gather_object + new_group give
    the same data-parallel worlds, which train as the flat process groups do."""
    res = pools(4).run(submesh_without_flatten_case)
    for r, got in enumerate(res):
        assert not got["had_flatten"], r
        assert got["worst"] <= 2e-6, (r, got)
    assert [g["comm"] for g in res] == [(2, 1, 2, 0), (2, 1, 2, 0), (2, 1, 2, 1), (2, 1, 2, 1)]


def four_replicas_case() -> dict:
    """A (4, 1) mesh: every rank holds all the state and the gradient average is one 4-way
    all-reduce per bucket, large enough (1 MiB buckets) for gloo's multi-step algorithms."""
    rank = dist.get_rank()
    runs = []
    for mesh in (None, _mesh((4, 1))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 64))
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=2, bucket_cap_mb=1.0, device_mesh=mesh)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x = torch.randn(16, 512, generator=gen)
            opt.backward(model(x).square().mean())
            opt.step()
            opt.zero_grad()
        runs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    every = [torch.empty_like(runs[1]) for _ in range(dist.get_world_size())]
    dist.all_gather(every, runs[1])
    return {"same": all(torch.equal(e, every[0]) for e in every), "worst": (runs[0] - runs[1]).abs().max().item()}


def test_four_replicas_stay_bit_identical(pools):
    for r, got in enumerate(pools(4).run(four_replicas_case)):
        assert got["same"], r
        assert got["worst"] <= 1e-6, (r, got)
