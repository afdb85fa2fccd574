"""Tier 2: freezing, AdamW options and hyperparameters used as torch users use them.

Freezing and unfreezing (also of a parameter frozen at construction), AdamW options ShardedAdamW
does not implement, unscaled fp16 backward passes, eps=0 with parameters that got no gradient,
a parameter used on one rank only, torch's own gradient clipping. Torch's result
(``usage_reference``) or a clear error on every rank.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import shardopt
from models import batch, make_model
from usage_reference import HP, ddp_average, error_of, param_diff, ref_step


# -- 5: freezing and unfreezing ---------------------------------------------------------------
def freeze_case(stage: int) -> list[float]:
    model, ref = make_model(seed=7), make_model(seed=7)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage, bucket_cap_mb=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    worst = []
    for step in range(7):
        frozen = 2 <= step < 5
        for m in (model, ref):
            m.fc1.requires_grad_(not frozen)
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()
        ref_step(ref, ref_opt, step)
        worst.append(param_diff(model, ref))
    return worst


def test_freezing_and_unfreezing_follow_torch(pools):
    pool = pools(2)
    for stage in (1, 2):
        for worst in pool.run(freeze_case, stage):
            assert max(worst) <= 2e-6, (stage, worst)


def frozen_at_construction_case() -> tuple[tuple[str, str] | None, bool]:
    model = make_model(seed=7)
    model.fc1.requires_grad_(False)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP)
    model.fc1.requires_grad_(True)
    opt.backward(model(batch(dist.get_rank(), 0)))
    got = error_of(opt.step)
    opt.zero_grad()
    return got, model.fc1.weight.grad is None


def test_unfreezing_a_parameter_frozen_at_construction_is_refused(pools):
    for got, cleared in pools(2).run(frozen_at_construction_case):
        assert got is not None and got[0] == "RuntimeError", got
        assert "requires_grad=False when the optimizer was built" in got[1], got
        assert cleared


# -- 6: torch.optim.AdamW's options: taken, implemented, or refused by name ----------------------
def adamw_options_case() -> dict:
    out = {}
    for key, value in (("capturable", True), ("differentiable", True), ("decoupled_weight_decay", False)):
        model = make_model()
        out[key] = error_of(lambda: shardopt.ShardedAdamW([{"params": model.parameters(), key: value}]))
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = shardopt.ShardedAdamW([{"params": model.parameters(), "fused": True, "foreach": False, "maximize": True,
                                      "amsgrad": True}])
    out["warned"] = [str(w.message) for w in caught if "param group" in str(w.message)]
    out["group"] = {k: opt.param_groups[0][k] for k in ("fused", "foreach", "maximize", "amsgrad")}
    return out


def test_adamw_options_are_taken_as_torch_takes_them_or_refused_by_name(pools):
    for out in pools(2).run(adamw_options_case):
        for key in ("capturable", "differentiable", "decoupled_weight_decay"):
            assert out[key] is not None and out[key][0] == "ValueError" and key in out[key][1], out
        assert out["warned"] == [], out  # foreach/fused choose torch's implementation: taken silently
        assert out["group"] == {"fused": True, "foreach": False, "maximize": True, "amsgrad": True}, out


# -- 8: fp16 weights and a plain loss.backward() ------------------------------------------------
def unscaled_backward_case() -> dict:
    rank = dist.get_rank()
    out = {}
    for how in ("opt", "plain"):
        model = make_model(seed=8, dtype=torch.float16)
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=2)  # dynamic scaling, 2**16
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = model(batch(rank, 0))
            opt.backward(loss) if how == "opt" else loss.backward()
            out[how] = opt.clip_grad_norm_(1.0).item()
            opt.step()
        out[how + "_warned"] = any("opt.backward(loss)" in str(w.message) for w in caught)
    model = make_model(seed=8, dtype=torch.float16)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=2)
    with opt.no_sync():
        opt.backward(model(batch(rank, 0)))
    model(batch(rank, 1)).backward()
    out["mixed"] = error_of(opt.step)
    ref = make_model(seed=8)  # fp32 reference norm of the averaged gradient
    ref(batch(rank, 0)).backward()
    ddp_average(ref)
    out["ref"] = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item()
    return out


def test_unscaled_fp16_backward_is_taken_as_unscaled(pools):
    for out in pools(2).run(unscaled_backward_case):
        assert abs(out["plain"] - out["ref"]) <= 1e-2 * out["ref"], out
        assert abs(out["opt"] - out["ref"]) <= 1e-2 * out["ref"], out
        assert out["plain_warned"] and not out["opt_warned"], out
        assert out["mixed"] is not None and "some backward passes ran through opt.backward" in out["mixed"][1]


def gradient_backward_case(how: str) -> dict:
    """fp16 weights, plain data parallelism: ``opt.backward(t, gradient=g)`` from a gradient of one's
    own, alone or beside an ``opt.backward(loss)`` of another loss in the same step. ``g`` carries no
    loss scale (no other stage made it), so the optimizer scales it as it scales a loss: the norm is
    the fp32 reference's, and no warning."""
    rank = dist.get_rank()
    model = make_model(seed=8, dtype=torch.float16)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=2)  # dynamic scaling, 2**16
    ref = make_model(seed=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "beside a loss":
            opt.backward(model(batch(rank, 0)))
        loss = model(batch(rank, 1))
        opt.backward(loss, gradient=torch.tensor(0.5, dtype=loss.dtype))  # d(0.5 * loss)
        norm = opt.clip_grad_norm_(1.0).item()
        opt.step()
    ref_loss = 0.5 * ref(batch(rank, 1)) + (ref(batch(rank, 0)) if how == "beside a loss" else 0.0)
    ref_loss.backward()
    ddp_average(ref)
    return {"norm": norm, "ref": torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item(),
            "warned": [str(w.message)[:80] for w in caught], "skipped": opt.skipped_steps}


def test_fp16_backward_from_a_gradient_of_ones_own_is_scaled(pools):
    pool = pools(2)
    for how in ("beside a loss", "alone"):
        for out in pool.run(gradient_backward_case, how):
            assert abs(out["norm"] - out["ref"]) <= 1e-2 * out["ref"], (how, out)
            assert out["warned"] == [] and out["skipped"] == 0, (how, out)


# -- 9: eps=0 and a parameter without a gradient -----------------------------------------------
def eps_zero_case(stage: int) -> tuple[float, bool]:
    model, ref = make_model(seed=9), make_model(seed=9)  # TinyNet.unused never gets a gradient
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, eps=0.0, stage=stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=0.0)
    for step in range(3):
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()
        ref_step(ref, ref_opt, step)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return param_diff(model, ref), finite


def test_eps_zero_leaves_gradient_free_parameters_alone(pools):
    pool = pools(2)
    for stage in (1, 2):
        for worst, finite in pool.run(eps_zero_case, stage):
            assert finite and worst <= 2e-6, (stage, worst)


def unused_on_one_rank_case(stage: int, user: int = 1, bucket_cap_mb: float = 25.0) -> float:
    """A parameter used on rank ``user`` only is trained with the averaged gradient, as under DDP.
    With tiny buckets (one parameter each) the first backward reduces its bucket without it on the
    other rank (``user`` 0), or places it where rank 1 completed it (``user`` 1)."""
    rank = dist.get_rank()
    model, ref = make_model(seed=10), make_model(seed=10)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage, bucket_cap_mb=bucket_cap_mb)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        for m in (model, ref):
            loss = m(batch(rank, step)) + (m.unused.sum() * 0.5 if rank == user else 0.0)
            opt.backward(loss) if m is model else loss.backward()
        opt.step()
        ddp_average(ref)
        ref_opt.step()
    return param_diff(model, ref)


def test_parameter_used_on_one_rank_only(pools):
    pool = pools(2)
    for stage in (1, 2):
        assert max(pool.run(unused_on_one_rank_case, stage)) <= 2e-6
        for user in (0, 1):
            assert max(pool.run(unused_on_one_rank_case, stage, user, 1e-4)) <= 2e-6, (stage, user)


# -- 10: torch.nn.utils.clip_grad_norm_ ---------------------------------------------------------
def torch_clip_case(stage: int) -> tuple[tuple[str, str] | None, float]:
    model, ref = make_model(seed=11), make_model(seed=11)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    got = None
    for step in range(3):
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        got = got or error_of(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
        opt.step()
        ref_opt.zero_grad()
        ref(batch(dist.get_rank(), step)).backward()
        ddp_average(ref)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
    return got, param_diff(model, ref)


def test_torch_clip_grad_norm_works_in_stage1_and_raises_in_stage2(pools):
    pool = pools(2)
    for got, worst in pool.run(torch_clip_case, 1):
        assert got is None and worst <= 2e-6, (got, worst)
    for got, _ in pool.run(torch_clip_case, 2):
        assert got is not None and got[0] == "RuntimeError" and "opt.clip_grad_norm_(max_norm)" in got[1], got
