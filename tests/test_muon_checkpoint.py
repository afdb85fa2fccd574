"""ShardedMuon's sharded checkpoints: saved at 2 ranks, resumed at 1, 3 and 4 ranks and on a 2 x 2
mesh, continuing as the uninterrupted run; converted to plain PyTorch, a torch.optim.Muon +
torch.optim.AdamW pair continues it too."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

import shardopt
from models import batch, make_model
from shardopt.convert import convert_checkpoint, split_by_rule

MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW = dict(lr=5e-3, betas=(0.8, 0.99), weight_decay=0.0)
SAVED_AT, STEPS = 3, 5


def _groups(model):
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [{"params": mats}, {"params": rest, "use_muon": False, **ADAMW}]


def _opt(model, shape=None):
    mesh = None
    if shape is not None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    return shardopt.ShardedMuon(_groups(model), **MUON, stage=2, bucket_cap_mb=1e-4, device_mesh=mesh)


def _train(model, opt, start, stop):
    for step in range(start, stop):  # the same batches on every rank: the run does not depend on N
        opt.zero_grad()
        opt.backward(model(batch(0, step)))
        opt.step()


def save_case(path: str) -> list[torch.Tensor]:
    model = make_model(seed=1)
    opt = _opt(model)
    _train(model, opt, 0, SAVED_AT)
    shardopt.save_checkpoint(path, model, opt)
    _train(model, opt, SAVED_AT, STEPS)
    return [p.detach().clone() for p in model.parameters()]


def resume_case(path: str, shape) -> list[torch.Tensor]:
    model = make_model(seed=7)  # other weights: everything must come from the checkpoint
    opt = _opt(model, shape)
    shardopt.load_checkpoint(path, model, opt)
    _train(model, opt, SAVED_AT, STEPS)
    return [p.detach().clone() for p in model.parameters()]


def _worst(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("muon") / "ckpt")
    uninterrupted = pools(2).run(save_case, path)[0]
    return path, uninterrupted


@pytest.mark.parametrize("world_size, shape", [(1, None), (3, None), (4, None), (4, (2, 2))],
                         ids=["1", "3", "4", "2x2"])
def test_a_checkpoint_of_two_ranks_resumes_anywhere(pools, saved, world_size, shape):
    path, uninterrupted = saved
    for weights in pools(world_size).run(resume_case, path, shape):
        # Averages of equal gradients over 3 ranks round differently from 1, 2 or 4 (a few ulps).
        assert _worst(weights, uninterrupted) <= (0.0 if world_size in (1, 4) else 1e-5), world_size


def test_converted_checkpoint_continues_in_torch_muon_and_adamw(saved, tmp_path):
    path, uninterrupted = saved
    out = str(tmp_path / "plain.pt")
    convert_checkpoint(path, out)
    sd = torch.load(out)
    model = make_model(seed=7)
    model.load_state_dict(sd["model"])
    groups = _groups(model)
    muon_sd, adamw_sd = split_by_rule(sd["optim"])
    assert all(set(s) == {"momentum_buffer"} for s in muon_sd["state"].values()) and muon_sd["state"]
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in adamw_sd["state"].values()) and adamw_sd["state"]
    muon = torch.optim.Muon(groups[0]["params"], **MUON)
    adamw = torch.optim.AdamW(groups[1]["params"], **ADAMW)
    muon.load_state_dict(muon_sd)
    adamw.load_state_dict(adamw_sd)
    for step in range(SAVED_AT, STEPS):
        model.zero_grad()
        model(batch(0, step)).backward()
        muon.step()
        adamw.step()
    mats = {id(p) for p in groups[0]["params"]}
    for p, q in zip(model.parameters(), uninterrupted):
        if id(p) in mats:
            assert torch.equal(p.detach(), q)  # torch's Muon from the saved state: the same bits
        else:
            assert (p.detach() - q).abs().max().item() <= 2e-6  # ShardedAdamW's AdamW against torch's
    assert os.path.exists(out)


def consolidate_case() -> tuple:
    """Consolidated on rank 0 at 2 ranks, the state continues in a torch.optim.Muon + AdamW pair as
    the uninterrupted run; the pair's state dicts, joined, continue in a ShardedMuon at 2 ranks as
    the pair itself continues."""
    from shardopt.convert import join_by_rule

    model = make_model(seed=1)
    opt = _opt(model)
    _train(model, opt, 0, SAVED_AT)
    opt.consolidate_state_dict(to=0)
    sd = opt.state_dict() if dist.get_rank() == 0 else {}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, SAVED_AT, STEPS)
    uninterrupted = [p.detach().clone() for p in model.parameters()]
    out = {}
    if dist.get_rank() == 0:
        plain = make_model(seed=7)
        plain.load_state_dict(weights)
        groups = _groups(plain)
        muon_sd, adamw_sd = split_by_rule(sd)
        out["muon_state_keys"] = sorted({k for s in muon_sd["state"].values() for k in s})
        muon = torch.optim.Muon(groups[0]["params"], **MUON)
        adamw = torch.optim.AdamW(groups[1]["params"], **ADAMW)
        muon.load_state_dict(muon_sd)
        adamw.load_state_dict(adamw_sd)

        def pair_steps(start, stop):
            for step in range(start, stop):
                plain.zero_grad()
                plain(batch(0, step)).backward()
                muon.step()
                adamw.step()
        pair_steps(SAVED_AT, STEPS)
        out["pair_at_5"] = [p.detach().clone() for p in plain.parameters()]
        out["is_muon"] = [any(p is q for q in groups[0]["params"]) for p in plain.parameters()]
        # the pair's state at step 5 (a copy: torch's state_dict() returns the live tensors) ...
        sd = copy.deepcopy(join_by_rule(muon.state_dict(), adamw.state_dict()))
        resumed_from = {k: v.clone() for k, v in plain.state_dict().items()}
        pair_steps(STEPS, STEPS + 2)
        out["pair_at_7"] = [p.detach().clone() for p in plain.parameters()]
    # ... goes back into a ShardedMuon at 2 ranks
    back = make_model(seed=9)
    obj = [resumed_from if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    back.load_state_dict(obj[0])
    opt2 = _opt(back)
    opt2.load_state_dict(sd)
    _train(back, opt2, STEPS, STEPS + 2)
    return uninterrupted, [p.detach().clone() for p in back.parameters()], out


def test_consolidated_state_moves_to_torch_muon_and_adamw_and_back(pools):
    (uninterrupted, back, out), (_, back1, _) = pools(2).run(consolidate_case)
    assert out["muon_state_keys"] == ["momentum_buffer"]
    for is_muon, a, b in zip(out["is_muon"], out["pair_at_5"], uninterrupted):
        assert torch.equal(a, b) if is_muon else (a - b).abs().max().item() <= 2e-6
    diffs = [(is_muon, (a - b).abs().max().item()) for is_muon, a, b in zip(out["is_muon"], back, out["pair_at_7"])]
    for is_muon, a, b in zip(out["is_muon"], back, out["pair_at_7"]):
        assert torch.equal(a, b) if is_muon else (a - b).abs().max().item() <= 2e-6, diffs
    assert all(torch.equal(a, b) for a, b in zip(back, back1))  # both ranks hold the same weights
