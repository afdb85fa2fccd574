"""Everyday PyTorch usage with ShardedMuon on 2 real gloo ranks, against torch.optim.Muon +
torch.optim.AdamW stepped on the gradient averaged as DDP averages it: the usage guarantees of
ShardedAdamW (tests/test_usage_*.py) hold for the second rule too.

Catches: zeroing through the model, or never, that a Muon owner sees differently from torch
(gradients that do or do not add up across steps); a matrix frozen mid-run, or never used, that
Muon still moves (weight decay or a zero gradient orthogonalised); ranks that build ShardedMuon
over different parameters and hang instead of raising on every rank."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import shardopt
from models import batch, make_model
from usage_reference import ddp_average, error_of

MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW = dict(lr=5e-3, betas=(0.8, 0.99), weight_decay=0.0)


def _model() -> nn.Module:
    model = make_model(seed=2)
    model.spare = nn.Linear(4, 4, bias=False)  # a matrix no forward uses: never a gradient
    return model


def _groups(model: nn.Module) -> tuple[list, list]:
    mats = [p for p in model.parameters() if p.dim() == 2 and p.requires_grad]
    return mats, [p for p in model.parameters() if p.dim() != 2]


def usage_case(stage: int, how: str) -> tuple[float, float]:
    """``how``: "model" (model.zero_grad()), "never" (gradients add up), "freeze" (fc1 frozen
    after the first step). Returns the largest difference to torch of the matrices and the rest."""
    rank = dist.get_rank()
    model, ref = _model(), _model()
    mats, rest = _groups(model)
    opt = shardopt.ShardedMuon([{"params": mats}, {"params": rest, "use_muon": False, **ADAMW}], **MUON,
                               stage=stage, bucket_cap_mb=1e-4)
    ref_mats, ref_rest = _groups(ref)
    ref_opts = (torch.optim.Muon(ref_mats, **MUON), torch.optim.AdamW(ref_rest, **ADAMW))
    for step in range(4):
        if how == "freeze" and step == 1:
            for m in (model, ref):
                m.fc1.weight.requires_grad_(False)
        if how == "model":
            model.zero_grad()
        elif how == "freeze":
            opt.zero_grad()
        opt.backward(model(batch(rank, step)))
        opt.step()
        if how != "never":
            for o in ref_opts:
                o.zero_grad()
        ref(batch(rank, step)).backward()
        ddp_average(ref)
        for o in ref_opts:
            o.step()
    assert torch.equal(model.spare.weight.detach(), ref.spare.weight.detach())  # never touched by either
    ids = {id(p) for p in mats}
    worst = [0.0, 0.0]
    for p, q in zip(model.parameters(), ref.parameters()):
        k = 0 if id(p) in ids else 1
        worst[k] = max(worst[k], (p.detach() - q.detach()).abs().max().item())
    return worst[0], worst[1]


def test_zeroing_freezing_and_unused_matrices_follow_torch(pools):
    pool = pools(2)
    for stage in (1, 2):
        for how in ("model", "never", "freeze"):
            for muon_worst, adamw_worst in pool.run(usage_case, stage, how):
                assert muon_worst <= 1e-5 and adamw_worst <= 2e-6, (stage, how, muon_worst, adamw_worst)


def disagree_case() -> tuple[str, str] | None:
    model = _model()
    mats, rest = _groups(model)
    if dist.get_rank() == 1:
        mats = mats[:-1]  # this rank leaves a matrix out
    return error_of(lambda: shardopt.ShardedMuon([{"params": mats}, {"params": rest, "use_muon": False}]))


def test_ranks_that_disagree_on_the_parameters_raise_on_every_rank(pools):
    errors = pools(2).run(disagree_case)
    assert all(e is not None and e[0] == "ValueError" for e in errors), errors
    assert all("rank" in e[1] for e in errors), errors


def frozen_at_construction_case() -> tuple[float, tuple[str, str] | None]:
    """fc2's weight frozen before ShardedMuon is built over every matrix: left untouched; unfrozen
    later, the next step raises on every rank (it has no place in the shards)."""
    model = _model()
    model.fc2.weight.requires_grad_(False)
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    opt = shardopt.ShardedMuon([{"params": mats}, {"params": rest, "use_muon": False, **ADAMW}], **MUON)
    before = model.fc2.weight.detach().clone()
    for step in range(2):
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()
    moved = (model.fc2.weight.detach() - before).abs().max().item()
    model.fc2.weight.requires_grad_(True)
    opt.zero_grad()
    opt.backward(model(batch(dist.get_rank(), 2)))
    return moved, error_of(opt.step)


def test_a_matrix_frozen_at_construction_is_left_alone_and_unfreezing_it_raises_everywhere(pools):
    for moved, error in pools(2).run(frozen_at_construction_case):
        assert moved == 0.0
        assert error is not None and "requires_grad=False when" in error[1], error
