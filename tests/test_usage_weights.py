"""Tier 2: weights written, loaded, converted or re-bound behind the optimizer's back.

Weights loaded into a model that already has an optimizer (and saved or resumed right after),
parameters converted or re-bound after construction, errors that name named parameters,
rank-dependent initialisation made equal, skipped steps kept through export and checkpoints,
meta-device models. Torch's result (``usage_reference``) or a clear error on every rank.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import shardopt
from models import batch, make_model
from usage_reference import HP, error_of, param_diff, ref_step


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
    after_ckpt = param_diff(model, third)
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
    local = torch.cat([b.master_fp32.clone().bfloat16() for b in opt.inspect().buffers])  # rounds as the weights do
    shardopt.save_checkpoint(path, model, opt)
    fresh = make_model(seed=13, dtype=torch.bfloat16)
    fresh_opt = shardopt.ShardedAdamW(fresh.parameters(), lr=1e-3, stage=2)
    shardopt.load_checkpoint(path, fresh, fresh_opt)
    exported = opt.full_state_dict()
    weights = torch.cat([b.shard_weights for b in opt.inspect().buffers])
    with torch.no_grad():  # a write opt cannot see, then the call that says so
        for p in model.parameters():
            p.data.mul_(0.5)
    opt.refresh_master_weights()
    halved = torch.cat([b.master_fp32 for b in opt.inspect().buffers])
    want = torch.cat([b.shard_weights.float() for b in opt.inspect().buffers])
    return {"state_dict": torch.equal(local, weights), "checkpoint": param_diff(fresh, pretrained),
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
    master = torch.cat([b.master_fp32.clone() for b in opt.inspect().buffers])
    model2 = make_model(seed=9, dtype=torch.bfloat16)
    opt2 = shardopt.ShardedAdamW(model2.parameters(), lr=1e-3, stage=2, master_weights=mode)
    for first, second in ((model2.load_state_dict, opt2.load_state_dict), (opt2.load_state_dict, model2.load_state_dict)):
        first(saved["model"] if first == model2.load_state_dict else saved["opt"])
        second(saved["opt"] if second == opt2.load_state_dict else saved["model"])
        opt2._agree_on_gradients(None)  # what clip_grad_norm_ and step check first
        got = torch.cat([b.master_fp32 for b in opt2.inspect().buffers])
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
        ref_step(ref, ref_opt, step)
    return param_diff(model, ref)


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
    reshaped = how == "reshaped" or (how == "one_rank_reshaped" and dist.get_rank() == 1)
    if reshaped:  # the forward still runs: broadcast over the model width
        model.scalar.data = model.scalar.data.expand(model.fc2.out_features).clone()

    def train() -> None:
        opt.zero_grad()
        if reshaped:  # autograd sums its gradient to the old shape; one assigned by hand has the new one
            model.scalar.grad = torch.ones_like(model.scalar)
        opt.backward(model(batch(dist.get_rank(), 1)))
        opt.step()

    return error_of(train)


def named_case() -> tuple[str, str] | None:
    model = make_model(seed=6, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.named_parameters(), **HP)
    model.fc1.weight.data = model.fc1.weight.data.float()
    return error_of(lambda: opt.clip_grad_norm_(1.0))


def test_errors_name_named_parameters(pools):
    for got in pools(2).run(named_case):
        assert got is not None and "parameter 'fc1.weight' is now (29, 17) torch.float32" in got[1], got


def test_converted_parameters_raise_on_every_rank(pools):
    pool = pools(2)
    for stage in (1, 2):
        for how in ("half", "float", "one_rank", "reshaped", "one_rank_reshaped"):
            for got in pool.run(converted_case, stage, how):
                assert got is not None and got[0] == "RuntimeError", (stage, how, got)
                assert "torch.bfloat16 on cpu when the optimizer was built" in got[1], got
                assert "then build the optimizer" in got[1] and "parameter #" in got[1], got


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
        ref_step(ref, ref_opt, step)
    train(model, opt, range(4))
    exported = opt.full_state_dict()
    shardopt.save_checkpoint(path, model, opt)
    train(model, opt, range(4, 6))
    resumed, resumed_opt = build(1, 25.0)
    shardopt.load_checkpoint(path, resumed, resumed_opt)
    train(resumed, resumed_opt, range(4, 6))
    out = {"resumed": param_diff(resumed, model)}
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


# -- 11: a model on the meta device --------------------------------------------------------------
def meta_case() -> tuple[str, str] | None:
    with torch.device("meta"):
        model = make_model()
    return error_of(lambda: shardopt.ShardedAdamW(model.parameters()))


def test_meta_parameters_are_refused_with_a_hint(pools):
    for got in pools(2).run(meta_case):
        assert got is not None and got[0] == "ValueError" and "meta device" in got[1] and "to_empty" in got[1], got
