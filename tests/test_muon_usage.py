"""ShardedMuon in one process: construction errors, memory counted from the tensors held, and
this rank's state dict restoring a run exactly."""
from __future__ import annotations

import copy

import pytest
import torch

import shardopt
from models import batch, make_model

pytestmark = pytest.mark.usefixtures("one_rank_group")


def _groups(model, **adamw):
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [{"params": mats}, {"params": rest, "use_muon": False, **adamw}]


def _train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        opt.backward(model(batch(0, step)))
        opt.step()


def test_a_parameter_that_is_not_a_matrix_in_a_muon_group_is_named():
    model = make_model(seed=1)
    with pytest.raises(ValueError, match=r"'unused' .*shape \(5,\).*\"use_muon\": False"):
        shardopt.ShardedMuon(model.named_parameters())


def test_the_error_names_the_parameter_its_group_and_its_shape_once():
    """Named or not, the parameter is named once, then its param group and its shape, once each."""
    mats = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(2, 4, 4))]
    tail = '; Muon updates 2-D matrices only: put it in a param group with "use_muon": False (AdamW)'
    for params, label in ((mats, "#1"), ([("w", mats[0]), ("experts", mats[1])], "'experts'")):
        with pytest.raises(ValueError) as raised:
            shardopt.ShardedMuon(params)
        assert str(raised.value) == f"ShardedMuon: {label} (param group 0) has shape (2, 4, 4){tail}"


@pytest.mark.parametrize("kwargs", [dict(master_weights="exact"), dict(moments="8bit"), dict(momentum=1.0),
                                    dict(adjust_lr_fn="rms"), dict(ns_steps=0)])
def test_unsupported_or_invalid_arguments_raise(kwargs):
    model = make_model(seed=1)
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        shardopt.ShardedMuon(_groups(model), **kwargs)


def test_an_adamw_group_keeps_adamw_keys_only_and_torch_defaults():
    model = make_model(seed=1)
    opt = shardopt.ShardedMuon(_groups(model), lr=0.02)
    muon, adamw = opt.param_groups
    assert muon["lr"] == 0.02 and muon["momentum"] == 0.95 and muon["nesterov"] is True and "betas" not in muon
    assert adamw["lr"] == 1e-3 and adamw["betas"] == (0.9, 0.999) and adamw["eps"] == 1e-8
    assert adamw["weight_decay"] == 1e-2 and "momentum" not in adamw and "ns_steps" not in adamw


def test_momentum_bytes_are_four_per_owned_element():
    model = make_model(seed=1)
    opt = shardopt.ShardedMuon(_groups(model), stage=2)
    _train(model, opt, 2)
    owned = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p.requires_grad)
    rest = sum(p.numel() for p in model.parameters() if p.dim() != 2)
    report = opt.memory_report()
    # Live tensors: Muon's momentum buffers (padding included) and AdamW's two moments.
    view = opt.inspect()
    momentum = sum(t.numel() * t.element_size() for b in view.buffers for k, t in b.moment_tensors.items()
                   if k == "momentum_buffer")
    assert momentum >= 4 * owned and momentum - 4 * owned < 4 * 8 * len(opt.param_groups[0]["params"])
    assert report.exp_avg == momentum + 4 * sum(b.shard_numel for b in view.buffers if "exp_avg" in b.moment_tensors)
    assert report.exp_avg_sq == 4 * sum(b.shard_numel for b in view.buffers if "exp_avg_sq" in b.moment_tensors)
    assert report.predicted["exp_avg"] == 4 * (owned + rest)
    assert report.predicted["exp_avg_sq"] == 4 * rest


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_state_dict_round_trip_continues_exactly(moments):
    model = make_model(seed=1)
    opt = shardopt.ShardedMuon(_groups(model), moments=moments)
    _train(model, opt, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), opt.state_dict()
    _train(model, opt, 2, start=3)
    expected = [p.detach().clone() for p in model.parameters()]
    opt.close()

    model2 = make_model(seed=2)
    model2.load_state_dict(saved_model)
    opt2 = shardopt.ShardedMuon(_groups(model2), moments=moments)
    opt2.load_state_dict(saved_opt)
    _train(model2, opt2, 2, start=3)
    for p, q in zip(model2.parameters(), expected):
        assert torch.equal(p.detach(), q)


def test_muon_state_loaded_where_adamw_updates_the_parameter_is_refused():
    model = make_model(seed=1)
    opt = shardopt.ShardedMuon(_groups(model))
    _train(model, opt, 1)
    opt.consolidate_state_dict()
    sd = opt.state_dict()
    adamw = shardopt.ShardedAdamW([{"params": g["params"]} for g in _groups(model)])
    with pytest.raises(ValueError, match=r"Muon state for parameter #\d+, which this optimizer updates with AdamW"):
        adamw.load_state_dict(sd)


def test_fp16_with_loss_scaling_follows_fp32_and_skips_overflow():
    fp32 = make_model(seed=1)
    half = make_model(seed=1, dtype=torch.float16)
    opt32 = shardopt.ShardedMuon(_groups(fp32), lr=0.02)
    opt16 = shardopt.ShardedMuon(_groups(half), lr=0.02, loss_scale=shardopt.DynamicScaler(init_scale=256.0))
    assert opt16.loss_scale > 1
    for step in range(3):
        for model, opt in ((fp32, opt32), (half, opt16)):
            opt.zero_grad()
            opt.backward(model(batch(0, step)))
            opt.step()
            assert not opt.step_was_skipped
    worst = max((p.float() - q).abs().max().item() for p, q in zip(half.parameters(), fp32.parameters()))
    assert worst < 2e-2, worst  # fp16 forward and backward, fp32 master: fp16's tolerance
    before = [p.detach().clone() for p in half.parameters()]
    scale = opt16.loss_scale
    opt16.zero_grad()
    opt16.backward(half(batch(0, 3)) * float("inf"))
    opt16.step()
    assert opt16.step_was_skipped and opt16.loss_scale < scale
    assert all(torch.equal(p.detach(), b) for p, b in zip(half.parameters(), before))


def _masters(opt):
    return [b.master_fp32.clone() for b in opt.inspect().buffers]


def test_bf16_weights_with_the_remainder_master_follow_the_fp32_master_bit_for_bit():
    runs = {}
    for mode in ("fp32", "remainder"):
        model = make_model(seed=1, dtype=torch.bfloat16)
        opt = shardopt.ShardedMuon(_groups(model), lr=0.02, master_weights=mode, loss_scale=None)
        _train(model, opt, 4)
        runs[mode] = [p.detach().clone() for p in model.parameters()], _masters(opt)
        # the master holds what the bf16 weights cannot: updates below their rounding
        assert any(not torch.equal(b.master_fp32, b.shard_weights.float()) for b in opt.inspect().buffers)
    (w32, m32), (wrem, mrem) = runs["fp32"], runs["remainder"]
    assert all(torch.equal(a, b) for a, b in zip(w32, wrem))
    assert all(torch.equal(a, b) for a, b in zip(m32, mrem))


@pytest.mark.parametrize("mode", ["stochastic", "none"])
def test_lean_master_modes_train_the_muon_matrices(mode):
    model = make_model(seed=1, dtype=torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    opt = shardopt.ShardedMuon(_groups(model), lr=0.02, master_weights=mode, loss_scale=None)
    _train(model, opt, 3)
    mats = [(p, b) for p, b in zip(model.parameters(), before) if p.dim() == 2 and p.requires_grad]
    assert all(torch.isfinite(p).all() and not torch.equal(p.detach(), b) for p, b in mats)
    assert opt.memory_report().master == 0 and opt.memory_report().extra == 0


def test_bf16_momentum_is_torch_muon_with_its_buffer_rounded_to_bf16_after_each_step():
    """moments="bf16": the owner decodes the bf16 buffer, runs torch's step in fp32 and stores the
    buffer rounded to nearest. The reference is torch.optim.Muon whose momentum_buffer is rounded to
    bf16 after every step (AdamW's lr is 0 in both, so only Muon moves the weights)."""
    ref = make_model(seed=1)
    model = copy.deepcopy(ref)
    opt = shardopt.ShardedMuon(_groups(model, lr=0.0), lr=0.02, moments="bf16")
    muon = torch.optim.Muon([p for p in ref.parameters() if p.dim() == 2], lr=0.02)
    for step in range(4):
        opt.zero_grad()
        muon.zero_grad()
        opt.backward(model(batch(0, step)))
        ref(batch(0, step)).backward()
        opt.step()
        muon.step()
        for state in muon.state.values():
            state["momentum_buffer"].copy_(state["momentum_buffer"].bfloat16().float())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), name
    unrounded = make_model(seed=1)  # the rounding is real: fp32 momentum ends elsewhere
    _train(unrounded, shardopt.ShardedMuon(_groups(unrounded, lr=0.0), lr=0.02), 4)
    assert any(not torch.equal(p, q) for p, q in zip(unrounded.parameters(), model.parameters()))



# (fp32 momentum is handed out as a view of the shard, so writes in place into it always went through)
@pytest.mark.parametrize("edit,moments", [("mul_", "bf16"), ("=zeros", "fp32"), ("=zeros", "bf16"), ("del", "fp32"),
                                          ("del", "bf16")])
def test_writes_into_the_momentum_buffer_are_torch_muons(edit, moments):
    """opt.state[p]["momentum_buffer"] halved in place, replaced by zeros, or the entry deleted
    after 2 steps, then 2 more: torch.optim.Muon with the same edit (its buffer rounded to bf16
    after each step where ShardedMuon stores it in bf16; AdamW's lr is 0 in both)."""
    ref = make_model(seed=1)
    model = copy.deepcopy(ref)
    opt = shardopt.ShardedMuon(_groups(model, lr=0.0), lr=0.02, moments=moments)
    muon = torch.optim.Muon([p for p in ref.parameters() if p.dim() == 2], lr=0.02)
    for step in range(4):
        if step == 2:
            for state, params in ((opt.state, model.parameters()), (muon.state, ref.parameters())):
                for p in [p for p in params if p.dim() == 2 and p.requires_grad]:
                    if edit == "mul_":
                        state[p]["momentum_buffer"].mul_(0.5)
                    elif edit == "=zeros":
                        state[p]["momentum_buffer"] = torch.zeros_like(p)
                    else:
                        del state[p]
        opt.zero_grad()
        muon.zero_grad()
        opt.backward(model(batch(0, step)))
        ref(batch(0, step)).backward()
        opt.step()
        muon.step()
        if moments == "bf16":
            for state in muon.state.values():
                state["momentum_buffer"].copy_(state["momentum_buffer"].bfloat16().float())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), name
        if p.dim() == 2 and p.requires_grad:
            assert torch.equal(opt.state[p]["momentum_buffer"], muon.state[q]["momentum_buffer"]), name

def test_bf16_momentum_holds_two_bytes_per_owned_element_as_predicted():
    model = make_model(seed=1)
    opt = shardopt.ShardedMuon(_groups(model), moments="bf16")
    _train(model, opt, 2)
    owned = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p.requires_grad)
    rest = sum(p.numel() for p in model.parameters() if p.dim() != 2)
    momentum = [t for b in opt.inspect().buffers for k, t in b.moment_tensors.items() if k == "momentum_buffer"]
    assert [t.dtype for t in momentum] == [torch.bfloat16]
    assert 2 * owned <= momentum[0].numel() * 2 < 2 * owned + 2 * 8 * len(opt.param_groups[0]["params"])
    report = opt.memory_report()
    assert report.predicted["exp_avg"] == 2 * (owned + rest) and report.predicted["exp_avg_sq"] == 2 * rest
    with pytest.raises(ValueError, match="fp32 or bf16"):
        shardopt.estimate_memory(owned, 1, rule="muon", moments="8bit")
