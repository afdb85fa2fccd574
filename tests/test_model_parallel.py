"""Tier 2: ShardedAdamW beside tensor and pipeline parallelism, on 4 real gloo ranks (2 x 2).

Each layout trains a model cut from ``parallel_models.Whole`` on different data per data-parallel
rank; the reference is one process training the whole model with torch.optim.AdamW on the global
batch, clipped by torch.nn.utils.clip_grad_norm_. Catches a clip norm that is one part's instead
of the model's, replicated parameters that drift apart across tensor-parallel ranks, an overflow
on one part that lets the other parts step, and ranks of one model in different calls.
"""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardopt
from models import gpt_steps, small_gpt
from parallel_models import (H, Experts, Gated, MegatronTP, Stage, Uneven, Whole, batch, expert_reference,
                             expert_reference_with_optimizer, global_batch, pipeline_step, reference,
                             reference_with_optimizer)

STEPS = 5
CLIP = 0.1


def _tp_setup(stage: int, dtype: torch.dtype = torch.float32, **kw):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    model = MegatronTP(Whole(0, dtype), tp.get_group(), tp.get_local_rank(), 2)
    opt = shardopt.ShardedAdamW([{"params": model.sharded()}, {"params": model.replicated(), "replicated": True}],
                                lr=1e-2, weight_decay=0.1, stage=stage, bucket_cap_mb=1e-4,
                                device_mesh=mesh["dp"], model_parallel_group=tp, **kw)
    return mesh, model, opt


def _clipped_steps(model, opt, dp: int, steps) -> list[float]:
    """Training steps on data-parallel rank ``dp``'s batches, clipped to CLIP; the norms returned."""
    norms = []
    for step in steps:
        opt.zero_grad()
        opt.backward(model(*batch(dp, step)))
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
    return norms


def megatron_tp_case(stage: int) -> dict:
    mesh, model, opt = _tp_setup(stage)
    dp = mesh["dp"].get_local_rank()
    norms = _clipped_steps(model, opt, dp, range(STEPS))
    whole, ref_norms = reference(STEPS, 2, clip=CLIP)
    worst = max((p.detach() - q.detach()).abs().max().item() for p, q in model.pieces_of(whole))
    mine = torch.cat([p.detach().reshape(-1) for p in model.replicated()])
    other = mine.clone()
    dist.broadcast(other, dist.get_global_rank(mesh["tp"].get_group(), 0), group=mesh["tp"].get_group())
    return {"worst": worst, "norms": norms, "ref_norms": ref_norms, "replicas_equal": torch.equal(mine, other)}


@pytest.mark.parametrize("stage", [1, 2])
def test_megatron_tp_clips_with_the_models_norm(pools, stage):
    for r, got in enumerate(pools(4).run(megatron_tp_case, stage)):
        for a, b in zip(got["norms"], got["ref_norms"]):
            assert abs(a - b) <= 1e-5 * b, (r, got["norms"], got["ref_norms"])
        assert got["worst"] <= 1e-6, (r, got["worst"])
        assert got["replicas_equal"], r


def pipeline_case(stage: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    whole = Whole(0)
    part = Stage(whole, pp)
    opt = shardopt.ShardedAdamW(part.parameters(), lr=1e-2, weight_decay=0.1, stage=stage, bucket_cap_mb=1e-4,
                                process_group=mesh["dp"].get_group(), model_parallel_group=mesh["pp"].get_group())
    peer = dist.get_global_rank(mesh["pp"].get_group(), 1 - pp)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        pipeline_step(part, *batch(dp, step), peer)
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
    ref, ref_norms = reference(STEPS, 2, clip=CLIP)
    worst = max((p.detach() - q.detach()).abs().max().item() for p, q in part.pieces_of(ref))
    return {"worst": worst, "norms": norms, "ref_norms": ref_norms}


def test_pipeline_stages_clip_with_the_models_norm(pools):
    for r, got in enumerate(pools(4).run(pipeline_case, 2)):
        for a, b in zip(got["norms"], got["ref_norms"]):
            assert abs(a - b) <= 1e-5 * b, (r, got["norms"], got["ref_norms"])
        assert got["worst"] <= 1e-6, (r, got["worst"])


def fp16_pipeline_case(how: str) -> dict:
    """fp16 pipeline stages with the dynamic loss scale (2**16): stage 1 runs opt.backward(loss),
    stage 0 backward from the gradient it sent back, ``how`` (see parallel_models.pipeline_step)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    part = Stage(Whole(0, torch.float16), pp).half()
    opt = shardopt.ShardedAdamW(part.parameters(), lr=1e-2, weight_decay=0.1, stage=2, bucket_cap_mb=1e-4,
                                process_group=mesh["dp"].get_group(), model_parallel_group=mesh["pp"].get_group())
    peer = dist.get_global_rank(mesh["pp"].get_group(), 1 - pp)
    norms, scales = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            opt.zero_grad()
            pipeline_step(part, *batch(dp, step), peer, opt, how)
            norms.append(float(opt.clip_grad_norm_(CLIP)))
            opt.step()
            scales.append(opt.loss_scale)
    ref, ref_norms = reference(STEPS, 2, clip=CLIP, init_dtype=torch.float16)
    worst = max((p.detach().float() - q.detach()).abs().max().item() for p, q in part.pieces_of(ref))
    return {"worst": worst, "norms": norms, "ref_norms": ref_norms, "scales": scales,
            "skipped": opt.skipped_steps, "warned": [str(w.message) for w in caught if "loss scale" in str(w.message)]}


@pytest.mark.parametrize("how", ["tensor", "opt", "plain"])
def test_fp16_pipeline_stages_take_the_loss_scale_of_the_last_stage(pools, how):
    """A stage's backward from the gradient the next stage's opt.backward(loss) sent back carries
    that loss scale (act.backward(g) and opt.backward(act, gradient=g) alike): every stage clips
    with the model's norm, nothing is skipped, nothing warned. With no opt.backward(loss) on any
    stage the gradients are unscaled: the same numbers, and every rank warns."""
    for r, got in enumerate(pools(4).run(fp16_pipeline_case, how)):
        for a, b in zip(got["norms"], got["ref_norms"]):  # fp16 gradients against fp32 ones
            assert abs(a - b) <= 1e-3 * b, (r, how, got["norms"], got["ref_norms"])
        assert got["worst"] <= 1e-3, (r, how, got["worst"])  # fp16 weights: their rounding
        assert got["scales"] == [2.0**16] * STEPS and got["skipped"] == 0, (r, how, got)
        assert (len(got["warned"]) == 1) == (how == "plain"), (r, how, got["warned"])


def overflow_case() -> dict:
    """fp16 with a dynamic loss scale; at step 1 one tensor-parallel rank of one data-parallel
    group alone gets an inf in a gradient of its own shard."""
    mesh, model, opt = _tp_setup(2, torch.float16, loss_scale="dynamic")
    dp = mesh["dp"].get_local_rank()
    skipped, scales = [], []
    for step in range(3):
        opt.zero_grad()
        hook = None
        if step == 1 and dist.get_rank() == 1:  # dp 0, tp 1
            hook = model.w2.register_hook(lambda g: g * float("inf"))
        opt.backward(model(*batch(dp, step)))
        if hook is not None:
            hook.remove()
        opt.step()
        skipped.append(opt.step_was_skipped)
        scales.append(opt.loss_scale)
    return {"skipped": skipped, "scales": scales}


def test_an_overflow_on_one_tensor_parallel_rank_skips_the_step_on_every_rank(pools):
    res = pools(4).run(overflow_case)
    assert all(r["skipped"] == [False, True, False] for r in res), res
    assert len({tuple(r["scales"]) for r in res}) == 1, res


def nan_on_one_part_case(layout: str) -> dict:
    """fp32 (no loss scale to lower), max_consecutive_skips=2: a NaN in the gradient of one parameter
    on one rank (tensor-parallel rank 1's shard of w2, pipeline stage 0's fc1.weight, expert 0's
    weight) at every step; what each rank warns at the first skip and raises at the second."""
    if layout == "tp":
        mesh, model, opt = _tp_setup(2, max_consecutive_skips=2)
        dp, bad, on = mesh["dp"].get_local_rank(), model.w2, dist.get_rank() == 1  # dp 0, tp 1
        expected = "tp1/#2 (param group 0, shape (8, 6))"  # w2's piece on tensor-parallel rank 1

        def step(i: int) -> None:
            opt.backward(model(*batch(dp, i)))
    elif layout == "ep":  # dense parameters on every rank, expert e on ranks {2e, 2e + 1} (see expert_case)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "edp"))
        model = Experts(2, expert=mesh["ep"].get_local_rank())
        opt = shardopt.ShardedAdamW([{"params": model.dense.parameters()},
                                     {"params": model.experts.parameters(), "process_group": mesh["edp"].get_group()}],
                                    lr=1e-2, stage=2, bucket_cap_mb=1e-4, max_consecutive_skips=2)
        bad, on = model.experts[0].weight, dist.get_rank() == 0  # expert 0, held by ranks 0 and 1
        expected = "pg1-0/#2 (param group 1, shape (8, 8))"  # the other expert's weight has the same name

        def step(i: int) -> None:
            opt.backward(model(*batch(dist.get_rank(), i)))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        part = Stage(Whole(0), pp)
        opt = shardopt.ShardedAdamW(part.parameters(), lr=1e-2, stage=2, bucket_cap_mb=1e-4, max_consecutive_skips=2,
                                    process_group=mesh["dp"].get_group(), model_parallel_group=mesh["pp"].get_group())
        peer = dist.get_global_rank(mesh["pp"].get_group(), 1 - pp)
        bad, on = (part.fc1.weight if pp == 0 else None), dist.get_rank() == 0  # pp 0, dp 0
        expected = "mp0/#2 (param group 0, shape (12, 8))"  # fc1.weight of stage 0 (model axis "mp")

        def step(i: int) -> None:
            pipeline_step(part, *batch(dp, i), peer, opt)
    if on:  # one rank of that part only
        bad.register_hook(lambda g: g * float("nan"))
    out: dict = {"expected": expected, "warned": [], "error": None}
    for i in range(3):
        opt.zero_grad()
        step(i)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                opt.step()
            except RuntimeError as e:
                out["error"] = (i, str(e))
                break
        out["warned"] += [(i, str(w.message)) for w in caught if "skipped" in str(w.message)]
    return out


@pytest.mark.parametrize("layout", ["tp", "pp", "ep"])
def test_every_part_names_the_parameters_whose_gradients_are_not_finite(pools, layout):
    """Every rank of the model, those of the other tensor-parallel rank, pipeline stage or expert
    group too, names the parameter (and the part that holds it) in its warning and in the error
    that follows, and no other."""
    for r, out in enumerate(pools(4).run(nan_on_one_part_case, layout)):
        assert [i for i, _ in out["warned"]] == [0] and out["error"] is not None and out["error"][0] == 1, (r, out)
        for message in (out["warned"][0][1], out["error"][1]):
            assert out["expected"] in message and "squares overflow" not in message, (r, message)
            assert message.count("#") == 1, (r, message)  # that parameter only


def different_calls_case() -> str:
    """tp rank 1 calls clip_grad_norm_ where tp rank 0 goes straight to step."""
    mesh, model, opt = _tp_setup(2)
    opt.backward(model(*batch(mesh["dp"].get_local_rank(), 0)))
    try:
        if mesh["tp"].get_local_rank() == 1:
            opt.clip_grad_norm_(1.0)
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_parts_of_one_model_in_different_calls_raise_on_every_rank(pools):
    for r, msg in enumerate(pools(4).run(different_calls_case)):
        assert "ranks that hold parts of one model" in msg and "clip_grad_norm_()" in msg, (r, msg)


def bad_layout_case() -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Whole(0)
    try:  # the data-parallel group given as the model axis too
        shardopt.ShardedAdamW(model.parameters(), device_mesh=mesh["dp"], model_parallel_group=mesh["dp"])
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_model_axis_that_overlaps_the_data_parallel_group_is_refused(pools):
    for msg in pools(4).run(bad_layout_case):
        assert "share ranks" in msg and "model_parallel_group" in msg, msg


def replicated_without_axes_case() -> str:
    model = Whole(0)
    try:
        shardopt.ShardedAdamW([{"params": model.parameters(), "replicated": True}])
    except ValueError as e:
        return str(e)
    return "no error"


def test_replicated_without_a_model_axis_is_refused(pools):
    for msg in pools(2).run(replicated_without_axes_case):
        assert '"replicated": True' in msg and "model_parallel_group" in msg, msg


def misdeclared_case(declared: str, stage: int) -> dict:
    """Megatron-style TP with every parameter marked a copy ("all copies": w1, b1 and w2 are parts),
    or none ("no copies": the LayerNorm and b2 are copies): the first step raises on every rank."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    model = MegatronTP(Whole(0), tp.get_group(), tp.get_local_rank(), 2)
    names, params = zip(*model.named_parameters())
    group = {"params": list(params), "param_names": list(names)}
    if declared == "all copies":
        group["replicated"] = True
    opt = shardopt.ShardedAdamW([group], lr=1e-2, weight_decay=0.1, stage=stage, bucket_cap_mb=1e-4,
                                device_mesh=mesh["dp"], model_parallel_group=tp, timeout=30.0)
    before = [p.detach().clone() for p in params]
    opt.backward(model(*batch(mesh["dp"].get_local_rank(), 0)))
    norm = float(opt.clip_grad_norm_(CLIP))
    try:
        opt.step()
    except ValueError as e:
        return {"error": str(e), "norm": norm, "untouched": all(torch.equal(a, p) for a, p in zip(before, params))}
    return {"error": "no error", "norm": norm}


@pytest.mark.parametrize("declared, stage", [("all copies", 2), ("no copies", 1), ("no copies", 2)])
def test_copies_declared_wrongly_beside_megatron_tp_raise_at_the_first_step_on_every_rank(pools, declared, stage):
    ref_norm = reference(1, 2, clip=CLIP)[1][0]  # the whole model's norm at step 0
    for r, got in enumerate(pools(4).run(misdeclared_case, declared, stage, timeout=120)):
        msg = got["error"]
        assert abs(got["norm"] - ref_norm) > 1e-3 * ref_norm, (r, got["norm"], ref_norm)  # what went unseen
        if declared == "all copies":
            assert "declared copies across model axis 'tp' hold different weights" in msg, (r, msg)
            assert all(f"'{n}' (in param group 0, marked \"replicated\")" in msg for n in ("w1", "b1", "w2")), (r, msg)
            assert "'b2'" not in msg and "'norm.weight'" not in msg, (r, msg)
        else:
            assert "hold the same weights and got the same averaged gradient on every rank of it" in msg, (r, msg)
            assert all(f"'{n}' (param group 0)" in msg for n in ("norm.weight", "norm.bias", "b2")), (r, msg)
            assert "'w1'" not in msg and "'b1'" not in msg and '"replicated": True' in msg, (r, msg)
        assert got["untouched"], r


def drifting_copies_case(how: str, stage: int) -> dict:
    """Copies whose weights are the same at the first step and whose averaged gradients differ across
    the tensor-parallel ranks. "bias": Megatron-style TP whose fc1 bias starts at zero (its parts
    alike) put in the "replicated" group by mistake; "sequence": torch's sequence-parallel plan with
    the LayerNorm left a plain module on each rank's part of the sequence (a plain copy beside
    DTensors, whose gradient is that rank's share)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"].get_local_rank()
    kw = dict(lr=1e-2, weight_decay=0.1, stage=stage, bucket_cap_mb=1e-4, device_mesh=mesh["dp"], timeout=60.0)
    if how == "bias":
        whole = Whole(0)
        with torch.no_grad():
            whole.fc1.bias.zero_()
        model = MegatronTP(whole, tp.get_group(), tp.get_local_rank(), 2)
        named = dict(model.named_parameters())
        parts, copies = ["w1", "w2"], ["b1", "norm.weight", "norm.bias", "b2"]
        opt = shardopt.ShardedAdamW([{"params": [named[n] for n in parts], "param_names": parts},
                                     {"params": [named[n] for n in copies], "param_names": copies, "replicated": True}],
                                    model_parallel_group=tp, **kw)
        ref = Whole(0)
        with torch.no_grad():
            ref.fc1.bias.zero_()

        def first_step() -> float:
            opt.backward(model(*batch(dp, 0)))
            return float(opt.clip_grad_norm_(CLIP))
    else:
        model, ref = Whole(0), Whole(0)
        _sequence_parallel(model, tp, norm=False)
        opt = shardopt.ShardedAdamW(list(model.named_parameters()), **kw)

        def first_step() -> float:
            x, y = (t.unsqueeze(0) for t in batch(dp, 0))
            opt.backward(model(x.chunk(tp.size(), dim=1)[tp.get_local_rank()], y))
            return float(opt.clip_grad_norm_(CLIP))
    params = [p for _, p in model.named_parameters()]
    before = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in params]
    norm = first_step()
    ref(*global_batch(2, 0)).backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
    try:
        opt.step()
        error = "no error"
    except ValueError as e:
        error = str(e)
    after = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in params]
    return {"error": error, "norm": norm, "ref_norm": ref_norm,
            "untouched": all(torch.equal(a, b) for a, b in zip(before, after))}


@pytest.mark.parametrize("how, stage", [("bias", 2), ("sequence", 1)])
def test_copies_whose_gradients_differ_across_the_axis_raise_at_the_first_step_on_every_rank(pools, how, stage):
    """Weights alike at the first step do not make copies: a copy's averaged gradient is compared
    across the axis too, and one that differs (a zero-initialised part marked a copy, a LayerNorm
    whose gradient each rank holds a share of) raises on every rank before any update, naming it;
    the clip norm it would have trained with is not the model's."""
    for r, got in enumerate(pools(4).run(drifting_copies_case, how, stage)):
        msg = got["error"]
        assert abs(got["norm"] - got["ref_norm"]) > 1e-3 * got["ref_norm"], (r, got)  # what went unseen
        assert "hold the same weights but got different averaged gradients on its ranks" in msg, (r, msg)
        if how == "bias":
            assert "'b1' (in param group 1, marked \"replicated\")" in msg, (r, msg)
            assert "'norm.weight'" not in msg and "'b2'" not in msg, (r, msg)
        else:
            why = "(a plain parameter beside DTensor parameters on that mesh)"
            assert f"'norm.weight' {why}" in msg and f"'norm.bias' {why}" in msg, (r, msg)
            assert "'fc2.bias'" not in msg, (r, msg)
        assert got["untouched"], r


def skipped_first_step_case(dtype_name: str, declared: bool, stage: int) -> dict:
    """Megatron-style TP with fc1's bias zero-initialised (its parts start alike), whose first step's
    gradients are not finite: fp16, whose loss 1000 times larger overflows at the initial loss scale
    (2**16), or fp32 with an inf in the loss. That step is skipped on every rank. ``declared``: the
    copies in the "replicated" group; else none are (the LayerNorm and fc2's bias left parts)."""
    dtype = getattr(torch, dtype_name)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"].get_local_rank()
    whole = Whole(0, dtype)
    with torch.no_grad():
        whole.fc1.bias.zero_()
    model = MegatronTP(whole, tp.get_group(), tp.get_local_rank(), 2)
    names, params = zip(*model.named_parameters())
    groups = [{"params": model.sharded()}, {"params": model.replicated(), "replicated": True}] if declared else \
        [{"params": list(params), "param_names": list(names)}]
    opt = shardopt.ShardedAdamW(groups, lr=1e-2, weight_decay=0.1, stage=stage, bucket_cap_mb=1e-4,
                                device_mesh=mesh["dp"], model_parallel_group=tp, timeout=60.0)
    out: dict = {"skipped": [], "norms": [], "error": None}
    for step in range(STEPS):
        x, y = batch(dp, step)
        before = [p.detach().clone() for p in params]
        opt.zero_grad()
        opt.backward(model(x, y * ((1000.0 if dtype == torch.float16 else float("inf")) if step == 0 else 1.0)))
        out["norms"].append(float(opt.clip_grad_norm_(CLIP)))
        try:
            opt.step()
        except ValueError as e:
            out["error"] = (step, str(e), all(torch.equal(a, p) for a, p in zip(before, params)))
            return out
        out["skipped"].append(opt.step_was_skipped)
    ref = Whole(0, dtype).float()  # torch.optim.AdamW on the whole model, from the second step on
    with torch.no_grad():
        ref.fc1.bias.zero_()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    out["ref_norms"] = []
    for step in range(1, STEPS):
        ref_opt.zero_grad()
        ref(*global_batch(2, step)).backward()
        out["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        ref_opt.step()
    out["worst"] = max((p.detach().float() - q.detach()).abs().max().item() for p, q in model.pieces_of(ref))
    return out


@pytest.mark.parametrize("dtype, stage", [("float16", 2), ("float32", 1)])
def test_a_skipped_first_step_leaves_the_check_of_copies_to_the_first_step_taken(pools, dtype, stage):
    """The first step's non-finite gradients (identical on every rank: fc1's bias parts start alike)
    are no sign of copies: declared right, the model trains on from the second step as
    torch.optim.AdamW on the whole model; declared wrong, the check still runs, at the first step
    taken, before its update."""
    fp16 = dtype == "float16"
    for r, got in enumerate(pools(4).run(skipped_first_step_case, dtype, True, stage)):
        assert got["error"] is None and got["skipped"] == [True] + [False] * (STEPS - 1), (r, got)
        for a, b in zip(got["norms"][1:], got["ref_norms"]):  # fp16 gradients against fp32 ones
            assert abs(a - b) <= (1e-3 if fp16 else 1e-5) * b, (r, got["norms"], got["ref_norms"])
        assert got["worst"] <= (1e-3 if fp16 else 1e-6), (r, got["worst"])  # fp16 weights: their rounding
    for r, got in enumerate(pools(4).run(skipped_first_step_case, dtype, False, stage)):
        step, msg, untouched = got["error"]
        assert step == 1 and got["skipped"] == [True] and untouched, (r, got)
        assert "hold the same weights and got the same averaged gradient" in msg, (r, msg)
        assert all(f"'{n}' (param group 0)" in msg for n in ("norm.weight", "norm.bias", "b2")), (r, msg)
        assert "'b1'" not in msg, (r, msg)


def plain_part_beside_dtensors_case(path: str) -> dict:
    """A plain parameter whose value differs per tensor-parallel position beside DTensor parameters
    (taken as a copy) raises at the first step; declared as the message says, a DTensor split over the
    mesh, each position's own value goes through a checkpoint."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_rank, dp = mesh["tp"].get_local_rank(), mesh["dp"].get_local_rank()
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}

    def build(gate):
        model = Gated(gate)
        parallelize_module(model, mesh["tp"], plan)
        opt = shardopt.ShardedAdamW(list(model.named_parameters()), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4,
                                    device_mesh=mesh["dp"], timeout=30.0)
        return model, opt

    model, opt = build(torch.full((H // 2,), 1.0 + tp_rank))  # the gates of this rank's hidden units
    try:
        _clipped_steps(model, opt, dp, range(2))
        error = "no error"
    except ValueError as e:
        error = str(e)
    opt.close()

    def gate(value: float):
        return DTensor.from_local(torch.full((H // 2,), value), mesh["tp"], [Shard(0)], run_check=False)

    model, opt = build(gate(1.0 + tp_rank))
    _clipped_steps(model, opt, dp, range(2))
    held = model.gate.to_local().detach().clone()
    shardopt.save_checkpoint(path, model, opt)
    again, opt2 = build(gate(5.0))
    shardopt.load_checkpoint(path, again, opt2)
    return {"error": error, "held": held, "loaded": again.gate.to_local().detach().clone(), "tp": tp_rank}


def test_a_plain_part_beside_dtensors_raises_and_its_declaration_as_a_dtensor_resumes_each_part(pools, tmp_path):
    got = pools(4).run(plain_part_beside_dtensors_case, str(tmp_path / "ckpt"), timeout=180)
    for r, g in enumerate(got):
        assert "declared copies across model axis 'tp' hold different weights" in g["error"], (r, g["error"])
        assert "'gate' (a plain parameter beside DTensor parameters on that mesh)" in g["error"], (r, g["error"])
        assert "'fc1.weight'" not in g["error"] and "'norm.weight'" not in g["error"], (r, g["error"])
        assert torch.equal(g["loaded"], g["held"]), (r, g["loaded"], g["held"])
    assert not torch.equal(got[0]["held"], got[1]["held"])  # the two positions' parts differ


def replicated_by_name_case() -> dict:
    """``"replicated": ["tp"]`` names the axis the copies are copies across: as True on a 1-D
    model_parallel_group; an axis it does not have is refused, naming its axes."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    model = MegatronTP(Whole(0), tp.get_group(), tp.get_local_rank(), 2)
    kw = dict(lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4, device_mesh=mesh["dp"], model_parallel_group=tp)
    try:
        shardopt.ShardedAdamW([{"params": model.sharded()}, {"params": model.replicated(), "replicated": ["pp"]}], **kw)
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    opt = shardopt.ShardedAdamW([{"params": model.sharded()}, {"params": model.replicated(), "replicated": ["tp"]}],
                                **kw)
    norms = _clipped_steps(model, opt, mesh["dp"].get_local_rank(), range(STEPS))
    return {"refused": refused, "norms": norms, "ref_norms": reference(STEPS, 2, clip=CLIP)[1]}


def test_replicated_may_name_the_axes_the_copies_are_copies_across(pools):
    for r, got in enumerate(pools(4).run(replicated_by_name_case)):
        assert "has no axis named 'pp'; its axes are ['tp']" in got["refused"], (r, got["refused"])
        for a, b in zip(got["norms"], got["ref_norms"]):
            assert abs(a - b) <= 1e-5 * b, (r, got["norms"], got["ref_norms"])


def model_parallel_group_on_some_ranks_case(passing: str) -> dict:
    """Megatron-style TP with timeout=3, ``model_parallel_group=`` given only on tensor-parallel
    position 1 (``passing="tp position 1"``) or only on data-parallel position 0 ("dp position 0")."""
    import time

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    model = MegatronTP(Whole(0), tp.get_group(), tp.get_local_rank(), 2)
    mine = tp.get_local_rank() == 1 if passing == "tp position 1" else mesh["dp"].get_local_rank() == 0
    start = time.monotonic()
    try:
        shardopt.ShardedAdamW([{"params": model.sharded()}, {"params": model.replicated(), "replicated": mine}],
                              device_mesh=mesh["dp"], model_parallel_group=tp if mine else None, timeout=3.0)
        error = "built"
    except (ValueError, TimeoutError) as e:
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "seconds": time.monotonic() - start, "passed": mine}


@pytest.mark.parametrize("passing", ["tp position 1", "dp position 0"])
def test_model_parallel_group_on_some_ranks_only_raises_within_the_timeout(passing):
    from distpool import DistPool

    pool = DistPool(4)  # its own ranks: a control group that could not be made stays broken on them
    try:
        got = pool.run(model_parallel_group_on_some_ranks_case, passing, timeout=60)
    finally:
        pool.close()
    for r, g in enumerate(got):
        assert g["seconds"] < 20, (r, g)
        if passing == "dp position 0":  # the data-parallel ranks compare their settings first: every rank raises
            assert g["error"].startswith("ValueError: ShardedAdamW settings differ across ranks: rank 0 passed "
                                         "model_parallel_group (axes {'tp': 2}), rank 1 did not"), (r, g)
        elif g["passed"]:  # ranks 1 and 3: their tensor-parallel peers 0 and 2 built without it
            assert g["error"].startswith(f"ValueError: rank {r} passed model_parallel_group (axis 'tp', ranks "
                                         f"[{r - 1}, {r}]), rank {r - 1} did not"), (r, g)
        else:  # they hold no group with the ranks that passed it (see comm._model_parts)
            assert g["error"] == "built", (r, g)


def _tp_train(model, opt, mesh, steps) -> None:
    _clipped_steps(model, opt, mesh["dp"].get_local_rank(), steps)


def _resume_worst(build, train, path: str, *, build_again=None, local=lambda p: p) -> tuple[float, int]:
    """5 steps at once against 3 steps, a checkpoint every rank saves to ``path``, a fresh model
    and optimizer (``build_again``, default ``build``) loaded from it, 2 more steps: (the largest
    difference of ``local`` of the parameters, the resumed optimizer's step count)."""
    model, opt = build()
    train(model, opt, range(STEPS))
    resumed, opt = build()
    train(resumed, opt, range(3))
    shardopt.save_checkpoint(path, resumed, opt)
    resumed, opt = (build_again or build)()
    shardopt.load_checkpoint(path, resumed, opt)
    train(resumed, opt, range(3, STEPS))
    worst = max((local(p).detach() - local(q).detach()).abs().max().item()
                for p, q in zip(model.parameters(), resumed.parameters()))
    return worst, opt.step_count


def tp_checkpoint_case(path: str) -> dict:
    """Megatron-style TP; the resumed optimizer at another stage (the part reshards as without
    model axes)."""
    mesh = _tp_setup(2)[0]

    def build(stage=2):
        return _tp_setup(stage)[1:]

    worst, step = _resume_worst(build, lambda m, o, steps: _tp_train(m, o, mesh, steps), path,
                                build_again=lambda: build(1))
    return {"worst": worst, "step": step}


def test_tensor_parallel_ranks_save_to_one_path_and_each_resumes_its_part(pools, tmp_path):
    for r, got in enumerate(pools(4).run(tp_checkpoint_case, str(tmp_path / "ckpt"))):
        assert got["worst"] == 0.0 and got["step"] == STEPS, (r, got)


def pp_checkpoint_case(path: str) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    peer = dist.get_global_rank(mesh["pp"].get_group(), 1 - pp)

    def build():
        part = Stage(Whole(0), pp)
        return part, shardopt.ShardedAdamW(part.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4,
                                           process_group=mesh["dp"].get_group(),
                                           model_parallel_group=mesh["pp"].get_group())

    def train(part, opt, steps):
        for step in steps:
            opt.zero_grad()
            pipeline_step(part, *batch(dp, step), peer)
            opt.clip_grad_norm_(CLIP)
            opt.step()

    return {"worst": _resume_worst(build, train, path)[0]}


def test_pipeline_stages_save_to_one_path_and_each_resumes_its_stage(pools, tmp_path):
    for r, got in enumerate(pools(4).run(pp_checkpoint_case, str(tmp_path / "ckpt"))):
        assert got["worst"] == 0.0, (r, got)


def colliding_save_case(path: str) -> dict:
    """Megatron-style tensor parallelism built without model_parallel_group: each data-parallel
    group saves its own part to the same path."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    model = MegatronTP(Whole(0), tp.get_group(), tp.get_local_rank(), 2)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, device_mesh=mesh["dp"])
    opt.backward(model(*batch(mesh["dp"].get_local_rank(), 0)))
    opt.step()
    if tp.get_local_rank() == 1:  # one group saves after the other
        dist.barrier(tp.get_group())
    try:
        shardopt.save_checkpoint(path, model, opt)
        error = ""
    except ValueError as e:
        error = str(e)
    if tp.get_local_rank() == 0:
        dist.barrier(tp.get_group())
    # what loads back on each rank: its own part, or an error, never another part's weights
    fresh = MegatronTP(Whole(1), tp.get_group(), tp.get_local_rank(), 2)
    opt2 = shardopt.ShardedAdamW(fresh.parameters(), lr=1e-2, device_mesh=mesh["dp"])
    try:
        shardopt.load_checkpoint(path, fresh, opt2)
        loaded = all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    except ValueError as e:
        loaded = str(e)
    return {"error": error, "tp": tp.get_local_rank(), "loaded": loaded}


def test_two_groups_saving_to_one_path_are_refused_never_mixed(pools, tmp_path):
    res = pools(4).run(colliding_save_case, str(tmp_path / "ckpt"))
    for r in res:
        if r["tp"] == 0:
            assert r["error"] == "" and r["loaded"] is True, r
        else:
            assert "saved to this path before" in r["error"] and "ranks [0, 2]" not in r["error"], r
            assert "ranks [0,2]" in r["error"], r
            assert r["loaded"] is not True, r


def _dtensor_setup(stage: int, **kw):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Whole(0)
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    placements = {n: tuple(p.placements) for n, p in model.named_parameters() if hasattr(p, "placements")}
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, stage=stage, bucket_cap_mb=1e-4,
                                device_mesh=mesh["dp"], **kw)
    return mesh, model, opt, placements


def dtensor_tp_case(stage: int) -> dict:
    from torch.distributed.tensor import DTensor

    mesh, model, opt, placements = _dtensor_setup(stage)
    dp = mesh["dp"].get_local_rank()
    norms = _clipped_steps(model, opt, dp, range(STEPS))
    whole, ref_norms = reference(STEPS, 2, clip=CLIP)
    ref = dict(whole.named_parameters())
    worst, still = 0.0, {}
    for n, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        worst = max(worst, (full.detach() - ref[n].detach()).abs().max().item())
        if isinstance(p, DTensor):
            still[n] = tuple(p.placements)
    plain = torch.cat([p.detach().reshape(-1) for p in model.parameters() if not isinstance(p, DTensor)])
    other = plain.clone()
    dist.broadcast(other, dist.get_global_rank(mesh["tp"].get_group(), 0), group=mesh["tp"].get_group())
    return {"worst": worst, "norms": norms, "ref_norms": ref_norms, "placements": (placements, still),
            "replicas_equal": torch.equal(plain, other)}


def test_only_shard_and_replicate_placements_are_taken():
    """The placements a DTensor parameter may have, told by torch's placement classes: Shard and
    Replicate are taken; Partial and _StridedShard (the interleaved split FSDP2 makes over tensor
    parallelism; a Shard subclass in torch 2.9), whose pieces are not Shard's, are refused with the
    message of docs/troubleshooting.md; only a plain Shard is a split."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from shardopt.core._dtensor import check_placements, replicated

    def param(*placements):
        return SimpleNamespace(device_mesh=SimpleNamespace(ndim=1), placements=placements)

    for taken in [(Shard(0),), (Shard(1),), (Replicate(),)]:
        check_placements(param(*taken), "w")
    for refused in [(Partial(),), (_StridedShard(0, split_factor=2),)]:
        with pytest.raises(ValueError, match="takes Shard and Replicate placements"):
            check_placements(param(*refused), "w")
    assert replicated(param(Replicate())) and not replicated(param(Shard(0)))
    assert not replicated(param(Partial())) and not replicated(param(_StridedShard(0, split_factor=2)))


@pytest.mark.parametrize("stage", [1, 2])
def test_dtensor_tp_parameters_stay_dtensors_and_clip_with_the_models_norm(pools, stage):
    for r, got in enumerate(pools(4).run(dtensor_tp_case, stage)):
        for a, b in zip(got["norms"], got["ref_norms"]):
            assert abs(a - b) <= 1e-5 * b, (r, got["norms"], got["ref_norms"])
        assert got["worst"] <= 1e-6, (r, got["worst"])
        before, after = got["placements"]
        assert before == after and len(before) == 4, (r, before, after)
        assert got["replicas_equal"], r


def dtensor_hooks_and_rebuild_case() -> dict:
    """DTensor TP on dp 2 x tp 2, with the user's gradient hooks on DTensor parameters registered
    before any optimizer: a pre-hook that halves fc1.weight's gradient, a post-accumulate-grad hook
    on fc2.weight that counts, one on fc1.bias removed at once. A backward pass, then a stage-1
    ShardedAdamW is built and takes one clipped step on that gradient; it is closed, and a stage-2
    one with another learning rate takes two more steps over the same model. Against
    torch.optim.AdamW on the whole model (the same pre-hook, a new AdamW at the switch)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    model, whole = Whole(0), Whole(0)
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    counted = []
    for m in (model, whole):
        m.fc1.weight.register_hook(lambda g: g / 2)
    model.fc2.weight.register_post_accumulate_grad_hook(lambda p: counted.append(isinstance(p.grad, DTensor)))
    model.fc1.bias.register_post_accumulate_grad_hook(lambda p: counted.append("removed")).remove()

    def build(stage: int, lr: float):
        return shardopt.ShardedAdamW(model.parameters(), lr=lr, weight_decay=0.1, stage=stage, bucket_cap_mb=1e-4,
                                     device_mesh=mesh["dp"])

    model(*batch(dp, 0)).backward()  # before the optimizer: the first step's gradient, as in torch
    opt = build(1, 1e-2)
    norms = [float(opt.clip_grad_norm_(CLIP))]
    opt.step()
    opt.zero_grad()
    opt.close()
    norms += _clipped_steps(model, build(2, 2e-2), dp, (1, 2))
    ref_norms = []
    for steps, lr in (((0,), 1e-2), ((1, 2), 2e-2)):
        ref = torch.optim.AdamW(whole.parameters(), lr=lr, weight_decay=0.1)
        for step in steps:
            ref.zero_grad()
            whole(*global_batch(2, step)).backward()
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(whole.parameters(), CLIP)))
            ref.step()
    theirs = dict(whole.named_parameters())
    worst = max(((p.full_tensor() if isinstance(p, DTensor) else p).detach() - theirs[n].detach()).abs().max().item()
                for n, p in model.named_parameters())
    return {"worst": worst, "norms": norms, "ref_norms": ref_norms, "counted": counted}


def test_user_hooks_on_dtensor_parameters_and_a_second_optimizer_train_as_torch(pools):
    """Gradient hooks on a DTensor parameter registered before the optimizer run (a pre-hook that
    changes the gradient counts in the update), a gradient left by a backward pass before the
    optimizer is the first step's, and a second ShardedAdamW built after the first was closed takes
    the DTensor gradients: both optimizers keep the model's parameter objects, their hooks and
    their gradients."""
    for r, got in enumerate(pools(4).run(dtensor_hooks_and_rebuild_case)):
        assert got["counted"] == [True] * 3, (r, got["counted"])  # once per backward pass, p.grad the DTensor's
        for a, b in zip(got["norms"], got["ref_norms"], strict=True):
            assert abs(a - b) <= 1e-5 * b, (r, got["norms"], got["ref_norms"])
        assert got["worst"] <= 1e-6, (r, got["worst"])


def _dtensor_against_whole(model, whole) -> float:
    """The largest difference between the DTensor model's parameters and the whole model's."""
    from torch.distributed.tensor import DTensor

    theirs = dict(whole.named_parameters())
    return max(((p.full_tensor() if isinstance(p, DTensor) else p).detach().float() - theirs[n].detach().float())
               .abs().max().item() for n, p in model.named_parameters())


def _whole_steps(whole, steps, lr: float = 1e-2) -> None:
    """torch.optim.AdamW on the whole model with the global batch of each of ``steps``."""
    ref = torch.optim.AdamW(whole.parameters(), lr=lr, weight_decay=0.1)
    for step in steps:
        ref.zero_grad()
        whole(*global_batch(2, step)).backward()
        ref.step()


def dtensor_compiled_case() -> float:
    """torch.compile of a DTensor TP model (dp 2 x tp 2) trained by a ShardedAdamW built before the
    compile: 2 steps, against torch.optim.AdamW on the whole model."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    model, whole = Whole(0), Whole(0)
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, device_mesh=mesh["dp"])
    compiled = torch.compile(model)
    for step in (0, 1):
        opt.zero_grad()
        compiled(*batch(dp, step)).backward()
        opt.step()
    _whole_steps(whole, (0, 1))
    return _dtensor_against_whole(model, whole)


def test_a_compiled_dtensor_model_trains_as_torch(pools):
    """torch.compile(model) of a DTensor model whose parameters the optimizer rebuilt over its
    flat buffer: their local tensors fakify as parallelize_module's do."""
    for r, worst in enumerate(pools(4).run(dtensor_compiled_case)):
        assert worst <= 1e-6, (r, worst)


def dtensor_converted_after_close_case(stage: int, first_step: bool) -> float:
    """DTensor TP (dp 2 x tp 2): a ShardedAdamW is built (and takes a step or not), closed, the
    model converted with ``model.to(torch.float32)`` (which swaps every DTensor parameter), and a
    new ShardedAdamW takes 2 steps. Against torch.optim.AdamW on the whole model (a new one at the
    switch)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    model, whole = Whole(0), Whole(0)
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})

    def build():
        return shardopt.ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, stage=stage,
                                     bucket_cap_mb=1e-4, device_mesh=mesh["dp"])

    opt = build()
    if first_step:
        opt.backward(model(*batch(dp, 0)))
        opt.step()
        _whole_steps(whole, (0,))
    opt.zero_grad()
    opt.close()
    model.to(torch.float32)
    opt = build()
    for step in (1, 2):
        opt.zero_grad()
        opt.backward(model(*batch(dp, step)))
        opt.step()
    _whole_steps(whole, (1, 2))
    return _dtensor_against_whole(model, whole)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("first_step", [False, True])
def test_a_dtensor_model_converted_after_close_trains_as_torch_under_a_new_optimizer(pools, stage, first_step):
    """model.to(...) swaps DTensor parameters a closed optimizer had hooked; the new optimizer's
    gradient hooks run on them."""
    for r, worst in enumerate(pools(4).run(dtensor_converted_after_close_case, stage, first_step)):
        assert worst <= 1e-6, (r, worst)


def dtensor_left_grads_case(dtype_name: str, first: int, second: int, fate: str) -> dict:
    """DTensor TP (dp 2 x tp 2), 16-bit or fp32 weights: a ShardedAdamW of stage ``first`` runs a
    backward pass (no step), is closed (``close``; ``zero``: closed, then ``model.zero_grad()``),
    kept or dropped, and one of stage ``second`` built over the model steps on what it left, then
    takes one more step (``third``: closed, then one of stage ``second`` built and closed with no
    backward pass, and one of stage ``first`` takes what the two left). Against torch.optim.AdamW (eps=0.1, so that a loss scale left in a
    gradient moves the step) on an fp32 master of the whole model, global batch; a new AdamW at the
    switch."""
    import gc

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dtype = {"fp32": torch.float32, "fp16": torch.float16}[dtype_name]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    model, whole = Whole(0, dtype), Whole(0, dtype)
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    master = [p.detach().float().clone().requires_grad_() for p in whole.parameters()]
    hp = dict(lr=1e-2, weight_decay=0.1, eps=0.1)

    def build(stage: int):
        return shardopt.ShardedAdamW(model.parameters(), stage=stage, bucket_cap_mb=1e-4, device_mesh=mesh["dp"], **hp)

    def ref_grad(step: int | None) -> None:
        whole.zero_grad()
        if step is not None:
            whole(*global_batch(2, step)).backward()
        for m, p in zip(master, whole.parameters()):
            m.grad = None if p.grad is None else p.grad.float()

    opt = build(first)
    opt.backward(model(*batch(dp, 1)))
    ref_grad(None if fate == "zero" else 1)
    if fate in ("close", "zero", "third"):
        opt.close()
    if fate == "zero":
        model.zero_grad()
    kept = opt if fate == "keep" else None
    del opt
    gc.collect()
    if fate == "third":  # handed on twice: the middle optimizer takes them and leaves them untouched
        build(second).close()
    opt = build(first if fate == "third" else second)
    ref = torch.optim.AdamW(master, **hp)
    norms, ref_norms = [], []
    for step in (None, 2):
        if step is not None:
            opt.zero_grad()
            opt.backward(model(*batch(dp, step)))
            ref_grad(step)
        norms.append(float(opt.clip_grad_norm_(1e9)))
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(master, 1e9)))
        opt.step()
        ref.step()
        with torch.no_grad():  # the whole model's weights: the master's, rounded as the optimizer rounds them
            for m, p in zip(master, whole.parameters()):
                p.copy_(m)
    del kept
    return {"worst": _dtensor_against_whole(model, whole), "norms": norms, "ref_norms": ref_norms}


@pytest.mark.parametrize("dtype_name,first,second,fate", [
    ("fp32", 1, 1, "close"), ("fp32", 2, 2, "drop"), ("fp32", 1, 2, "keep"), ("fp32", 2, 1, "close"),
    ("fp32", 2, 2, "zero"), ("fp16", 2, 2, "close"), ("fp16", 1, 2, "keep"), ("fp16", 1, 1, "drop"),
    ("fp16", 1, 1, "third"), ("fp16", 2, 1, "third")])
def test_gradients_of_dtensor_parameters_left_by_an_optimizer_are_the_next_ones(pools, dtype_name, first, second,
                                                                                 fate):
    """A DTensor parameter's gradient an optimizer leaves is in its p.grad, as a DTensor: the next
    optimizer over the model steps on it (at its own loss scale, also after one that took it and
    left it untouched), and model.zero_grad() drops it."""
    rel, tol = (1e-5, 1e-6) if dtype_name == "fp32" else (1e-3, 2e-3)
    for r, got in enumerate(pools(4).run(dtensor_left_grads_case, dtype_name, first, second, fate)):
        for a, b in zip(got["norms"], got["ref_norms"], strict=True):
            assert abs(a - b) <= rel * b, (r, got["norms"], got["ref_norms"])
        assert got["worst"] <= tol, (r, got["worst"])


def dtensor_hand_grads_case() -> dict:
    """Stage 1, DTensor TP on dp 2 x tp 2: gradients assigned by hand (``p.grad = g``, alike on
    every rank; a DTensor parameter's as a DTensor in its placements). Step 1 with no backward
    pass; step 2 after a backward pass, whose gradient the assigned one replaces. Against
    torch.optim.AdamW on the whole model given the same gradients."""
    import zlib

    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    model, whole = Whole(0), Whole(0)
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, stage=1, bucket_cap_mb=1e-4,
                                device_mesh=mesh["dp"])
    ref = torch.optim.AdamW(whole.parameters(), lr=1e-2, weight_decay=0.1)
    theirs = dict(whole.named_parameters())

    def given(name: str, step: int) -> torch.Tensor:
        seed = zlib.crc32(f"{name} {step}".encode())
        return torch.randn(theirs[name].shape, generator=torch.Generator().manual_seed(seed))

    norms, ref_norms, worst = [], [], []
    for step, backward in ((0, False), (1, True)):
        opt.zero_grad()
        if backward:
            opt.backward(model(*batch(dp, step)))
        for n, p in model.named_parameters():
            p.grad = distribute_tensor(given(n, step), mesh["tp"], p.placements) if isinstance(p, DTensor) else \
                given(n, step)
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        for n, q in theirs.items():
            q.grad = given(n, step)
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(whole.parameters(), CLIP)))
        ref.step()
        worst.append({n: ((p.full_tensor() if isinstance(p, DTensor) else p).detach() - theirs[n].detach()).abs().max()
                      .item() for n, p in model.named_parameters()})
    return {"worst": worst, "norms": norms, "ref_norms": ref_norms}


def test_gradients_assigned_by_hand_to_dtensor_parameters_in_stage_1_are_the_steps(pools):
    """Stage 1 keeps a DTensor parameter's gradient in its view of the flat gradient: a gradient
    assigned by hand is the step's gradient, with no backward pass as after one (it replaces the
    backward's, as ``p.grad = g`` does in torch), as for a plain parameter."""
    for r, got in enumerate(pools(4).run(dtensor_hand_grads_case)):
        for step, (worst, a, b) in enumerate(zip(got["worst"], got["norms"], got["ref_norms"], strict=True)):
            assert max(worst.values()) <= 1e-6, (r, step, worst)
            assert abs(a - b) <= 1e-5 * b, (r, step, got["norms"], got["ref_norms"])


def dtensor_gradient_backward_case(how: str) -> dict:
    """fp16 DTensor tensor-parallel model (2 x 2, no model_parallel_group=): ``opt.backward(t,
    gradient=g)`` from a gradient of one's own (the output's, by hand), alone or beside
    ``opt.backward(loss)`` of another loss. No other stage made ``g``, so it is scaled as a loss is."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Whole(0, torch.float16)
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, stage=2, device_mesh=mesh["dp"])
    dp = mesh["dp"].get_local_rank()
    norms = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            opt.zero_grad()
            x, y = batch(dp, step)
            share = 0.5 if how == "beside a loss" else 1.0
            if how == "beside a loss":
                opt.backward(model(x, y) * 0.5)
            out = model.fc2(model.hidden(x))
            g = share * 2 * (out.detach().float() - y) / y.numel()  # d mse / d out
            opt.backward(out, gradient=g.to(out.dtype))
            norms.append(float(opt.clip_grad_norm_(1e9)))
            opt.step()
    ref, ref_norms = reference(2, 2, clip=1e9, init_dtype=torch.float16)
    theirs = dict(ref.named_parameters())
    full = [(p.full_tensor() if isinstance(p, DTensor) else p, theirs[n]) for n, p in model.named_parameters()]
    worst = max((p.detach().float() - q.detach()).abs().max().item() for p, q in full)
    return {"norms": norms, "ref_norms": ref_norms, "worst": worst, "skipped": opt.skipped_steps,
            "warned": [str(w.message)[:80] for w in caught if "loss scale" in str(w.message)]}


@pytest.mark.parametrize("how", ["beside a loss", "alone"])
def test_fp16_dtensor_tp_backward_from_a_gradient_of_ones_own_is_scaled(pools, how):
    """A DTensor mesh is a tensor-parallel axis, never a pipeline's: ``g`` is scaled as a loss is,
    as without model axes, so the norm and the weights are the fp32 reference's, with no warning."""
    for r, got in enumerate(pools(4).run(dtensor_gradient_backward_case, how)):
        for a, b in zip(got["norms"], got["ref_norms"]):  # fp16 gradients against fp32 ones
            assert abs(a - b) <= 1e-3 * b, (r, how, got["norms"], got["ref_norms"])
        assert got["worst"] <= 1e-3, (r, how, got["worst"])
        assert got["skipped"] == 0 and got["warned"] == [], (r, how, got)


def _sequence_parallel(model, tp, norm: bool = True) -> None:
    """torch's sequence-parallel plan: each tensor-parallel rank runs the LayerNorm on its part of
    the sequence (dimension 1), fc1 gathers the sequence, fc2's output is replicated. ``norm``
    False leaves the LayerNorm a plain module on each rank's part (a plain copy beside DTensors)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    plan = {"fc1": ColwiseParallel(input_layouts=Shard(1)), "fc2": RowwiseParallel(output_layouts=Replicate())}
    if norm:
        plan["norm"] = SequenceParallel()
    parallelize_module(model, tp, plan)


def _sequence_steps(model, opt, tp, dp: int, steps, micro: bool = True) -> list[float]:
    """Clipped steps on data-parallel rank ``dp``'s batch taken as one sequence of 4, each
    tensor-parallel rank given its part of it; ``micro``: two micro-batches of 2, the first under
    no_sync (the loss of each halved). The norms returned."""
    import contextlib

    norms = []
    for step in steps:
        x, y = (t.unsqueeze(0) for t in batch(dp, step))
        opt.zero_grad()
        halves = ((slice(0, 2), opt.no_sync()), (slice(2, 4), contextlib.nullcontext())) if micro else \
            ((slice(0, 4), contextlib.nullcontext()),)
        for rows, ctx in halves:
            with ctx:
                part = x[:, rows].chunk(tp.size(), dim=1)[tp.get_local_rank()]
                opt.backward(model(part, y[:, rows]) / len(halves))
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
    return norms


def sequence_parallel_case(stage: int, grad: str) -> dict:
    """torch's sequence-parallel plan on dp 2 x tp 2: autograd gives the LayerNorm's Replicate
    weight and bias Partial(sum) gradients (each tensor-parallel rank's share, from its part of the
    sequence). ``grad="avg"`` hands them over as the same gradients in Partial(avg), ``"shard"``
    hands fc1's Shard(0) weight its gradient as a Partial(sum) of the whole matrix (hooks on the
    parameters). Two micro-batches per step, the first under no_sync; against torch.optim.AdamW on
    the whole model, global batch."""
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"].get_local_rank()
    model = Whole(0)
    _sequence_parallel(model, tp)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, stage=stage, bucket_cap_mb=1e-4,
                                device_mesh=mesh["dp"])
    given: dict[str, str] = {}

    def hand_over(name: str, make) -> None:
        def hook(g):
            given[name] = str(tuple(g.placements))  # what autograd gave
            return make(g)
        model.get_parameter(name).register_hook(hook)

    def partial(local, g, op: str):
        return DTensor.from_local(local, tp, [Partial(op)], run_check=False, shape=g.shape, stride=g.stride())

    for name in ("norm.weight", "norm.bias"):
        hand_over(name, (lambda g: partial(g.to_local() * tp.size(), g, "avg")) if grad == "avg" else (lambda g: g))
    if grad == "shard":
        hand_over("fc1.weight", lambda g: partial(g.full_tensor() / tp.size(), g, "sum"))
    norms = _sequence_steps(model, opt, tp, dp, range(STEPS))
    whole, ref_norms = reference(STEPS, 2, clip=CLIP)
    theirs = dict(whole.named_parameters())
    worst = max(((p.full_tensor() if isinstance(p, DTensor) else p).detach() - theirs[n].detach()).abs().max().item()
                for n, p in model.named_parameters())
    mine = model.norm.weight.to_local().detach().clone()
    other = mine.clone()
    dist.broadcast(other, dist.get_global_rank(tp.get_group(), 0), group=tp.get_group())
    return {"worst": worst, "norms": norms, "ref_norms": ref_norms, "given": given,
            "replicas_equal": torch.equal(mine, other)}


@pytest.mark.parametrize("stage, grad", [(1, "sum"), (2, "sum"), (2, "avg"), (1, "shard")])
def test_partial_gradients_of_dtensor_parameters_are_reduced_over_the_mesh(pools, stage, grad):
    """A Replicate DTensor whose gradient is Partial (sequence parallelism's LayerNorm) is the
    whole model's parameter: the gradient is summed (or averaged) over the mesh before it is
    averaged over the data-parallel ranks, so the clip norm and the weights are the whole model's
    and the copies stay equal; a Partial gradient of a Shard parameter is reduce-scattered."""
    for r, got in enumerate(pools(4).run(sequence_parallel_case, stage, grad)):
        assert got["given"]["norm.weight"] == "(Partial(sum),)", (r, got["given"])  # what is tested
        for a, b in zip(got["norms"], got["ref_norms"]):
            assert abs(a - b) <= 1e-5 * b, (r, got["norms"], got["ref_norms"])
        assert got["worst"] <= 1e-6, (r, got["worst"])
        assert got["replicas_equal"], r


def dtensor_checkpoint_case(path: str) -> dict:
    from torch.distributed.tensor import DTensor

    mesh = _dtensor_setup(2)[0]
    worst = _resume_worst(lambda: _dtensor_setup(2)[1:3], lambda m, o, steps: _tp_train(m, o, mesh, steps), path,
                          build_again=lambda: _dtensor_setup(1)[1:3],
                          local=lambda p: p.to_local() if isinstance(p, DTensor) else p)[0]
    return {"worst": worst}


def test_dtensor_tp_checkpoint_to_one_path_resumes_exactly(pools, tmp_path):
    for r, got in enumerate(pools(4).run(dtensor_checkpoint_case, str(tmp_path / "ckpt"))):
        assert got["worst"] == 0.0, (r, got)


MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW = dict(lr=5e-3, betas=(0.8, 0.99), weight_decay=0.0)


def dtensor_muon_case(stage: int) -> dict:
    """ShardedMuon with fc1 split by rows and fc2 by columns over the tensor-parallel mesh, against
    torch.optim.Muon on the whole matrices (and AdamW on the rest) on the global batch."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Whole(0)
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    mats = [model.fc1.weight, model.fc2.weight]
    rest = [p for p in model.parameters() if all(p is not m for m in mats)]
    opt = shardopt.ShardedMuon([{"params": mats}, {"params": rest, "use_muon": False, **ADAMW}], **MUON,
                               stage=stage, bucket_cap_mb=1e-4, device_mesh=mesh["dp"])
    ref = Whole(0)
    ref_muon = torch.optim.Muon([ref.fc1.weight, ref.fc2.weight], **MUON)
    ref_adamw = torch.optim.AdamW([p for n, p in ref.named_parameters() if n not in ("fc1.weight", "fc2.weight")],
                                  **ADAMW)
    for step in range(STEPS):
        opt.zero_grad()
        opt.backward(model(*batch(mesh["dp"].get_local_rank(), step)))
        opt.clip_grad_norm_(1.0)
        opt.step()
        ref.zero_grad()
        ref(*global_batch(2, step)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_muon.step()
        ref_adamw.step()
    theirs = dict(ref.named_parameters())
    worst = {n: ((p.full_tensor() if isinstance(p, DTensor) else p).detach() - theirs[n].detach()).abs().max().item()
             for n, p in model.named_parameters()}
    return worst


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_muon_on_dtensor_tp_matrices_is_torch_muon_on_the_whole_matrices(pools, stage):
    for r, worst in enumerate(pools(4).run(dtensor_muon_case, stage)):
        assert max(worst.values()) <= 1e-5, (r, worst)


def uneven_muon_case(stage: int) -> dict:
    """ShardedMuon over a hidden width of 15 split 8 / 7 over the tensor-parallel mesh, beside a
    matrix left whole: the pieces' shapes differ between the tensor-parallel positions, the owners
    must not. Against torch.optim.Muon on the whole matrices (AdamW on the rest), global batch."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Uneven(0)  # each output gathered whole: DTensor.from_local, which RowwiseParallel uses, assumes even pieces
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(output_layouts=Replicate()),
                                           "fc2": ColwiseParallel(output_layouts=Replicate())})
    names = ("fc1.weight", "fc2.weight", "mix.weight")
    params = dict(model.named_parameters())
    opt = shardopt.ShardedMuon([{"params": [params[n] for n in names]},
                                {"params": [p for n, p in params.items() if n not in names], "use_muon": False,
                                 **ADAMW}], **MUON, stage=stage, bucket_cap_mb=1e-4, device_mesh=mesh["dp"],
                               timeout=30.0)
    ref = Uneven(0)
    theirs = dict(ref.named_parameters())
    ref_muon = torch.optim.Muon([theirs[n] for n in names], **MUON)
    ref_adamw = torch.optim.AdamW([p for n, p in theirs.items() if n not in names], **ADAMW)
    for step in range(STEPS):
        opt.zero_grad()
        opt.backward(model(*batch(mesh["dp"].get_local_rank(), step)))
        opt.clip_grad_norm_(1.0)
        opt.step()
        ref.zero_grad()
        ref(*global_batch(2, step)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_muon.step()
        ref_adamw.step()
    return {n: ((p.full_tensor() if isinstance(p, DTensor) else p).detach() - theirs[n].detach()).abs().max().item()
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_muon_on_an_uneven_tensor_parallel_split_is_torch_muon_on_the_whole_matrices(pools, stage):
    for r, worst in enumerate(pools(4).run(uneven_muon_case, stage, timeout=120)):
        assert max(worst.values()) <= 1e-5, (r, worst)


def empty_piece_muon_case(stage: int) -> dict:
    """ShardedMuon on dp 2 x tp 3 over DTensor matrices whose split leaves a piece empty: 4 rows
    over 3 ranks are 2, 2 and 0 (DTensor's split), 7 rows 3, 3 and 1, 3 columns 1, 1 and 1;
    against torch.optim.Muon on the whole matrices (AdamW on a bias), global batch."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    specs = [((4, 5), 0), ((7, 5), 0), ((4, 3), 1)]

    def build(split: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Module()
        model.bias = torch.nn.Parameter(torch.zeros(3))
        model.ws = torch.nn.ParameterList([
            torch.nn.Parameter(distribute_tensor(w, mesh["tp"], [Shard(d)]) if split else w)
            for w, d in ((torch.randn(*shape) / shape[1] ** 0.5, d) for shape, d in specs)])
        return model

    def loss(model, rank: int, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + rank)
        total = (model.bias ** 2).sum()
        for w in model.ws:
            whole = w.full_tensor() if isinstance(w, DTensor) else w
            x, y = torch.randn(4, whole.shape[1], generator=g), torch.randn(4, whole.shape[0], generator=g)
            total = total + ((torch.tanh(x @ whole.T) - y) ** 2).mean() + model.bias.sum() * 0.01 * whole.sum()
        return total

    model, ref = build(True), build(False)
    opt = shardopt.ShardedMuon([{"params": list(model.ws)}, {"params": [model.bias], "use_muon": False, **ADAMW}],
                               **MUON, stage=stage, bucket_cap_mb=1e-4, device_mesh=mesh["dp"], timeout=60.0)
    ref_muon, ref_adamw = torch.optim.Muon(list(ref.ws), **MUON), torch.optim.AdamW([ref.bias], **ADAMW)
    for step in range(STEPS):
        opt.zero_grad()
        opt.backward(loss(model, dp, step))
        opt.step()
        ref.zero_grad()
        (sum(loss(ref, r, step) for r in range(2)) / 2).backward()
        ref_muon.step()
        ref_adamw.step()
    theirs = dict(ref.named_parameters())
    return {"pieces": [tuple(w.to_local().shape) for w in model.ws],
            "worst": {n: ((p.full_tensor() if isinstance(p, DTensor) else p).detach() - theirs[n].detach()).abs()
                      .max().item() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_muon_on_a_split_with_an_empty_piece_is_torch_muon_on_the_whole_matrices(pools, stage):
    """A tensor-parallel position whose piece of a matrix is empty still owns it where the whole
    matrix's placement says, and takes part in its gather: every position's piece of the
    orthogonalised whole is the one DTensor's split gives it."""
    for r, got in enumerate(pools(6).run(empty_piece_muon_case, stage, timeout=180)):
        assert got["pieces"][0] == ((0, 5) if r % 3 == 2 else (2, 5)), (r, got["pieces"])  # what is tested
        assert max(got["worst"].values()) <= 1e-5, (r, got["worst"])


def construction_error_on_one_position_case() -> dict:
    """DTensor TP on dp 2 x tp 2 whose flat buffers cannot be built at tensor-parallel position 1 (as
    a problem with that position's own pieces, found on both its data-parallel ranks): every rank of
    the job raises at construction, the others naming the rank that found it."""
    import shardopt.optimizer as built_in
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Whole(0)
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    original = built_in.build_buffers

    def refused(*args, **kwargs):
        raise ValueError("this position's pieces cannot be laid out")

    if mesh["tp"].get_local_rank() == 1:
        built_in.build_buffers = refused
    try:
        shardopt.ShardedAdamW(model.parameters(), lr=1e-2, device_mesh=mesh["dp"], timeout=30.0)
        return {"error": "built"}
    except ValueError as e:
        return {"error": str(e)}
    finally:
        built_in.build_buffers = original


def test_a_construction_error_on_one_tensor_parallel_position_raises_on_every_rank(pools):
    for r, got in enumerate(pools(4).run(construction_error_on_one_position_case, timeout=120)):
        found = "this position's pieces cannot be laid out"
        assert got["error"] == (found if r in (1, 3) else f"on rank 1: {found}"), (r, got)


def expert_case(stage: int) -> dict:
    """Dense parameters on all 4 ranks, expert e on ranks {2e, 2e + 1}: one optimizer, the
    experts in a param group with their own data-parallel group."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "edp"))
    rank, e = dist.get_rank(), mesh["ep"].get_local_rank()
    model = Experts(2, expert=e)
    opt = shardopt.ShardedAdamW([{"params": model.dense.parameters()},
                                 {"params": model.experts.parameters(), "process_group": mesh["edp"].get_group()}],
                                lr=1e-2, weight_decay=0.1, stage=stage, bucket_cap_mb=1e-4)
    norms = _clipped_steps(model, opt, rank, range(STEPS))
    ref, ref_norms = expert_reference(STEPS, 4, 2, clip=CLIP)
    pairs = list(zip(model.dense.parameters(), ref.dense.parameters()))
    pairs += list(zip(model.experts[0].parameters(), ref.experts[e].parameters()))
    return {"worst": max((p.detach() - q.detach()).abs().max().item() for p, q in pairs),
            "norms": norms, "ref_norms": ref_norms, "state": list(opt.state_dict()["param_groups"][1])}


@pytest.mark.parametrize("stage", [1, 2])
def test_experts_on_their_own_group_get_the_global_mean_loss_gradient_and_one_clip(pools, stage):
    for r, got in enumerate(pools(4).run(expert_case, stage)):
        for a, b in zip(got["norms"], got["ref_norms"]):
            assert abs(a - b) <= 1e-5 * b, (r, got["norms"], got["ref_norms"])
        assert got["worst"] <= 1e-6, (r, got["worst"])
        assert "process_group" not in got["state"], r


def expert_checkpoint_case(path: str) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "edp"))
    rank, e = dist.get_rank(), mesh["ep"].get_local_rank()

    def build(stage):
        model = Experts(2, expert=e)
        return model, shardopt.ShardedAdamW(
            [{"params": model.dense.parameters()},
             {"params": model.experts.parameters(), "process_group": mesh["edp"].get_group()}],
            lr=1e-2, weight_decay=0.1, stage=stage, bucket_cap_mb=1e-4)

    def train(model, opt, steps):
        _clipped_steps(model, opt, rank, steps)

    return {"worst": _resume_worst(lambda: build(2), train, path, build_again=lambda: build(1))[0]}


def test_experts_that_share_a_name_on_different_ranks_save_apart_and_resume_exactly(pools, tmp_path):
    for r, got in enumerate(pools(4).run(expert_checkpoint_case, str(tmp_path / "ckpt"))):
        assert got["worst"] == 0.0, (r, got)


def duplicate_block_case(path: str) -> str:
    """Two ranks hand DCP a block with the same key and offsets: DCP would keep one. A ValueError
    on every rank (the class the rank that found it raised)."""
    from shardopt.checkpoint._blocks import whole
    from shardopt.checkpoint._dcp import write_blocks

    mine = torch.full((3,), float(dist.get_rank()))
    try:
        write_blocks(path, [whole("model.w", mine)], None)
    except ValueError as e:
        return str(e)
    return "no error"


def test_two_ranks_writing_one_block_are_refused(pools, tmp_path):
    for msg in pools(2).run(duplicate_block_case, str(tmp_path / "dup")):
        assert "ranks 0 and 1 both write 'model.w'" in msg, msg


def dtensor_options_case(kw: dict, dtype_name: str) -> dict:
    """DTensor TP (dp 2 x tp 2) with ``kw`` (offload, master-weight mode, moments) and two
    micro-batches under no_sync, against the same options on the whole model over the same 2
    data-parallel ranks (each tensor-parallel rank trains a whole copy alongside)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dtype = getattr(torch, dtype_name)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    tp_model, whole = Whole(0, dtype), Whole(0, dtype)
    parallelize_module(tp_model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opts = [shardopt.ShardedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4,
                                  device_mesh=mesh["dp"], **kw) for m in (tp_model, whole)]
    for step in range(3):
        for m, opt in zip((tp_model, whole), opts):
            opt.zero_grad()
            x, y = batch(dp, step)
            with opt.no_sync():
                opt.backward(m(x[:2], y[:2]))
            opt.backward(m(x[2:], y[2:]))
            opt.clip_grad_norm_(1.0)
            opt.step()
    theirs = dict(whole.named_parameters())
    worst = max(((p.full_tensor() if isinstance(p, DTensor) else p).detach().float()
                 - theirs[n].detach().float()).abs().max().item() for n, p in tp_model.named_parameters())
    return {"worst": worst, "dtensors": sum(isinstance(p, DTensor) for p in tp_model.parameters())}


@pytest.mark.parametrize("kw,dtype,tol", [
    (dict(offload="cpu", stage=2), "float32", 1e-6),
    (dict(offload="cpu", offload_fraction=0.5, stage=1), "float32", 1e-6),
    # two bf16 ulps at the weights' size (0.3): 8-bit blocks of a local shard are not the whole's
    (dict(master_weights="remainder", moments="8bit"), "bfloat16", 4e-3),
    # stochastic rounding draws by element offset, which differ between a shard and the whole
    (dict(master_weights="stochastic", moments="bf16"), "bfloat16", 3e-2),
], ids=["offload", "offload-half-stage1", "remainder-8bit", "stochastic-bf16"])
def test_offload_master_modes_moments_and_no_sync_work_beside_dtensor_tp(pools, kw, dtype, tol):
    for r, got in enumerate(pools(4).run(dtensor_options_case, kw, dtype)):
        assert got["dtensors"] == 4 and got["worst"] <= tol, (r, got)


def dtensor_reshard_case(path: str) -> dict:
    """A checkpoint of DTensor TP (dp 2 x tp 2) loaded into the same model without tensor
    parallelism (dp 2, each tensor-parallel position a copy): the whole weights bit for bit, and 2
    more steps as the uninterrupted TP run."""
    from torch.distributed.tensor import DTensor

    def full(model):
        return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]

    mesh, model, opt, _ = _dtensor_setup(2)
    _tp_train(model, opt, mesh, range(STEPS))
    uninterrupted = full(model)
    mesh, tp_model, opt, _ = _dtensor_setup(2)
    _tp_train(tp_model, opt, mesh, range(3))
    shardopt.save_checkpoint(path, tp_model, opt)
    saved = full(tp_model)
    plain = Whole(1)
    opt = shardopt.ShardedAdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4,
                                device_mesh=mesh["dp"])
    shardopt.load_checkpoint(path, plain, opt)
    loaded = all(torch.equal(a, b) for a, b in zip(saved, full(plain)))
    _tp_train(plain, opt, mesh, range(3, STEPS))
    worst = max((a - b).abs().max().item() for a, b in zip(uninterrupted, full(plain)))
    return {"loaded": loaded, "worst": worst, "step": opt.step_count}


def test_a_dtensor_checkpoint_loads_without_tensor_parallelism(pools, tmp_path):
    for r, got in enumerate(pools(4).run(dtensor_reshard_case, str(tmp_path / "ckpt"))):
        assert got["loaded"] and got["worst"] <= 1e-6 and got["step"] == STEPS, (r, got)


WRITES = ("load_state_dict", "copy_", "nn.init", "to_local", "load_checkpoint")


def _write(model, how: str, source, path: str, opt) -> None:
    """Write ``source``'s weights (a model of the same kind: TP beside a TP model, whole beside the
    whole reference) into ``model``, the way ``how`` names; "nn.init": constants instead. ``opt``
    None: the reference, which takes every write by copying."""
    from torch.distributed.tensor import DTensor

    theirs = dict(source.named_parameters())
    if opt is not None and how == "load_state_dict":
        return model.load_state_dict(source.state_dict())
    if opt is not None and how == "load_checkpoint":
        return shardopt.load_checkpoint(path, model)
    with torch.no_grad():
        for i, (n, p) in enumerate(model.named_parameters()):
            if how == "nn.init":
                torch.nn.init.zeros_(p) if n.endswith("bias") else torch.nn.init.constant_(p, 0.05 * (i + 1))
            elif opt is not None and how == "to_local" and isinstance(p, DTensor):
                p.to_local().copy_(theirs[n].to_local())
            else:
                p.copy_(theirs[n])


class _MixedAdamW:
    """torch.optim.AdamW on fp32 master weights of a 16-bit model: the 16-bit model's gradient is
    the master's, the master rounded is the model (the mixed precision ShardedAdamW computes)."""

    def __init__(self, model, **hp) -> None:
        self.model, self.master = model, [p.detach().float().requires_grad_() for p in model.parameters()]
        self.opt = torch.optim.AdamW(self.master, **hp)

    def take_weights(self) -> None:
        with torch.no_grad():
            for m, p in zip(self.master, self.model.parameters()):
                m.copy_(p)

    def step(self, x, y, clip: float) -> None:
        self.model.zero_grad()
        self.model(x, y).backward()
        for m, p in zip(self.master, self.model.parameters()):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(self.master, clip)
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.master, self.model.parameters()):
                p.copy_(m)


def dtensor_write_case(how: str, path: str) -> dict:
    """DTensor TP (dp 2 x tp 2) with bf16 weights: 2 steps, every parameter written from outside
    the optimizer (``how``), 3 more steps; against torch.optim.AdamW on fp32 master weights of the
    whole bf16 model on the global batch, with the same write between the same steps."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()

    def tp_model(seed):
        m = Whole(seed, torch.bfloat16)
        parallelize_module(m, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        return m

    model, pretrained = tp_model(0), tp_model(7)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4,
                                device_mesh=mesh["dp"])
    if how == "load_checkpoint":
        shardopt.save_checkpoint(path, pretrained, shardopt.ShardedAdamW(
            pretrained.parameters(), lr=1e-2, bucket_cap_mb=1e-4, device_mesh=mesh["dp"]))
    ref = _MixedAdamW(Whole(0, torch.bfloat16), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        if step == 2:
            _write(model, how, pretrained, path, opt)
            _write(ref.model, how, Whole(7, torch.bfloat16), path, None)
            ref.take_weights()
        _clipped_steps(model, opt, dp, [step])
        ref.step(*global_batch(2, step), CLIP)
    theirs = dict(ref.model.named_parameters())
    return {n: ((p.full_tensor() if isinstance(p, DTensor) else p).detach() - theirs[n].detach()).float().abs().max().item()
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("how", WRITES)
def test_writes_into_dtensor_parameters_become_the_master_weights(pools, tmp_path, how):
    for r, worst in enumerate(pools(4).run(dtensor_write_case, how, str(tmp_path / "ckpt"))):
        assert max(worst.values()) <= 4e-3, (r, how, worst)  # a bf16 ulp or two


def dtensor_swap_case(how: str) -> str:
    """``how`` on a DTensor TP model (dp 2 x tp 2) after a step: torch swaps DTensor parameters."""
    mesh, model, opt, _ = _dtensor_setup(2)
    _tp_train(model, opt, mesh, range(1))
    model.to("cpu") if how == "cpu" else model.bfloat16()
    try:
        _tp_train(model, opt, mesh, range(1, 3))
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("how", ["cpu", "bfloat16"])
def test_a_dtensor_model_moved_after_building_the_optimizer_raises_on_every_rank(pools, how):
    """torch swaps each DTensor parameter even for a move to where it is (which drops the optimizer's
    hooks): an error naming it on every rank, where training went on with the hooks lost."""
    for r, msg in enumerate(pools(4).run(dtensor_swap_case, how)):
        assert "DTensor parameter" in msg and "was swapped for another tensor" in msg, (r, msg)
        assert ("the same storage" if how == "cpu" else "new storage (") in msg, (r, msg)


def dtensor_state_case() -> dict:
    """opt.state over DTensor TP (dp 2 x tp 2): one entry per parameter, found by the DTensor
    parameter; then every exp_avg replaced by zeros of the parameter's kind (a DTensor where the
    parameter is one), against torch.optim.AdamW on the whole model with the same edit."""
    from torch.distributed.tensor import DTensor

    mesh, model, opt, _ = _dtensor_setup(2)
    whole = Whole(0)
    ref_opt = torch.optim.AdamW(whole.parameters(), lr=1e-2, weight_decay=0.1)
    dp = mesh["dp"].get_local_rank()
    out: dict = {}
    for step in range(STEPS):
        if step == 3:
            listed = list(opt.state)
            out["entries"] = (len(opt.state), len(listed), len({id(p) for p in listed}))
            out["keys"] = sorted({k for p in model.parameters() for k in opt.state[p]})
            for p, q in zip(model.parameters(), whole.parameters()):
                opt.state[p]["exp_avg"] = torch.zeros_like(p)
                ref_opt.state[q]["exp_avg"] = torch.zeros_like(q)
        _clipped_steps(model, opt, dp, [step])
        ref_opt.zero_grad()
        whole(*global_batch(2, step)).backward()
        torch.nn.utils.clip_grad_norm_(whole.parameters(), CLIP)
        ref_opt.step()
    theirs = dict(whole.named_parameters())
    out["worst"] = max(((p.full_tensor() if isinstance(p, DTensor) else p).detach() - theirs[n].detach()).abs().max().item()
                       for n, p in model.named_parameters())
    return out


def test_opt_state_of_dtensor_parameters_is_one_entry_each_and_takes_writes(pools):
    for r, got in enumerate(pools(4).run(dtensor_state_case)):
        assert got["entries"] == (6, 6, 6), (r, got)
        assert "step" in got["keys"] and "exp_avg" in got["keys"], (r, got)
        assert got["worst"] <= 1e-6, (r, got)

def tp_memory_case() -> dict:
    """The example GPT split over tp 2 by examples/gpt.py's tensor_parallel, bf16, 2 steps."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = small_gpt()
    from gpt import tensor_parallel  # examples/, on the path once small_gpt has run

    tensor_parallel(model, mesh["tp"])
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, bucket_cap_mb=0.05, device_mesh=mesh["dp"])
    gpt_steps(model, opt, mesh["dp"].get_local_rank())
    rep = opt.memory_report()
    return {"buffers": rep.buffers, "predicted": rep.predicted["buffers"], "buffers_built": len(opt._buffers)}


def test_memory_report_beside_tensor_parallelism_is_its_prediction_on_every_rank(pools):
    for r, got in enumerate(pools(4).run(tp_memory_case)):
        assert got["buffers"] == got["predicted"] and got["buffers_built"] == 1, (r, got)


def hybrid_tp_case() -> dict:
    """DTensor TP over 2 ranks beside a hybrid (2 replicas x 2 shards) data-parallel mesh: 8 ranks."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    model = Whole(0)
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4,
                                device_mesh=mesh["replicate", "shard"])
    dp = mesh["replicate"].get_local_rank() * 2 + mesh["shard"].get_local_rank()
    norms = _clipped_steps(model, opt, dp, range(STEPS))
    whole, ref_norms = reference(STEPS, 4, clip=CLIP)
    ref = dict(whole.named_parameters())
    worst = max(((p.full_tensor() if isinstance(p, DTensor) else p).detach() - ref[n].detach()).abs().max().item()
                for n, p in model.named_parameters())
    return {"worst": worst, "norms": norms, "ref_norms": ref_norms}


def test_dtensor_tp_beside_a_hybrid_data_parallel_mesh(pools):
    for r, got in enumerate(pools(8).run(hybrid_tp_case)):
        for a, b in zip(got["norms"], got["ref_norms"]):
            assert abs(a - b) <= 1e-5 * b, (r, got["norms"], got["ref_norms"])
        assert got["worst"] <= 1e-6, (r, got["worst"])


# -- the converter on checkpoints of models split over ranks --------------------------------------
# Each part's converted state, loaded into torch.optim.AdamW over that part's model built in this
# process, against torch.optim.AdamW on the whole model trained on the global batch (weights and
# moments, within the rounding of sums taken in another order), and bit for bit against the live
# optimizer's full_state_dict(). The checkpoint used to keep every part's weights but rank 0's
# part's optimizer state only (and of an expert param group, the first expert group's).
def _close(got: torch.Tensor, want: torch.Tensor, what) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7, msg=lambda m: f"{what}: {m}")


def _equal_states(got: dict, want: dict, what) -> None:
    """Two torch optimizer state dicts, bit for bit."""
    assert got["param_groups"] == want["param_groups"], what
    assert got["state"].keys() == want["state"].keys(), (what, got["state"].keys(), want["state"].keys())
    for i, s in want["state"].items():
        for k, v in s.items():
            assert torch.equal(got["state"][i][k], v), (what, i, k)


def _check_adamw_state(adamw: torch.optim.AdamW, ref: torch.optim.AdamW, pairs, what) -> None:
    """``pairs``: (parameter of ``adamw``, parameter of ``ref``, index of its piece there)."""
    for p, q, index in pairs:
        mine, theirs = adamw.state[p], ref.state[q]
        assert float(mine["step"]) == float(theirs["step"]) == STEPS, (what, mine["step"])
        _close(p.detach(), q.detach()[index], (what, "weight"))
        for k in ("exp_avg", "exp_avg_sq"):
            _close(mine[k], theirs[k][index], (what, k))


def megatron_convert_case(path: str) -> dict:
    mesh, model, opt = _tp_setup(2)
    _tp_train(model, opt, mesh, range(STEPS))
    shardopt.save_checkpoint(path, model, opt)
    return {"part": f"mp{mesh['tp'].get_local_rank()}", "fsd": opt.full_state_dict()}  # {} off dp rank 0


def test_a_megatron_tp_checkpoint_converts_every_parts_state(pools, tmp_path):
    from shardopt.convert import convert_checkpoint, split_by_part

    path, out = str(tmp_path / "ckpt"), str(tmp_path / "plain.pt")
    live = pools(4).run(megatron_convert_case, path)
    convert_checkpoint(path, out)  # this process has no process group
    sd = torch.load(out, weights_only=True)
    assert sorted(sd["optim"]) == ["mp0", "mp1"] and sd["parts"] == {"mp0": {"tp": 0}, "mp1": {"tp": 1}}, sd["parts"]
    assert len(sd["model"]) == 12 and sum(len(o["state"]) for o in sd["optim"].values()) == 12
    whole, ref, _ = reference_with_optimizer(STEPS, 2, clip=CLIP)
    theirs = dict(whole.named_parameters())
    for tp, (name, part) in enumerate(sorted(split_by_part(sd).items())):
        model = MegatronTP(Whole(1), None, tp, 2)  # other weights: everything comes from the file
        adamw = torch.optim.AdamW([{"params": model.sharded()}, {"params": model.replicated(), "replicated": True}],
                                  lr=1e-2, weight_decay=0.1)
        model.load_state_dict(part["model"])
        adamw.load_state_dict(part["optim"])
        pieces = model.whole_pieces()
        _check_adamw_state(adamw, ref, [(p, theirs[pieces[n][0]], pieces[n][1]) for n, p in model.named_parameters()],
                           name)
        _equal_states(part["optim"], next(r["fsd"] for r in live if r["part"] == name and r["fsd"]), name)


def pipeline_convert_case(path: str) -> dict:
    """Two stages; model_parallel_group a DeviceMesh this time (the key is the same either way)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    peer = dist.get_global_rank(mesh["pp"].get_group(), 1 - pp)
    part = Stage(Whole(0), pp)
    opt = shardopt.ShardedAdamW(part.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4,
                                process_group=mesh["dp"].get_group(), model_parallel_group=mesh["pp"])
    for step in range(STEPS):
        opt.zero_grad()
        pipeline_step(part, *batch(dp, step), peer)
        opt.clip_grad_norm_(CLIP)
        opt.step()
    shardopt.save_checkpoint(path, part, opt)
    return {"part": f"mp{pp}", "fsd": opt.full_state_dict()}


def test_a_pipeline_checkpoint_converts_every_stages_state(pools, tmp_path):
    from shardopt.convert import convert_checkpoint, split_by_part

    path, out = str(tmp_path / "ckpt"), str(tmp_path / "plain.pt")
    live = pools(4).run(pipeline_convert_case, path)
    convert_checkpoint(path, out)
    sd = torch.load(out, weights_only=True)
    assert sd["parts"] == {"mp0": {"pp": 0}, "mp1": {"pp": 1}}, sd["parts"]
    whole, ref, _ = reference_with_optimizer(STEPS, 2, clip=CLIP)
    theirs = dict(whole.named_parameters())
    for pp, (name, part) in enumerate(sorted(split_by_part(sd).items())):
        stage = Stage(Whole(1), pp)
        adamw = torch.optim.AdamW(stage.parameters(), lr=1e-2, weight_decay=0.1)
        stage.load_state_dict(part["model"])
        adamw.load_state_dict(part["optim"])
        _check_adamw_state(adamw, ref, [(p, theirs[n], ()) for n, p in stage.named_parameters()], name)
        _equal_states(part["optim"], next(r["fsd"] for r in live if r["part"] == name and r["fsd"]), name)


def dtensor_convert_case(path: str) -> None:
    mesh, model, opt, _ = _dtensor_setup(2)
    _tp_train(model, opt, mesh, range(STEPS))
    shardopt.save_checkpoint(path, model, opt)


def test_a_dtensor_tp_checkpoint_converts_to_the_whole_models_state(pools, tmp_path):
    from shardopt.convert import convert_checkpoint

    path, out = str(tmp_path / "ckpt"), str(tmp_path / "plain.pt")
    pools(4).run(dtensor_convert_case, path)
    convert_checkpoint(path, out)
    sd = torch.load(out, weights_only=True)
    assert "parts" not in sd  # DTensor parameters are stored whole: one model
    whole, ref, _ = reference_with_optimizer(STEPS, 2, clip=CLIP)
    model = Whole(1)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model.load_state_dict(sd["model"])
    adamw.load_state_dict(sd["optim"])
    theirs = dict(whole.named_parameters())
    _check_adamw_state(adamw, ref, [(p, theirs[n], ()) for n, p in model.named_parameters()], "dtensor")


def expert_convert_case(path: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "edp"))
    model = Experts(2, expert=mesh["ep"].get_local_rank())
    opt = shardopt.ShardedAdamW([{"params": model.dense.parameters()},
                                 {"params": model.experts.parameters(), "process_group": mesh["edp"].get_group()}],
                                lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4)
    _clipped_steps(model, opt, dist.get_rank(), range(STEPS))
    shardopt.save_checkpoint(path, model, opt)


def test_an_expert_checkpoint_converts_every_experts_state(pools, tmp_path):
    """Expert e on ranks {2e, 2e + 1}, each named experts.0 where it is held: the converted state
    loads into torch.optim.AdamW over the whole model with both experts, in the order of their groups."""
    from shardopt.convert import convert_checkpoint

    path, out = str(tmp_path / "ckpt"), str(tmp_path / "plain.pt")
    pools(4).run(expert_convert_case, path)
    convert_checkpoint(path, out)
    sd = torch.load(out, weights_only=True)
    whole, ref, _ = expert_reference_with_optimizer(STEPS, 4, 2, clip=CLIP)
    model = Experts(2)
    torch.nn.init.zeros_(model.dense.weight)  # everything comes from the file
    adamw = torch.optim.AdamW([{"params": model.dense.parameters()}, {"params": model.experts.parameters()}],
                              lr=1e-2, weight_decay=0.1)
    model.load_state_dict({k.replace("pg1-1/experts.0.", "experts.1.").replace("pg1-0/", ""): v
                           for k, v in sd["model"].items()})
    adamw.load_state_dict(sd["optim"])
    theirs = list(whole.parameters())
    _check_adamw_state(adamw, ref, [(p, q, ()) for p, q in zip(model.parameters(), theirs)], "experts")


# -- the parts of a checkpoint are named by the ranks that hold them, not by the axes' names ------
def spelled_case(path: str, saved_as: str, loaded_as: str, legacy: bool) -> dict:
    """Megatron-style TP resumed, model_parallel_group= given as the DeviceMesh ("mesh") or as its
    ProcessGroup ("group") at the save and at the load. ``legacy``: saved with the keys of before
    (the axes' names: "tp0/"), as checkpoints written then hold them."""
    from shardopt.comm._model_parts import ModelParts

    mesh = _tp_setup(2)[0]

    def build(spelled: str):
        tp = mesh["tp"] if spelled == "mesh" else mesh["tp"].get_group()
        model = MegatronTP(Whole(0), mesh["tp"].get_group(), mesh["tp"].get_local_rank(), 2)
        return model, shardopt.ShardedAdamW(
            [{"params": model.sharded()}, {"params": model.replicated(), "replicated": True}], lr=1e-2,
            weight_decay=0.1, bucket_cap_mb=1e-4, device_mesh=mesh["dp"], model_parallel_group=tp)

    key_part = ModelParts.key_part
    built = iter([saved_as, saved_as, loaded_as])  # the uninterrupted run, the saved one, the resumed one

    def build_next():
        spelled = next(built)
        ModelParts.key_part = ModelParts.named_part if legacy and spelled is saved_as else key_part
        return build(spelled)

    try:
        worst, step = _resume_worst(build_next, lambda m, o, steps: _tp_train(m, o, mesh, steps), path)
    finally:
        ModelParts.key_part = key_part
    with open(os.path.join(path, "shardopt.json")) as f:
        return {"worst": worst, "step": step, "parts": sorted(json.load(f)["parts"])}


@pytest.mark.parametrize("saved_as,loaded_as,legacy", [("mesh", "group", False), ("group", "mesh", False),
                                                       ("mesh", "mesh", True), ("mesh", "group", True)])
def test_a_checkpoint_loads_whichever_way_its_model_axis_is_given(pools, tmp_path, saved_as, loaded_as, legacy):
    """Saved with model_parallel_group=mesh["tp"] and loaded with mesh["tp"].get_group(), or the
    reverse, the load used to be refused ("load it with the same ... layout", which it was). A
    checkpoint written with the keys of before loads either way too."""
    for r, got in enumerate(pools(4).run(spelled_case, str(tmp_path / "ckpt"), saved_as, loaded_as, legacy)):
        assert got["worst"] == 0.0 and got["step"] == STEPS, (r, got)
        assert got["parts"] == (["tp0/", "tp1/"] if legacy else ["mp0/", "mp1/"]), (r, got)


def _grid_setup(names, seed: int | None = None):
    """Every rank a part of its own: a (pp 2 x tp 2) grid of model axes, data-parallel size 1.
    ``names``: the model axes, a DeviceMesh of those dimension names over the ranks (global rank
    = 2 * first + second), or "world" for one ProcessGroup over all four."""
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "a", "b"))
    if names == "world":
        axes = dist.group.WORLD
    else:
        axes = init_device_mesh("cpu", (2, 2), mesh_dim_names=names) if names is not None else \
            init_device_mesh("cpu", (2, 2))
    torch.manual_seed(dist.get_rank() if seed is None else seed)
    model = torch.nn.Linear(4, 3)
    return model, shardopt.ShardedAdamW(model.parameters(), lr=1e-2, device_mesh=mesh["dp"], model_parallel_group=axes)


def grid_layouts_case(path: str) -> dict:
    model, opt = _grid_setup(("pp", "tp"))
    opt.backward(model(torch.randn(2, 4)).square().mean())
    opt.step()
    shardopt.save_checkpoint(path, model, opt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    out = {}
    for names in ("world", None, ("tp", "pp"), ("pp", "tp")):
        fresh, opt2 = _grid_setup(names, seed=99)
        try:
            shardopt.load_checkpoint(path, fresh, opt2)
            out[str(names)] = all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())
        except ValueError as e:
            out[str(names)] = str(e)
    return out


def test_a_grid_of_model_axes_loads_by_its_ranks_and_refuses_its_axes_swapped(pools, tmp_path):
    """Saved with a (pp, tp) mesh: loaded with one group over the four ranks or with the mesh
    unnamed, each rank gets its own part back; with the names swapped over the same ranks (pp
    where tp was), every rank refuses."""
    for r, got in enumerate(pools(4).run(grid_layouts_case, str(tmp_path / "ckpt"))):
        assert got["world"] is True and got["None"] is True and got["('pp', 'tp')"] is True, (r, got)
        swapped = got["('tp', 'pp')"]
        assert swapped is not True and "the same tensor- and pipeline-parallel layout" in swapped, (r, swapped)


def other_layout_case(path: str) -> str:
    mesh, model, opt = _tp_setup(2)
    _tp_train(model, opt, mesh, range(1))
    shardopt.save_checkpoint(path, model, opt)
    wide = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))  # tp 4: four parts
    fresh = MegatronTP(Whole(0), wide["tp"].get_group(), wide["tp"].get_local_rank(), 4)
    opt2 = shardopt.ShardedAdamW(fresh.parameters(), lr=1e-2, device_mesh=wide["dp"], model_parallel_group=wide["tp"])
    try:
        shardopt.load_checkpoint(path, fresh, opt2)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_a_checkpoint_of_another_number_of_parts_is_refused_on_every_rank(pools, tmp_path):
    for r, msg in enumerate(pools(4).run(other_layout_case, str(tmp_path / "ckpt"))):
        assert "split into the parts mp0 (tp 2: tp " in msg and "of 4" in msg, (r, msg)
        assert "the same tensor- and pipeline-parallel layout" in msg, (r, msg)


# Last in the module: it breaks shardopt's control groups on purpose (a timeout), and a pool whose
# control groups are broken is replaced only between modules (see distpool).
def save_on_one_part_case(path: str) -> str:
    """Only tensor-parallel position 0 calls save_checkpoint; position 1 goes on to clip_grad_norm_
    (the model's own collectives would wait for position 0 forever: a backward is no test)."""
    mesh, model, opt = _tp_setup(2, timeout=5.0)
    opt.backward(model(*batch(mesh["dp"].get_local_rank(), 0)))
    opt.step()
    opt.zero_grad()
    opt.backward(model(*batch(mesh["dp"].get_local_rank(), 1)))
    try:
        if mesh["tp"].get_local_rank() == 0:
            shardopt.save_checkpoint(path, model, opt, timeout=3.0)
        else:
            opt.clip_grad_norm_(1.0)
    except (RuntimeError, TimeoutError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_checkpoint_call_on_some_parts_only_raises_instead_of_hanging(pools, tmp_path):
    res = pools(4).run(save_on_one_part_case, str(tmp_path / "ckpt"), timeout=120)
    for r, msg in enumerate(res):
        assert "Timeout" in msg.split(":")[0] and ("save_checkpoint()" if r in (0, 2) else "clip_grad_norm_()") in msg, \
            (r, msg)
