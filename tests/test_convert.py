"""Converting torch optimizers into one sharded optimizer (``shardopt.integrations.from_torch``),
in one process, against the torch optimizers themselves: a torch.optim.Muon + torch.optim.AdamW
pair with an LR scheduler on each becomes one ShardedMuon whose Muon matrices and AdamW parameters
follow torch's bit for bit, and whose learning rates are the ones each scheduler sets on its own
groups.

Catches: the pair's groups or hyperparameters lost or crossed in the merge; a scheduler left on
the replaced optimizer (its learning rates stop reaching the step) or driving the other rule's
groups; a stepped or unsupported optimizer taken over silently."""
from __future__ import annotations

import copy

import pytest
import torch

import shardopt
from models import batch, make_model
from shardopt.integrations import from_torch
from shardopt.integrations._convert import replacements, retarget_scheduler

pytestmark = pytest.mark.usefixtures("one_rank_group")


def torch_pair(model):
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    muon = torch.optim.Muon([{"params": mats[:1], "lr": 0.03}, {"params": mats[1:]}], lr=0.02, momentum=0.9,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=3e-3, betas=(0.8, 0.95), weight_decay=0.05)
    scheds = [torch.optim.lr_scheduler.LambdaLR(muon, lambda s: 1.0 / (1 + s)),
              torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: min(1.0, (s + 1) / 3))]
    return muon, adamw, scheds


def test_a_muon_and_adamw_pair_trains_as_torch_and_its_schedulers_drive_their_own_groups():
    ref = make_model(seed=1)
    model = copy.deepcopy(ref)
    muon, adamw, ref_scheds = torch_pair(ref)
    given = torch_pair(model)
    opt = from_torch(given[:2])
    assert isinstance(opt, shardopt.ShardedMuon)
    replaced = replacements(given[:2], opt)
    for s in given[2]:
        retarget_scheduler(s, replaced)
    assert [g.get("use_muon", True) for g in opt.param_groups] == [True, True, False]
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[1]["adjust_lr_fn"] == "match_rms_adamw"
    assert opt.param_groups[2]["betas"] == (0.8, 0.95) and opt.param_groups[2]["weight_decay"] == 0.05
    lrs, ref_lrs = [], []
    for step in range(4):
        for m, opts, scheds, record in ((ref, (muon, adamw), ref_scheds, ref_lrs), (model, (opt,), given[2], lrs)):
            for o in opts:
                o.zero_grad()
            m(batch(0, step)).backward()
            record.append([g["lr"] for o in opts for g in o.param_groups])
            for o in opts:
                o.step()
            for s in scheds:
                s.step()
    assert lrs == ref_lrs and len({tuple(x) for x in ref_lrs}) == 4, ref_lrs
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), name


def test_an_adamw_alone_becomes_a_sharded_adamw():
    model = make_model(seed=1)
    opt = from_torch([torch.optim.AdamW(model.parameters(), lr=0.01)], stage=1)
    assert type(opt) is shardopt.ShardedAdamW and opt.param_groups[0]["lr"] == 0.01 and opt.inspect().stage == 1


def test_what_cannot_be_merged_is_refused_with_what_to_do():
    model = make_model(seed=1)
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    with pytest.raises(ValueError, match="one torch.optim.Muon and one torch.optim.AdamW"):
        from_torch([torch.optim.Muon(mats[:1]), torch.optim.Muon(mats[1:]), torch.optim.AdamW(rest)])
    with pytest.raises(TypeError, match=r"torch\.optim\.sgd\.SGD"):
        from_torch([torch.optim.SGD(rest, lr=0.1), torch.optim.Muon(mats)])
    stepped = torch.optim.AdamW(rest)
    model(batch(0, 0)).backward()
    stepped.step()
    with pytest.raises(ValueError, match="AdamW has already stepped"):
        from_torch([torch.optim.Muon(mats), stepped])
