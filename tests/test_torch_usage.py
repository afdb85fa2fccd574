"""Tier 2: ordinary torch.optim usage gives torch's result or a clear error on every rank.

Each case is something training code does every day with ``torch.optim.AdamW`` (and that
Trainer-style frameworks do for the user): param groups built from generators, zeroing through
the model, loading weights into a model that already has an optimizer, converting or re-binding
parameters, freezing and unfreezing, unsupported AdamW options, rank-dependent initialisation,
unscaled fp16 backward passes, eps=0 with parameters that got no gradient, torch's own gradient
clipping, meta-device models. The reference is a plain ``torch.optim.AdamW`` on the gradient
averaged over ranks the way DDP averages it (a plain ``all_reduce``; a parameter no rank has a
gradient for keeps ``grad=None``).
"""
from __future__ import annotations

import contextlib
import copy
import warnings

import torch
import torch.distributed as dist
from torch import nn

import shardopt
from models import batch, make_model

HP = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _ddp_average(model: nn.Module) -> None:
    """Average .grad over ranks as DDP does: None only where no rank has a gradient."""
    for p in model.parameters():
        if not p.requires_grad:
            continue
        has = torch.tensor([0.0 if p.grad is None else 1.0])
        dist.all_reduce(has, op=dist.ReduceOp.MAX)
        if has.item() == 0:
            continue
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, op=dist.ReduceOp.SUM)
        p.grad = g / dist.get_world_size()


def _ref_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, zero: bool = True) -> None:
    if zero:
        opt.zero_grad()
    model(batch(dist.get_rank(), step)).backward()
    _ddp_average(model)
    opt.step()


def _worst(a: nn.Module, b: nn.Module) -> float:
    return max((p.detach().float() - q.detach().float()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


def _error(fn) -> tuple[str, str] | None:
    try:
        fn()
    except (TypeError, ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return None


# -- 1: generators as param groups ----------------------------------------------------------
def generator_groups_case() -> tuple[float, float, float]:
    model, ref = make_model(seed=1), make_model(seed=1)
    opt = shardopt.ShardedAdamW([{"params": (p for p in model.parameters() if p.dim() >= 2)},
                                 {"params": (p for p in model.parameters() if p.dim() < 2), "weight_decay": 0.0}],
                                **HP, stage=2)
    ref_opt = torch.optim.AdamW([{"params": [p for p in ref.parameters() if p.dim() >= 2]},
                                 {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}], **HP)
    single, single_ref = make_model(seed=1), make_model(seed=1)
    opt1 = shardopt.ShardedAdamW([{"params": single.parameters()}], **HP, stage=1)
    ref1 = torch.optim.AdamW([{"params": single_ref.parameters()}], **HP)
    start = copy.deepcopy(model)
    for step in range(3):
        for m, o in ((model, opt), (single, opt1)):
            o.zero_grad()
            o.backward(m(batch(dist.get_rank(), step)))
            o.step()
        _ref_step(ref, ref_opt, step)
        _ref_step(single_ref, ref1, step)
    return _worst(model, ref), _worst(single, single_ref), _worst(model, start)


def test_generator_param_groups_are_trained(pools):
    for worst, worst_single, moved in pools(2).run(generator_groups_case):
        assert worst <= 2e-6 and worst_single <= 2e-6, (worst, worst_single)
        assert moved > 1e-3


# -- 2: zeroing through the model, or not at all ----------------------------------------------
def zero_through_model_case(stage: int, how: str) -> float:
    model, ref = make_model(seed=2), make_model(seed=2)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage, bucket_cap_mb=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    rank = dist.get_rank()
    for step in range(4):
        if how == "model":
            model.zero_grad()
        elif how == "model_keep":
            model.zero_grad(set_to_none=False)
        if how == "never_no_sync":  # two micro-batches, the first without communication
            with opt.no_sync():
                opt.backward(model(batch(rank + 7, step)))
            ref(batch(rank + 7, step)).backward()
        opt.backward(model(batch(rank, step)))
        opt.step()
        if how == "model_keep":
            ref.zero_grad(set_to_none=False)
        _ref_step(ref, ref_opt, step, zero=how == "model")
    return _worst(model, ref)


def test_model_zero_grad_and_no_zeroing_follow_torch(pools):
    pool = pools(2)
    for stage in (1, 2):
        for how in ("model", "model_keep", "never", "never_no_sync"):  # never: torch adds up every step's gradient
            assert max(pool.run(zero_through_model_case, stage, how)) <= 2e-6, (stage, how)


def zero_late_case(stage: int, how: str, dtype_name: str) -> float:
    """Zeroing between backward and step, between clipping and step, or between micro-batches."""
    rank, dtype = dist.get_rank(), getattr(torch, dtype_name)
    model, ref = make_model(seed=2, dtype=dtype), make_model(seed=2)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage, bucket_cap_mb=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        if how == "between_micro":  # the first micro-batch's gradient of fc1.weight is dropped
            with opt.no_sync():
                opt.backward(model(batch(rank + 7, step)))
            ref(batch(rank + 7, step)).backward()
            model.fc1.weight.grad = ref.fc1.weight.grad = None
        opt.backward(model(batch(rank, step)))
        ref(batch(rank, step)).backward()
        _ddp_average(ref)
        if how == "after_clip":
            opt.clip_grad_norm_(0.5)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        if how in ("before_step", "after_clip"):
            model.fc1.weight.grad = ref.fc1.weight.grad = None
            if step == 2:  # nothing is updated at all
                model.zero_grad()
                ref.zero_grad()
        opt.step()
        ref_opt.step()
    return _worst(model, ref)


def test_zeroing_late_follows_torch(pools):
    pool = pools(2)
    for stage in (1, 2):
        for how in ("before_step", "after_clip"):
            assert max(pool.run(zero_late_case, stage, how, "float32")) <= 2e-6, (stage, how)
        assert max(pool.run(zero_late_case, stage, "between_micro", "float32")) <= 2e-6, stage
        for how in ("model", "keep", "opt"):
            assert max(pool.run(zero_between_16bit_micro_batches_case, stage, how)) == 0.0, (stage, how)


def zero_between_16bit_micro_batches_case(stage: int, how: str) -> float:
    """16-bit parameters sum micro-batches in an fp32 buffer: zeroing between micro-batches must
    reach it, so the result is bit for bit that of the last micro-batch alone."""
    rank = dist.get_rank()
    runs = []
    for accumulate in (True, False):
        model = make_model(seed=2, dtype=torch.bfloat16)
        opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage, bucket_cap_mb=1e-4)
        for step in range(3):
            opt.zero_grad()
            if accumulate:
                with opt.no_sync():
                    opt.backward(model(batch(rank + 7, step)))
                if how == "opt":
                    opt.zero_grad()
                else:
                    model.zero_grad(set_to_none=how == "model")
            opt.backward(model(batch(rank, step)))
            opt.step()
        runs.append(model)
    return _worst(*runs)


def replaced_grad_case(stage: int) -> tuple[float, tuple[str, str] | None]:
    model, ref = make_model(seed=2), make_model(seed=2)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    opt.backward(model(batch(dist.get_rank(), 0)))
    ref(batch(dist.get_rank(), 0)).backward()
    _ddp_average(ref)
    ref.fc1.weight.grad = ref.fc1.weight.grad + 0.01
    ref_opt.step()
    if stage == 1:
        model.fc1.weight.grad = model.fc1.weight.grad + 0.01
        opt.step()
        return _worst(model, ref), None
    model.fc1.weight.grad = torch.full_like(model.fc1.weight, 0.01)
    return 0.0, _error(opt.step)


def test_gradient_replaced_after_backward(pools):
    pool = pools(2)
    for worst, _ in pool.run(replaced_grad_case, 1):
        assert worst <= 2e-6
    for _, got in pool.run(replaced_grad_case, 2):
        assert got is not None and got[0] == "RuntimeError" and "was replaced by a tensor after backward" in got[1]


def write_during_overlapped_gather_case(how: str) -> tuple[tuple[str, str] | None, float]:
    """Weights written right after an overlapped step. Through the parameters (``load_state_dict``)
    the write waits for the gathers and is kept; through a view taken before ``step()`` (which
    cannot wait) the gather may overwrite it, and the next step says so on every rank."""
    rank = dist.get_rank()
    model = make_model(seed=2)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, overlap_param_gather=True)
    views = [p.view(-1) for p in model.parameters()]  # plain tensors sharing the parameters' storage
    opt.backward(model(batch(rank, 0)))
    opt.step()
    written = make_model(seed=5)
    if how == "load_state_dict":
        model.load_state_dict(written.state_dict())  # the gathers may still be landing
        for g in opt.param_groups:
            g["lr"] = 0.0  # the next step keeps the written weights as they are
    else:
        with torch.no_grad():
            for v, q in zip(views, written.parameters()):
                v.copy_(q.view(-1))
    got = _error(lambda: (opt.zero_grad(), opt.backward(model(batch(rank, 1))), opt.step()))
    if how == "load_state_dict":
        opt.finish_param_gather()
        return got, _worst(model, written)
    # The documented way: wait for the gathers first; the written weights then become the master.
    opt.backward(model(batch(rank, 2)))
    opt.step()
    opt.finish_param_gather()
    target = make_model(seed=6)
    model.load_state_dict(target.state_dict())
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.zero_grad()
    opt.backward(model(batch(rank, 3)))
    opt.step()
    opt.finish_param_gather()
    return got, _worst(model, target)


def test_weights_written_during_an_overlapped_gather(pools):
    pool = pools(2)
    for got, worst in pool.run(write_during_overlapped_gather_case, "view"):
        assert got is not None and "call opt.finish_param_gather() before writing" in got[1], got
        assert worst <= 2e-3  # lr=0 leaves only weight decay of 0: the loaded weights, decayed by 1 - 0
    for got, worst in pool.run(write_during_overlapped_gather_case, "load_state_dict"):
        assert got is None, got  # the write waited for the gathers
        assert worst <= 2e-3


def rebound_late_case(stage: int, when: str) -> float:
    """p.data = t (16-bit weights, fp32 master) between clipping and step, or on rank 0 only
    followed by a state_dict() on rank 0 only: the written values win, on every rank."""
    rank = dist.get_rank()
    model = make_model(seed=2, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=0.0, weight_decay=0.0, stage=stage)
    target = make_model(seed=14, dtype=torch.bfloat16)
    opt.backward(model(batch(rank, 0)))
    if when == "after_clip":
        opt.clip_grad_norm_(1.0)
    if when == "after_clip" or rank == 0:
        for p, q in zip(model.parameters(), target.parameters()):
            p.data = q.detach().clone()
    if when == "state_dict" and rank == 0:
        opt.state_dict()
    opt.step()
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), target.parameters()) if p.requires_grad)


def test_rebound_late_is_kept(pools):
    pool = pools(2)
    for stage in (1, 2):
        for when in ("after_clip", "state_dict"):
            assert max(pool.run(rebound_late_case, stage, when)) == 0.0, (stage, when)


def read_between_micro_batches_case(stage: int, convert: bool) -> tuple[str, str] | None:
    rank = dist.get_rank()
    model = make_model(seed=2, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    with opt.no_sync():
        opt.backward(model(batch(rank, 0)))
    if not convert:
        return _error(lambda: model.fc1.weight.grad.norm())
    model.float()

    def finish() -> None:
        opt.backward(model(batch(rank, 1)))
        opt.step()

    return _error(finish)


def test_between_16bit_micro_batches(pools):
    pool = pools(2)
    for stage in (1, 2):
        for got in pool.run(read_between_micro_batches_case, stage, False):
            assert got is not None and "being summed in fp32" in got[1] and "stage=2" not in got[1], got
        for got in pool.run(read_between_micro_batches_case, stage, True):
            assert got is not None and "torch.bfloat16 on cpu when ShardedAdamW was built" in got[1], got


def opt_zero_keep_case(stage: int) -> float:
    """opt.zero_grad(set_to_none=False): zero gradients that still count, as in torch (a parameter
    frozen after it had one keeps being decayed and moved by momentum)."""
    model, ref = make_model(seed=2), make_model(seed=2)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(4):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=False)
            m.fc2.requires_grad_(not 1 <= step < 3)
            if step < 3:  # the last step runs on zero gradients only
                loss = m(batch(dist.get_rank(), step))
                opt.backward(loss) if m is model else loss.backward()
                if m is ref:
                    _ddp_average(ref)
            o.step()
    return _worst(model, ref)


def test_opt_zero_grad_keeping_zero_gradients(pools):
    pool = pools(2)
    for stage in (1, 2):
        assert max(pool.run(opt_zero_keep_case, stage)) <= 2e-6, stage


# -- 3: weights loaded into a model that already has an optimizer ---------------------------
def load_into_trained_model_case(stage: int, path: str) -> dict:
    rank = dist.get_rank()
    model = make_model(seed=3, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    opt.backward(model(batch(rank, 0)))
    opt.step()
    other = make_model(seed=4, dtype=torch.bfloat16)
    target = {k: v.clone() for k, v in other.state_dict().items()}
    model.load_state_dict(target)
    for g in opt.param_groups:
        g["lr"] = 0.0
        g["weight_decay"] = 0.0
    opt.zero_grad()
    opt.backward(model(batch(rank, 1)))
    opt.step()
    after_load = max((model.state_dict()[k].float() - v.float()).abs().max().item() for k, v in target.items())
    # Weights-only load_checkpoint into the same trained model.
    third = make_model(seed=5, dtype=torch.bfloat16)
    third_opt = shardopt.ShardedAdamW(third.parameters(), **HP, stage=stage)
    shardopt.save_checkpoint(path, third, third_opt)
    shardopt.load_checkpoint(path, model)
    opt.zero_grad()
    opt.backward(model(batch(rank, 2)))
    opt.step()
    after_ckpt = _worst(model, third)
    # Loaded on rank 0 only: rank 0's values are taken everywhere, so the replicas stay equal.
    if rank == 0:
        model.load_state_dict(other.state_dict())
    opt.zero_grad()
    opt.backward(model(batch(rank, 3)))
    opt.step()
    rank0_only = max((p - q).abs().max().item() for p, q in zip(model.parameters(), other.parameters())
                     if p.requires_grad)  # a frozen parameter is the user's, as under DDP
    return {"after_load": after_load, "after_ckpt": after_ckpt, "rank0_only": rank0_only}


def test_weights_loaded_after_construction_become_the_master(pools, tmp_path):
    pool = pools(2)
    for stage in (1, 2):
        for r in pool.run(load_into_trained_model_case, stage, str(tmp_path / f"ckpt{stage}")):
            assert r == {"after_load": 0.0, "after_ckpt": 0.0, "rank0_only": 0.0}, (stage, r)


def save_right_after_load_case(path: str) -> dict:
    """Weights loaded, then saved or exported before any step: the saved master is the loaded weights."""
    rank = dist.get_rank()
    model = make_model(seed=3, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=2)
    opt.backward(model(batch(rank, 0)))
    opt.step()
    pretrained = make_model(seed=12, dtype=torch.bfloat16)
    model.load_state_dict(pretrained.state_dict())
    opt.state_dict()  # on this rank alone: its shard of the master follows the loaded weights
    local = torch.cat([b.master.fp32().clone().bfloat16() for b in opt._buffers])  # rounds as the weights do
    shardopt.save_checkpoint(path, model, opt)
    fresh = make_model(seed=13, dtype=torch.bfloat16)
    fresh_opt = shardopt.ShardedAdamW(fresh.parameters(), lr=1e-3, stage=2)
    shardopt.load_checkpoint(path, fresh, fresh_opt)
    exported = opt.full_state_dict()
    weights = torch.cat([b.flat.slice(b.shard_range) for b in opt._buffers])
    with torch.no_grad():  # a write opt cannot see, then the call that says so
        for p in model.parameters():
            p.data.mul_(0.5)
    opt.refresh_master_weights()
    halved = torch.cat([b.master.fp32() for b in opt._buffers])
    want = torch.cat([b.flat.slice(b.shard_range).float() for b in opt._buffers])
    return {"state_dict": torch.equal(local, weights), "checkpoint": _worst(fresh, pretrained),
            "export_steps": sorted({float(s["step"]) for s in exported.get("state", {}).values()}),
            "refresh": torch.equal(halved, want)}


def test_save_and_export_right_after_loading_weights(pools, tmp_path):
    out = pools(2).run(save_right_after_load_case, str(tmp_path / "after_load"))
    for r in out:
        assert r["state_dict"] and r["checkpoint"] == 0.0 and r["refresh"], r
    assert out[0]["export_steps"] == [1.0]


def load_in_resume_order_case(mode: str) -> float:
    """model.load_state_dict then opt.load_state_dict (the usual resume), and the other way round:
    the exact master is kept."""
    rank = dist.get_rank()
    model = make_model(seed=3, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=2, master_weights=mode)
    for step in range(3):
        opt.zero_grad()
        opt.backward(model(batch(rank, step)))
        opt.step()
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    master = torch.cat([b.master.fp32().clone() for b in opt._buffers])
    model2 = make_model(seed=9, dtype=torch.bfloat16)
    opt2 = shardopt.ShardedAdamW(model2.parameters(), lr=1e-3, stage=2, master_weights=mode)
    for first, second in ((model2.load_state_dict, opt2.load_state_dict), (opt2.load_state_dict, model2.load_state_dict)):
        first(saved["model"] if first == model2.load_state_dict else saved["opt"])
        second(saved["opt"] if second == opt2.load_state_dict else saved["model"])
        opt2._agree_on_gradients(None)  # what clip_grad_norm_ and step check first
        got = torch.cat([b.master.fp32() for b in opt2._buffers])
        assert torch.equal(got, master), (got - master).abs().max()
    return 0.0


def test_resume_order_keeps_the_exact_master(pools):
    for mode in ("fp32", "remainder"):
        pools(2).run(load_in_resume_order_case, mode)


# -- 4: parameters converted or re-bound after construction -------------------------------------
def rebind_case(stage: int, how: str) -> float:
    model, ref = make_model(seed=6), make_model(seed=6)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(4):
        if step == 2:
            if how == "data":
                for p in model.parameters():
                    p.data = p.data.clone()
            else:
                model.to("cpu:0")
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()
        _ref_step(ref, ref_opt, step)
    return _worst(model, ref)


def test_rebound_parameters_keep_training(pools):
    pool = pools(2)
    for stage in (1, 2):
        for how in ("data", "to"):
            assert max(pool.run(rebind_case, stage, how)) <= 2e-6, (stage, how)


def converted_case(stage: int, how: str) -> tuple[str, str] | None:
    model = make_model(seed=6, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    opt.backward(model(batch(dist.get_rank(), 0)))
    opt.step()
    if how == "half":
        model.half()
    elif how == "float":
        model.float()
    elif how == "one_rank" and dist.get_rank() == 1:  # the forward still runs (type promotion)
        model.scalar.data = model.scalar.data.half()

    def train() -> None:
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), 1)))
        opt.step()

    return _error(train)


def named_case() -> tuple[str, str] | None:
    model = make_model(seed=6, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.named_parameters(), **HP)
    model.fc1.weight.data = model.fc1.weight.data.float()
    return _error(lambda: opt.clip_grad_norm_(1.0))


def test_errors_name_named_parameters(pools):
    for got in pools(2).run(named_case):
        assert got is not None and "parameter 'fc1.weight' is now (29, 17) torch.float32" in got[1], got


def test_converted_parameters_raise_on_every_rank(pools):
    pool = pools(2)
    for stage in (1, 2):
        for how in ("half", "float", "one_rank"):
            for got in pool.run(converted_case, stage, how):
                assert got is not None and got[0] == "RuntimeError", (stage, how, got)
                assert "torch.bfloat16 on cpu when ShardedAdamW was built" in got[1], got
                assert "then build ShardedAdamW" in got[1] and "parameter #" in got[1], got


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
        _ref_step(ref, ref_opt, step)
        worst.append(_worst(model, ref))
    return worst


def test_freezing_and_unfreezing_follow_torch(pools):
    pool = pools(2)
    for stage in (1, 2):
        for worst in pool.run(freeze_case, stage):
            assert max(worst) <= 2e-6, (stage, worst)


def skipped_steps_resume_case(path: str) -> dict:
    """A parameter frozen for some steps has its own step count: in the AdamW export and through a
    checkpoint loaded with another stage and bucket size."""
    rank = dist.get_rank()

    def build(stage: int, cap: float):
        model = make_model(seed=7)
        return model, shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage, bucket_cap_mb=cap)

    def train(model, opt, steps) -> None:
        for step in steps:
            model.fc1.requires_grad_(not 1 <= step < 3)
            opt.zero_grad()
            opt.backward(model(batch(rank, step)))
            opt.step()

    model, opt = build(2, 1e-4)
    ref, ref_opt = make_model(seed=7), None
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(4):
        ref.fc1.requires_grad_(not 1 <= step < 3)
        _ref_step(ref, ref_opt, step)
    train(model, opt, range(4))
    exported = opt.full_state_dict()
    shardopt.save_checkpoint(path, model, opt)
    train(model, opt, range(4, 6))
    resumed, resumed_opt = build(1, 25.0)
    shardopt.load_checkpoint(path, resumed, resumed_opt)
    train(resumed, resumed_opt, range(4, 6))
    out = {"resumed": _worst(resumed, model)}
    if rank == 0:
        theirs = ref_opt.state_dict()["state"]
        out["steps"] = {i: float(s["step"]) for i, s in exported["state"].items()}
        out["ref_steps"] = {i: float(s["step"]) for i, s in theirs.items()}
    return out


def test_skipped_steps_survive_export_and_checkpoints(pools, tmp_path):
    out = pools(2).run(skipped_steps_resume_case, str(tmp_path / "skipped"))
    assert out[0]["steps"] == out[0]["ref_steps"] and 2.0 in out[0]["steps"].values(), out[0]
    for r in out:
        assert r["resumed"] <= 2e-6, r


def reentrant_checkpoint_case(stage: int, reentrant: bool) -> float:
    """Activation checkpointing runs parts of backward as nested backward passes."""
    from torch.utils.checkpoint import checkpoint

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])

    def loss(m: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        for layer in m:
            x = checkpoint(lambda t, layer=layer: torch.tanh(layer(t)), x, use_reentrant=reentrant)
        return x.square().mean()

    model, ref = build(), build()
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage, bucket_cap_mb=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank())).requires_grad_()
        opt.zero_grad()
        opt.backward(loss(model, x))
        opt.step()
        ref_opt.zero_grad()
        loss(ref, x).backward()
        _ddp_average(ref)
        ref_opt.step()
    return _worst(model, ref)


def test_activation_checkpointing(pools):
    pool = pools(2)
    for stage in (1, 2):
        for reentrant in (True, False):
            assert max(pool.run(reentrant_checkpoint_case, stage, reentrant)) <= 2e-6, (stage, reentrant)


def frozen_at_construction_case() -> tuple[tuple[str, str] | None, bool]:
    model = make_model(seed=7)
    model.fc1.requires_grad_(False)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP)
    model.fc1.requires_grad_(True)
    opt.backward(model(batch(dist.get_rank(), 0)))
    got = _error(opt.step)
    opt.zero_grad()
    return got, model.fc1.weight.grad is None


def test_unfreezing_a_parameter_frozen_at_construction_is_refused(pools):
    for got, cleared in pools(2).run(frozen_at_construction_case):
        assert got is not None and got[0] == "RuntimeError", got
        assert "requires_grad=False when ShardedAdamW was built" in got[1], got
        assert cleared


# -- 6: AdamW options ShardedAdamW does not implement ------------------------------------------
def unsupported_options_case() -> dict:
    out = {}
    for key, value in (("maximize", True), ("amsgrad", True), ("capturable", True), ("decoupled_weight_decay", False)):
        model = make_model()
        out[key] = _error(lambda: shardopt.ShardedAdamW([{"params": model.parameters(), key: value}]))
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardopt.ShardedAdamW([{"params": model.parameters(), "fused": True, "maximize": False}])
    out["fused_warning"] = any("fused= is ignored" in str(w.message) for w in caught)
    return out


def test_unsupported_adamw_options_are_refused(pools):
    for out in pools(2).run(unsupported_options_case):
        for key in ("maximize", "amsgrad", "capturable", "decoupled_weight_decay"):
            assert out[key] is not None and out[key][0] == "ValueError" and f"param group 0 sets {key}=" in out[key][1]
        assert out["fused_warning"]


# -- 7: rank-dependent initialisation ---------------------------------------------------------
class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(self.frozen(x))).square().mean()


def rank_seed_case() -> tuple[bool, bool, bool]:
    torch.manual_seed(dist.get_rank())
    model = BNNet()
    model(torch.randn(8, 4)).backward()  # running statistics now differ across ranks too
    shardopt.ShardedAdamW(model.parameters(), lr=1e-3)

    def same(ts: list[torch.Tensor]) -> bool:
        flat = torch.cat([t.detach().reshape(-1).float() for t in ts])
        copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, flat)
        return all(torch.equal(c, copies[0]) for c in copies)

    params_equal = same(list(model.parameters()))
    buffers_before = same(list(model.buffers()))
    shardopt.sync_module_states(model)
    return params_equal, buffers_before, same(list(model.parameters()) + list(model.buffers()))


def test_rank_dependent_init_is_made_equal(pools):
    for params_equal, buffers_before, all_equal in pools(2).run(rank_seed_case):
        assert params_equal  # frozen parameters given to the optimizer follow rank 0 as well
        assert not buffers_before  # the optimizer never sees buffers ...
        assert all_equal  # ... sync_module_states does


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
    out["mixed"] = _error(opt.step)
    ref = make_model(seed=8)  # fp32 reference norm of the averaged gradient
    ref(batch(rank, 0)).backward()
    _ddp_average(ref)
    out["ref"] = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item()
    return out


def test_unscaled_fp16_backward_is_taken_as_unscaled(pools):
    for out in pools(2).run(unscaled_backward_case):
        assert abs(out["plain"] - out["ref"]) <= 1e-2 * out["ref"], out
        assert abs(out["opt"] - out["ref"]) <= 1e-2 * out["ref"], out
        assert out["plain_warned"] and not out["opt_warned"], out
        assert out["mixed"] is not None and "some backward passes ran through opt.backward" in out["mixed"][1]


# -- 9: eps=0 and a parameter without a gradient -----------------------------------------------
def eps_zero_case(stage: int) -> tuple[float, bool]:
    model, ref = make_model(seed=9), make_model(seed=9)  # TinyNet.unused never gets a gradient
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, eps=0.0, stage=stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=0.0)
    for step in range(3):
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()
        _ref_step(ref, ref_opt, step)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return _worst(model, ref), finite


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
        _ddp_average(ref)
        ref_opt.step()
    return _worst(model, ref)


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
        got = got or _error(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
        opt.step()
        ref_opt.zero_grad()
        ref(batch(dist.get_rank(), step)).backward()
        _ddp_average(ref)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
    return got, _worst(model, ref)


def test_torch_clip_grad_norm_works_in_stage1_and_raises_in_stage2(pools):
    pool = pools(2)
    for got, worst in pool.run(torch_clip_case, 1):
        assert got is None and worst <= 2e-6, (got, worst)
    for got, _ in pool.run(torch_clip_case, 2):
        assert got is not None and got[0] == "RuntimeError" and "opt.clip_grad_norm_(max_norm)" in got[1], got


# -- 11: a model on the meta device --------------------------------------------------------------
def meta_case() -> tuple[str, str] | None:
    with torch.device("meta"):
        model = make_model()
    return _error(lambda: shardopt.ShardedAdamW(model.parameters()))


def test_meta_parameters_are_refused_with_a_hint(pools):
    for got in pools(2).run(meta_case):
        assert got is not None and got[0] == "ValueError" and "meta device" in got[1] and "to_empty" in got[1], got


# -- frameworks: DDP wrappers, state dicts saved by rank 0 ---------------------------------------
def ddp_wrapper_case(stage: int, freeze_first: bool = False) -> tuple:
    model = make_model(seed=2)
    next(model.parameters()).requires_grad_(not freeze_first)  # a frozen parameter first must not hide it
    opt = shardopt.ShardedAdamW([p for p in model.parameters() if p.requires_grad], **HP, stage=stage)
    wrapped = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = _error(lambda: wrapped(batch(dist.get_rank(), 0)))
    plain = make_model(seed=2)  # a DDP model trained by a plain AdamW is none of shardopt's business
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        nn.parallel.DistributedDataParallel(plain)(batch(dist.get_rank(), 0))
    del opt
    return error, [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)], \
        [str(w.message) for w in quiet if "ShardedAdamW" in str(w.message)]


def test_a_ddp_wrapper_is_refused_in_stage2_and_warned_about_in_stage1(pools):
    pool = pools(2)
    for freeze_first in (False, True):
        for error, warned, quiet in pool.run(ddp_wrapper_case, 2, freeze_first):
            assert error and error[0] == "RuntimeError" and "ShardedTrainer" in error[1] and not quiet, error
        for error, warned, quiet in pool.run(ddp_wrapper_case, 1, freeze_first):
            assert error is None and len(warned) == 1 and "doubling the communication" in warned[0], (error, warned)


def rank0_state_dict_case(path: str) -> tuple:
    """What a framework does: rank 0 saves state_dict(), every rank loads that file."""
    rank = dist.get_rank()
    model = make_model(seed=3, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=2)
    for step in range(2):
        opt.zero_grad()
        opt.backward(model(batch(rank, step)))
        opt.step()
    if rank == 0:
        torch.save(opt.state_dict(), path)
    dist.barrier()
    refused = _error(lambda: opt.load_state_dict(torch.load(path, weights_only=True)))
    opt.consolidate_state_dict()
    whole = opt.state_dict()
    fsd = opt.full_state_dict()
    if rank == 0:
        torch.save(whole, path)
        assert set(whole) == {"state", "param_groups", "shardopt"}
        for i, s in fsd["state"].items():  # the same moments as full_state_dict, plus the masters
            assert all(torch.equal(s[k], whole["state"][i][k]) for k in s), i
        trained = {i for i, p in enumerate(model.parameters()) if p.requires_grad}
        assert set(whole["shardopt"]["master"]) == trained, (sorted(whole["shardopt"]["master"]), trained)
    dist.barrier()
    master = torch.cat([b.master.fp32().clone() for b in opt._buffers])
    other = make_model(seed=8, dtype=torch.bfloat16)
    opt2 = shardopt.ShardedAdamW(other.parameters(), lr=1e-3, stage=1)
    opt2.load_state_dict(torch.load(path, weights_only=True))
    exact = torch.equal(torch.cat([b.master.fp32() for b in opt2._buffers]), master)
    weights_equal = all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()) if p.requires_grad)
    opt.zero_grad()
    opt.backward(model(batch(rank, 5)))
    opt.step()
    after_step = opt.state_dict().get("format")  # the consolidated copy is stale after a step
    return refused, exact, weights_equal, after_step


def test_state_dict_saved_by_rank0_is_refused_everywhere_unless_consolidated(pools, tmp_path):
    for rank, (refused, exact, weights_equal, after_step) in enumerate(
            pools(2).run(rank0_state_dict_case, str(tmp_path / "opt.pt"))):
        assert refused and refused[0] == "ValueError", (rank, refused)  # on rank 0 too: no rank hangs
        assert "consolidate_state_dict" in refused[1], refused
        assert exact and weights_equal, rank  # the exact fp32 master, at another stage
        assert after_step == "shardopt.rank_shard.v1"


def superseded_case(stage: int) -> tuple:
    """A second ShardedAdamW over the same parameters (a framework's second fit, a learning-rate
    finder first): it trains as a fresh AdamW would, and the first one refuses to step."""
    model, ref = make_model(seed=4), make_model(seed=4)
    first = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    ref_first = torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(2):
        first.zero_grad()
        first.backward(model(batch(dist.get_rank(), step)))
        first.step()
        _ref_step(ref, ref_first, step)
    second = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    ref_second = torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(2, 5):
        second.zero_grad()
        second.backward(model(batch(dist.get_rank(), step)))
        second.step()
        _ref_step(ref, ref_second, step)
    worst = _worst(model, ref)
    refused = _error(first.step)
    second.close()
    plain = torch.optim.AdamW(model.parameters(), **HP)  # after close(), p.grad is torch's again
    plain.zero_grad()
    model(batch(dist.get_rank(), 5)).backward()
    real_grads = all(p.grad is None or p.grad.untyped_storage().nbytes() > 0 for p in model.parameters())
    return worst, refused, real_grads


def test_a_second_optimizer_over_the_same_parameters_takes_them_over(pools):
    for stage in (1, 2):
        for worst, refused, real_grads in pools(2).run(superseded_case, stage):
            assert worst <= 2e-6, (stage, worst)
            assert refused and refused[0] == "RuntimeError" and "superseded" in refused[1], refused
            assert real_grads, stage


# -- activation checkpointing, reentrant or not ------------------------------------------------
class Checkpointed(nn.Module):
    """TinyNet's layers with the middle block recomputed in backward (torch.utils.checkpoint)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.net, self.reentrant = make_model(seed=6), reentrant

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        import torch.utils.checkpoint as ck

        n = self.net
        x = n.emb(idx)

        def block(x: torch.Tensor) -> torch.Tensor:
            return n.fc2(torch.relu(n.norm(n.fc1(x)))) * n.scalar

        x = x + ck.checkpoint(block, x, use_reentrant=self.reentrant)
        logits = n.head(x)
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), idx.roll(1, dims=-1).view(-1))


class CheckpointedUntied(Checkpointed):
    """As above with an untied head: the first gradient arrives outside the recomputed block."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__(reentrant)
        self.net.head.weight = nn.Parameter(self.net.emb.weight.detach().clone())


def checkpointed_case(stage: int, reentrant: bool, untied: bool) -> float:
    rank = dist.get_rank()
    kind = CheckpointedUntied if untied else Checkpointed
    model, ref = kind(reentrant), kind(reentrant)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage, bucket_cap_mb=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(3):
        opt.zero_grad()
        model(batch(rank, step)).backward()
        opt.step()
        _ref_step(ref, ref_opt, step)
    return _worst(model, ref)


def test_checkpointing_with_parameters_outside_the_recomputed_block(pools):
    pool = pools(2)
    for stage in (1, 2):
        for reentrant in (True, False):
            for untied in (False, True):
                for worst in pool.run(checkpointed_case, stage, reentrant, untied):
                    assert worst < 1e-6, (stage, reentrant, untied, worst)



def used_inside_and_outside_case(stage: int) -> tuple[str, str] | None:
    """A layer used before a reentrant checkpoint and again inside it: autograd accumulates its
    gradient twice in one backward (the outer and the nested pass)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    a, b, c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    model = nn.ModuleList([a, b, c])
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage, bucket_cap_mb=1e-5)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    h = checkpoint(lambda t: torch.tanh(a(b(t))), a(x), use_reentrant=True)
    c(h).square().sum().backward()  # the gradient it cannot reduce is reported at the step, on every rank
    error = _error(opt.step)
    opt.close()
    return error


def test_a_second_gradient_after_its_bucket_was_reduced_is_refused(pools):
    """It used to be dropped (or left unaveraged) without a word: weights 0.02-0.05 off after 3 steps.
    Then it raised in the hook of the ranks that saw it, and the others lost their connection."""
    for stage in (1, 2):
        for got in pools(2).run(used_inside_and_outside_case, stage):
            assert got is not None and "second gradient in one backward pass" in got[1], (stage, got)


def reentrant_differing_graphs_case(stage: int, unused: bool, twice: bool = False) -> float:
    """Rank 0's backward reaches a reentrant-checkpointed layer first, rank 1's last: in the first
    backward the outer pass does not show that layer's parameters on either rank, and rank 1 reduces
    its bucket before the nested pass gives it a gradient. With ``unused``, a layer rank 1 does
    not use comes first in backward; with ``twice``, rank 1 applies the checkpointed layer twice
    (two nested passes, two gradients in one backward), in every step: a layer used only inside
    reentrant checkpoints is reduced when the outer pass ends, with both.
    Trained as torch AdamW over DDP-averaged gradients."""
    from torch.utils.checkpoint import checkpoint

    rank = dist.get_rank()

    def layers() -> nn.ModuleList:
        torch.manual_seed(0)
        return nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    model, ref = layers(), layers()
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage, bucket_cap_mb=1100 / 2**20)  # a bucket per layer
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(3):
        for m in (model, ref):
            a, b, h, u = m
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step + 10 * rank)).requires_grad_(True)
            inner = checkpoint(a, x, use_reentrant=True) if twice else x
            y = h(checkpoint(a, b(x), use_reentrant=True)) if rank == 0 else h(b(checkpoint(a, inner, use_reentrant=True)))
            if unused and rank == 0:
                y = u(y)
            y.square().mean().backward()
        opt.step()
        opt.zero_grad()
        _ddp_average(ref)
        ref_opt.step()
        ref_opt.zero_grad()
    return _worst(model, ref)


def test_reentrant_checkpoint_in_graphs_that_differ_per_rank(pools):
    # It used to raise on rank 1 in the first backward (its bucket counted reduced without the
    # checkpointed layer), leaving rank 0 waiting on a closed connection.
    for stage in (1, 2):
        for unused, twice in ((False, False), (True, False), (False, True)):
            worst = max(pools(2).run(reentrant_differing_graphs_case, stage, unused, twice))
            assert worst <= 2e-6, (stage, unused, twice)
