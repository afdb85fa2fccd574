"""Tier 2: torch.optim's contracts that frameworks and everyday code lean on, on real gloo ranks.

Each case is one thing users do with ``torch.optim.AdamW`` that must either behave as torch does
or raise a clear error on every rank: state-dict hooks, ``copy.deepcopy``, a parameter listed
twice, channels_last weights, NaN gradients with a finite loss and no loss scale to lower, a
hyperparameter changed on one rank only. The reference is a plain ``torch.optim.AdamW`` on the
gradient averaged over ranks (``ddp_average``), or torch's own hook calls.
"""
from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardopt
from models import batch, make_model
from usage_reference import HP, ddp_average, error_of, param_diff, rank_order_average, ref_step


def _train(model: nn.Module, opt: shardopt.ShardedAdamW, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()


# -- 1: state-dict hooks -------------------------------------------------------------------------
def _hooked(opt: torch.optim.Optimizer, calls: dict) -> None:
    def count(name):
        calls.setdefault(name, 0)
        calls[name] += 1

    opt.register_state_dict_pre_hook(lambda o: count("save_pre"))

    def save_post(o, sd):
        count("save_post")
        sd["framework_key"] = 7
        return sd

    opt.register_state_dict_post_hook(save_post)

    def load_pre(o, sd):
        count("load_pre")
        calls["loaded_key"] = sd.pop("framework_key", None)
        return sd

    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: count("load_post"))


def state_dict_hooks_case() -> dict:
    model, ref = make_model(seed=3), make_model(seed=3)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=2)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    ours, theirs = {}, {}
    _hooked(opt, ours)
    _hooked(ref_opt, theirs)
    _train(model, opt, range(2))
    ref_step(ref, ref_opt, 0)
    out = {}
    for name, o, calls in (("ours", opt, ours), ("torch", ref_opt, theirs)):
        sd = o.state_dict()
        out[name + "_key"] = sd.get("framework_key")
        o.load_state_dict(sd)
        out[name] = dict(calls)
    opt.consolidate_state_dict(to=0)  # the whole state on rank 0, as frameworks save it
    if dist.get_rank() == 0:
        out["consolidated_key"] = opt.state_dict().get("framework_key")
    _train(model, opt, range(2, 3))  # still trains after the hooked round trip
    return out


def test_state_dict_hooks_run_as_torch_runs_them(pools):
    for rank, out in enumerate(pools(2).run(state_dict_hooks_case)):
        assert out["torch"] == {"save_pre": 1, "save_post": 1, "load_pre": 1, "loaded_key": 7, "load_post": 1}, out
        assert out["ours"] == out["torch"], out
        assert out["ours_key"] == out["torch_key"] == 7, out
        if rank == 0:
            assert out["consolidated_key"] == 7, out


# -- 2: copy.deepcopy --------------------------------------------------------------------------------
def deepcopy_case() -> tuple[tuple[str, str] | None, tuple[str, str] | None, float]:
    model = make_model(seed=4)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=2)
    _train(model, opt, range(2))
    copied = error_of(lambda: copy.deepcopy(opt))
    pickled = error_of(lambda: copy.copy(opt))
    # What the message says to do instead: copy the model, build a new optimizer, load the state.
    twin = copy.deepcopy(model)
    twin_opt = shardopt.ShardedAdamW(twin.parameters(), **HP, stage=2)
    twin_opt.load_state_dict(opt.state_dict())
    _train(model, opt, range(2, 4))
    _train(twin, twin_opt, range(2, 4))
    return copied, pickled, param_diff(model, twin)


def test_deepcopy_raises_a_clear_error_and_its_advice_works(pools):
    for copied, pickled, worst in pools(2).run(deepcopy_case):
        assert copied is not None and copied[0] == "TypeError" and "copy.deepcopy" in copied[1], copied
        assert "load_state_dict(opt.state_dict())" in copied[1], copied
        assert pickled is not None and pickled[0] == "TypeError", pickled
        assert worst == 0.0, worst


# -- 3: a parameter listed twice ---------------------------------------------------------------------
def duplicate_case(named: bool) -> tuple[list[str], float]:
    model, ref = make_model(seed=5), make_model(seed=5)
    if named:
        params = list(model.named_parameters()) + [("fc1.weight.again", model.fc1.weight)]
    else:
        params = list(model.parameters()) + [model.fc1.weight]  # a tied weight collected twice
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = shardopt.ShardedAdamW(params, **HP, stage=2)
    ref_opt = torch.optim.AdamW(list(ref.parameters()), **HP)  # each parameter once
    for step in range(3):
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()
        ref_step(ref, ref_opt, step)
    return [str(w.message) for w in caught if "duplicate" in str(w.message)], param_diff(model, ref)


def test_a_parameter_listed_twice_warns_as_torch_does_and_trains_once(pools):
    pool = pools(2)
    for named in (False, True):
        for messages, worst in pool.run(duplicate_case, named):
            assert len(messages) == 1, messages
            assert ("'fc1.weight.again'" if named else "#10") in messages[0], messages
            assert worst < 1e-6, (named, worst)


# -- 4: channels_last and other non-contiguous weights ------------------------------------------------
class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean(dim=(2, 3))).square().mean()


def _conv_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(2, 3, 6, 6, generator=g).contiguous(memory_format=torch.channels_last)


def channels_last_case() -> dict:
    torch.manual_seed(0)
    model = ConvNet().to(memory_format=torch.channels_last)
    ref = copy.deepcopy(model)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = shardopt.ShardedAdamW(model.named_parameters(), **HP, stage=2)
    out["built"] = [str(w.message) for w in caught if "memory format" in str(w.message)]
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(4):
        if step == 2:  # converted again after construction: the next step re-binds it
            model.to(memory_format=torch.channels_last)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.zero_grad()
            opt.backward(model(_conv_batch(step)))
            opt.step()
        out[f"step{step}"] = [str(w.message) for w in caught if "memory format" in str(w.message)]
        ref_opt.zero_grad()
        ref(_conv_batch(step)).backward()
        ddp_average(ref)
        ref_opt.step()
    out["worst"] = param_diff(model, ref)
    return out


def test_channels_last_weights_are_said_to_change_layout(pools):
    for out in pools(2).run(channels_last_case):
        assert len(out["built"]) == 1 and "'conv.weight'" in out["built"][0], out
        assert "'head.weight'" not in out["built"][0], out  # contiguous parameters are not named
        assert out["step0"] == out["step1"] == out["step3"] == [], out
        assert len(out["step2"]) == 1 and "'conv.weight'" in out["step2"][0], out
        assert out["worst"] < 1e-6, out


# -- 8: NaN gradients with a finite loss -------------------------------------------------------------
def nan_gradient_case(dtype_name: str, limit: int | None) -> dict:
    dtype = getattr(torch, dtype_name)
    model = make_model(seed=6, dtype=dtype)
    kw = {} if limit == 3 else {"max_consecutive_skips": limit}
    opt = shardopt.ShardedAdamW(model.named_parameters(), **HP, stage=2, **kw)
    start = copy.deepcopy(model)
    out = {"warnings": [], "error": None, "losses": [], "skipped": 0}
    for step in range(5):
        opt.zero_grad()
        loss = model(batch(dist.get_rank(), step))
        # d/dw sqrt(sum(0 * w)) = inf * 0 = NaN: a NaN gradient while the loss stays finite
        loss = loss + torch.sqrt((model.fc1.weight * 0).sum())
        out["losses"].append(float(loss))
        opt.backward(loss)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                opt.step()
            except RuntimeError as e:
                out["error"] = (step, str(e))
                break
        out["warnings"] += [(step, str(w.message)) for w in caught if "skipped" in str(w.message)]
    out["skipped"] = opt.skipped_steps
    out["unchanged"] = param_diff(model, start) == 0.0
    return out


def test_nan_gradients_with_a_finite_loss_warn_then_raise_on_every_rank(pools):
    pool = pools(2)
    for dtype_name in ("float32", "bfloat16"):
        for out in pool.run(nan_gradient_case, dtype_name, 3):
            assert all(torch.isfinite(torch.tensor(out["losses"]))), out
            assert [s for s, _ in out["warnings"]] == [0], out  # warned at the first skip only
            assert "'fc1.weight'" in out["warnings"][0][1] and "'fc2.weight'" not in out["warnings"][0][1], out
            assert out["error"] is not None and out["error"][0] == 2, out  # the third skip in a row raises
            assert "'fc1.weight'" in out["error"][1] and "max_consecutive_skips" in out["error"][1], out
            assert out["skipped"] == 3 and out["unchanged"], out
    for out in pool.run(nan_gradient_case, "bfloat16", None):  # told to keep skipping
        assert out["error"] is None and out["skipped"] == 5 and [s for s, _ in out["warnings"]] == [0], out


# -- 9: a hyperparameter changed on one rank only ----------------------------------------------------
def per_rank_hyperparameter_case(key: str, norm_type: float | None) -> tuple[str, str] | None:
    rank = dist.get_rank()
    model = make_model(seed=8)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=2)
    _train(model, opt, range(1))
    group = opt.param_groups[0]
    if key == "lr":
        group["lr"] = 0.01 * (rank + 1)  # three values: rank 1's lies between the others
    elif key == "betas":
        group["betas"] = (0.9, 0.95) if rank != 1 else (0.9, 0.99)
    elif key == "plateau":  # ReduceLROnPlateau stepped with a rank-local validation loss
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        sched.step(1.0)
        sched.step(0.5 if rank == 0 else 2.0)  # worse on ranks 1 and 2 only: they halve lr
    opt.zero_grad()
    opt.backward(model(batch(rank, 1)))
    if norm_type is not None:
        return error_of(lambda: opt.clip_grad_norm_(1.0, norm_type=norm_type))
    return error_of(opt.step)


def test_a_hyperparameter_set_on_one_rank_raises_on_every_rank(pools):
    pool = pools(3)
    cases = {("lr", None): ("param group 0 lr is 0.01 on rank 0 but 0.02 on rank 1",),
             ("lr", 2.0): ("param group 0 lr is 0.01 on rank 0 but 0.02 on rank 1",),
             ("lr", float("inf")): ("param group 0 lr is 0.01 on rank 0 but 0.02 on rank 1",),
             ("betas", None): ("param group 0 betas is (0.9, 0.95) on rank 0 but (0.9, 0.99) on rank 1",),
             ("plateau", None): ("param group 0 lr is 0.01 on rank 0 but 0.005 on rank 1",)}
    for (key, norm_type), (want,) in cases.items():
        for rank, err in enumerate(pool.run(per_rank_hyperparameter_case, key, norm_type)):
            assert err is not None and err[0] == "ValueError", (key, norm_type, rank, err)
            assert want in err[1], (key, norm_type, rank, err)


def same_hyperparameters_case() -> float:
    model, ref = make_model(seed=8), make_model(seed=8)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=2)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for o in (opt, ref_opt):
        o.param_groups[0]["lr"] = torch.tensor(0.02)  # changed alike everywhere, as a tensor: no error
    for step in range(2):
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.clip_grad_norm_(1e9)
        opt.step()
        ref_opt.zero_grad()
        ref(batch(dist.get_rank(), step)).backward()
        rank_order_average(ref)  # 3 ranks: gloo's ring would add in another order than shardopt
        ref_opt.step()
    return param_diff(model, ref)


def test_hyperparameters_changed_alike_on_every_rank_train(pools):
    for worst in pools(3).run(same_hyperparameters_case):
        assert worst < 1e-6, worst



# -- 5, 6: torch.compile ----------------------------------------------------------------------------
def compiled_model_case(how: str) -> float:
    """A compiled model trained with overlap_param_gather=True: the gathers must land before the
    compiled forward reads the weights."""
    model, ref = make_model(seed=9), make_model(seed=9)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=2, overlap_param_gather=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    if how == "wrapper":
        forward = torch.compile(model, backend="aot_eager")
    else:  # compiled in place: the global hooks are traced into the compiled call
        model.compile(backend="aot_eager")
        forward = model
    for step in range(3):
        opt.zero_grad()
        opt.backward(forward(batch(dist.get_rank(), step)))
        opt.step()
        ref_step(ref, ref_opt, step)
    opt.finish_param_gather()
    return param_diff(model, ref)


def test_a_compiled_model_trains_with_overlapped_gathers(pools):
    pool = pools(2)
    for how in ("wrapper", "in_place"):
        for worst in pool.run(compiled_model_case, how):
            assert worst < 1e-6, (how, worst)


def compiled_train_step_case(stage: int) -> tuple[float, int, int]:
    """A whole train step compiled: shardopt's calls run eagerly (graph breaks), the rest compiles
    once; no recompiles after warm-up."""
    # Optimizers of earlier cases in this process are freed now rather than mid-run: freeing one
    # removes its global forward pre-hooks, which dynamo's guards on module calls watch.
    gc.collect()
    model, ref = make_model(seed=10), make_model(seed=10)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=counting)
    def train_step(x):
        loss = model(x)
        opt.backward(loss)
        norm = opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        return loss, norm

    after_warmup = 0
    for step in range(5):
        train_step(batch(dist.get_rank(), step))
        if step == 1:
            after_warmup = len(graphs)
        ref_opt.zero_grad()
        ref(batch(dist.get_rank(), step)).backward()
        ddp_average(ref)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
    return param_diff(model, ref), after_warmup, len(graphs)


def test_a_compiled_train_step_runs_shardopt_eagerly(pools):
    pool = pools(2)
    for stage in (1, 2):
        for worst, warm, total in pool.run(compiled_train_step_case, stage):
            assert worst < 1e-5, (stage, worst)
            assert warm >= 1 and total == warm, (stage, warm, total)  # nothing compiled after warm-up



def compiled_autograd_case(stage: int) -> float:
    """Compiled autograd traces the backward pass, gradient hooks included: shardopt's hooks run
    eagerly there (a graph break each), and the training is torch's."""
    gc.collect()
    from torch._dynamo import compiled_autograd

    model, ref = make_model(seed=12), make_model(seed=12)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)

    @torch.compile(backend="eager")
    def forward_backward(x):
        loss = model(x)
        loss.backward()
        return loss

    enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
    with enable(torch.compile(backend="eager")):
        for step in range(3):
            forward_backward(batch(dist.get_rank(), step))
            opt.step()
            opt.zero_grad()
    for step in range(3):
        ref_step(ref, ref_opt, step)
    return param_diff(model, ref)


def test_compiled_autograd_runs_the_gradient_hooks_eagerly(pools):
    pool = pools(2)
    for stage in (1, 2):
        for worst in pool.run(compiled_autograd_case, stage):
            assert worst < 1e-5, (stage, worst)

# -- 7: EMA / SWA right after an overlapped step ----------------------------------------------------
def ema_case(read: str) -> tuple[float, list[float]]:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model, ref = make_model(seed=11), make_model(seed=11)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=2, overlap_param_gather=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    ref_ema = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    sums = []
    for step in range(4):
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()
        model.zero_grad()  # what frameworks do between step and the next forward: no weight read
        # weights read outside a forward, the gathers still in flight: each read waits (group._gather_wait)
        if read == "ema":
            ema.update_parameters(model)
        else:  # a parent reading a child's weight outside the child's forward
            sums.append(float(model.fc2.weight.sum()))
        ref_step(ref, ref_opt, step)
        ref_ema.update_parameters(ref)
        if read != "ema":
            sums[-1] -= float(ref.fc2.weight.sum())
    opt.finish_param_gather()
    worst = param_diff(ema, ref_ema) if read == "ema" else max(abs(s) for s in sums)
    return worst, [float(p.detach().sum()) for p in ema.parameters()]


def test_weights_read_right_after_an_overlapped_step_are_the_gathered_ones(pools):
    pool = pools(2)
    for read in ("ema", "child_weight"):
        results = pool.run(ema_case, read)
        for worst, _ in results:
            assert worst < 1e-5, (read, worst)
        assert results[0][1] == results[1][1], read  # the averaged model is the same on every rank


# -- 10: gradients assigned by hand, no backward pass ------------------------------------------------
def _hand_grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    """Each rank's own gradient for every trainable parameter (as torch.autograd.grad would give)."""
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return [torch.randn(p.shape, generator=g) for p in model.parameters() if p.requires_grad]


def hand_grads_case(stage: int, zero: bool) -> float:
    model, ref = make_model(seed=11), make_model(seed=11)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for step in range(3):
        if zero:
            opt.zero_grad()
            ref_opt.zero_grad()
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p, q, g in zip(trainable, [q for q in ref.parameters() if q.requires_grad], _hand_grads(model, step)):
            p.grad, q.grad = g.clone(), g.clone()  # replaces the gradient, as torch does
        ddp_average(ref)  # 2 ranks: the sum does not depend on the order
        opt.step()
        ref_opt.step()
    return param_diff(model, ref)


def test_gradients_assigned_by_hand_are_averaged_and_stepped_in_both_stages(pools):
    pool = pools(2)
    for stage in (1, 2):
        for zero in (True, False):  # zeroed first, or assigned over the last step's gradient
            for worst in pool.run(hand_grads_case, stage, zero):
                assert worst == 0.0, (stage, zero, worst)


def hand_grads_on_one_rank_case() -> tuple[str, str] | None:
    model = make_model(seed=11)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=2)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p, g in zip(trainable, _hand_grads(model, 0)):
        p.grad = g
    opt.step()
    if dist.get_rank() == 0:  # a new gradient here; rank 1 steps again with the one it holds
        for p, g in zip(trainable, _hand_grads(model, 1)):
            p.grad = g
    return error_of(opt.step)


def test_gradients_assigned_by_hand_on_one_rank_only_raise_on_every_rank(pools):
    for err in pools(2).run(hand_grads_on_one_rank_case):
        assert err is not None and err[0] == "RuntimeError", err
        assert "assigned gradients by hand" in err[1], err


def grad_at_construction_case(stage: int, dtype_name: str, then: str) -> dict:
    """A backward pass before the optimizer is built; then ``step()`` at once, or after another
    backward pass (which adds to that gradient). The reference: a twin of the model (its gradients
    are the model's, bit for bit), averaged over ranks as DDP does (16-bit: summed in fp32, as
    shardopt sums), and torch.optim.AdamW over fp32 copies of the weights (the master weights)."""
    dtype, rank = getattr(torch, dtype_name), dist.get_rank()
    model, twin = make_model(seed=13, dtype=dtype), make_model(seed=13, dtype=dtype)
    ref = make_model(seed=13, dtype=dtype).float()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    start = copy.deepcopy(model)
    model(batch(rank, 0)).backward()  # no optimizer yet
    twin(batch(rank, 0)).backward()
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    if then == "backward":
        opt.backward(model(batch(rank, 1)))
        twin(batch(rank, 1)).backward()
    opt.step()
    ddp_average(twin, fp32=dtype != torch.float32)
    for q, t in zip(ref.parameters(), twin.parameters()):
        q.grad = None if t.grad is None else t.grad.float()
    ref_opt.step()
    return {"worst": param_diff(model, ref.to(dtype)), "moved": param_diff(model, start)}


def test_a_gradient_there_when_the_optimizer_is_built_is_stepped_in_both_stages(pools):
    """As in torch (and as a gradient assigned by hand): the gradient a backward pass left before
    the optimizer existed is the first step's, averaged over the ranks; a backward pass before that
    step adds to it."""
    pool = pools(2)
    for stage in (1, 2):
        for dtype_name in ("float32", "bfloat16"):
            for then in ("step", "backward"):
                for out in pool.run(grad_at_construction_case, stage, dtype_name, then):
                    assert out["worst"] == 0.0 and out["moved"] > 1e-3, (stage, dtype_name, then, out)


def superseded_after_zeroing_case(first: int, second: int) -> dict:
    """An optimizer trains a step and zeroes the gradients; a new one is built over the same
    parameters and steps with no backward pass. In torch the gradients are None then: nothing moves."""
    model, ref = make_model(seed=14), make_model(seed=14)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=first)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        m(batch(dist.get_rank(), 0)).backward()
        if m is ref:
            ddp_average(ref)
        o.step()
        o.zero_grad()
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=second)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    opt.step()
    ref_opt.step()
    return {"worst": param_diff(model, ref)}


def test_a_new_optimizer_after_zero_grad_finds_no_gradient(pools):
    """A superseded optimizer leaves p.grad as torch would: None after zero_grad (stage 1's zeroed
    views stand for None), so the new one does not step on zeros (weight decay would move them)."""
    pool = pools(2)
    for first in (1, 2):
        for second in (1, 2):
            for out in pool.run(superseded_after_zeroing_case, first, second):
                assert out["worst"] <= 2e-6, (first, second, out)


# -- 10b: a new optimizer built after the old one's backward pass ----------------------------------------
def _with_gradless(seed: int) -> nn.Module:
    """TinyNet with one more parameter that no rank ever has a gradient for (``extra``); its
    ``unused`` parameter gets one on rank 0 only (see ``_loss``)."""
    model = make_model(seed=seed)
    model.extra = nn.Parameter(torch.randn(4))
    return model


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    rank = dist.get_rank()
    loss = model(batch(rank, step))
    return loss + 0.1 * model.unused.square().sum() if rank == 0 else loss


REPLACE_HOWS = ("keep", "close", "drop", "close+backward", "zero_false", "close+zero_false")


def replaced_after_backward_case(first: int, second: int) -> dict:
    """An optimizer steps once, then runs its own backward pass (or zeroes with
    ``set_to_none=False`` instead); a new optimizer is built over the same parameters, the old one
    kept, closed, or dropped (collected), or closed and then a plain backward pass adds to the
    gradients; the new one steps, then trains one more step. As torch.optim.AdamW doing the same on
    gradients averaged as DDP does: the new optimizer steps on the gradients there (one that only
    rank 0 had, averaged; zeros where they were zeroed), and leaves alone a parameter no rank had
    one for."""
    out = {}
    for how in REPLACE_HOWS:
        model, ref = _with_gradless(21), _with_gradless(21)
        opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=first)
        ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
        for step in range(2):
            if step == 1 and how.endswith("zero_false"):
                break
            opt.zero_grad()
            ref_opt.zero_grad()
            opt.backward(_loss(model, step))
            _loss(ref, step).backward()
            ddp_average(ref)
            if step == 0:
                opt.step()
                ref_opt.step()
        read = None
        if how.startswith("close"):
            opt.close()
            read = error_of(lambda: model.fc1.weight.grad.norm())  # stage 2: a placeholder until the next optimizer
        if how.endswith("zero_false"):
            opt.zero_grad(set_to_none=False)
            ref_opt.zero_grad(set_to_none=False)
        if how == "close+backward":  # no optimizer takes it: autograd adds it to what p.grad holds
            _loss(model, 2).backward()
            _loss(ref, 2).backward()
            ddp_average(ref)
        if how == "drop":
            opt = None
            gc.collect()
        before = copy.deepcopy(model)
        new = shardopt.ShardedAdamW(model.parameters(), **HP, stage=second)
        ref_new = torch.optim.AdamW(ref.parameters(), **HP)
        new.step()
        ref_new.step()
        out[how] = {"worst": param_diff(model, ref), "moved": param_diff(model, before),
                    "extra moved": (model.extra - before.extra).abs().max().item(), "read": read}
        new.zero_grad()
        ref_new.zero_grad()
        new.backward(_loss(model, 3))
        _loss(ref, 3).backward()
        ddp_average(ref)
        new.step()
        ref_new.step()
        out[how]["then"] = param_diff(model, ref)
    return out


def test_a_new_optimizer_steps_on_the_gradient_the_old_one_left(pools):
    """Frameworks build a new optimizer after a backward pass (Lightning's and HF's rebuilds, an
    lr finder): with the old one kept, closed or collected, the new one steps on the gradient as
    torch does, in both stages and from either stage to either."""
    pool = pools(2)
    for first in (1, 2):
        for second in (1, 2):
            for out in pool.run(replaced_after_backward_case, first, second):
                for how in REPLACE_HOWS:
                    got = out[how]
                    assert got["worst"] <= 2e-6 and got["then"] <= 2e-6, (first, second, how, got)
                    assert got["moved"] > 1e-4 and got["extra moved"] == 0.0, (first, second, how, got)
                    if first == 2 and how == "close":
                        assert got["read"] is not None and "no longer trains it" in got["read"][1], got


def left_on_one_rank_case(stage: int) -> tuple[str, str] | None:
    """The old optimizer's backward pass, then rank 0 alone drops the gradients before a new
    optimizer is built: the ranks would start from different gradients."""
    model = make_model(seed=22)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    opt.backward(model(batch(dist.get_rank(), 0)))
    if dist.get_rank() == 0:
        model.zero_grad()
    return error_of(lambda: shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage))


def test_gradients_left_on_some_ranks_only_raise_on_every_rank_at_construction(pools):
    for got in pools(2).run(left_on_one_rank_case, 2):
        assert got is not None and got[0] == "RuntimeError", got
        assert "on rank 1 but not on rank 0" in got[1] and "alike on every rank" in got[1], got


def replaced_between_micro_batches_case(stage: int, dtype_name: str) -> dict:
    """A micro-batch reduced, another one accumulated under ``no_sync`` (16-bit: summed in fp32 by the
    optimizer), then a new optimizer is built: its gradient norm is that of both micro-batches'
    gradients averaged over the ranks, against fp32 torch."""
    dtype, rank = getattr(torch, dtype_name), dist.get_rank()
    model, ref = make_model(seed=23, dtype=dtype), make_model(seed=23, dtype=dtype).float()
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    opt.backward(model(batch(rank, 0)))
    with opt.no_sync():
        opt.backward(model(batch(rank, 1)))
    new = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    (ref(batch(rank, 0)) + ref(batch(rank, 1))).backward()
    ddp_average(ref)
    return {"norm": new.clip_grad_norm_(1.0).item(),
            "ref": torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item()}


def test_a_new_optimizer_takes_the_micro_batches_the_old_one_summed(pools):
    pool = pools(2)
    for stage in (1, 2):
        for dtype_name, tol in (("float32", 1e-6), ("bfloat16", 1e-2)):
            for out in pool.run(replaced_between_micro_batches_case, stage, dtype_name):
                assert abs(out["norm"] - out["ref"]) <= tol * out["ref"], (stage, dtype_name, out)


LEFT_SCALE_HOWS = ("keep", "close", "drop", "no_sync", "stepped", "backward", "plain")


class _Fp32Master:
    """torch.optim.AdamW on fp32 copies of a 16-bit model's weights, stepped on the model's own
    16-bit gradients, made from the loss multiplied by ``scale`` and averaged over the ranks as DDP
    does, then divided by it in fp32: loss scaling by hand, as torch.amp.GradScaler does it."""

    def __init__(self, model: nn.Module, scale: float) -> None:
        self.model, self.scale = model, scale
        self.master = [p.detach().float().clone() for p in model.parameters()]
        self.opt = torch.optim.AdamW(self.master, **HP)

    def backward(self, step: int, average: bool = True) -> None:
        """Add the gradient of this rank's batch of ``step`` to the model's: averaged over the ranks
        first, as DDP averages each backward pass (``average=False``: as under ``no_sync``)."""
        before = [p.grad for p in self.model.parameters()]
        self.model.zero_grad()
        (self.model(batch(dist.get_rank(), step)) * self.scale).backward()
        if average:
            ddp_average(self.model)
        for p, g in zip(self.model.parameters(), before):
            if g is not None:
                p.grad = g if p.grad is None else g + p.grad

    def step(self, new: bool = False) -> float:
        """Step on the model's gradients (averaged); ``new``: a new AdamW, from zero moments. Returns their norm."""
        if new:
            self.opt = torch.optim.AdamW(self.master, **HP)
        ddp_average(self.model)
        for m, p in zip(self.master, self.model.parameters()):
            m.grad = None if p.grad is None else p.grad.float() / self.scale
        norm = torch.nn.utils.clip_grad_norm_(self.master, 1e9).item()
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.master, self.model.parameters()):
                p.copy_(m)
        return norm


def fp16_left_case(first: int, second: int, how: str, third: int | None = None) -> dict:
    """fp16 weights, dynamic loss scaling from 2**10 (this model's gradients overflow at 2**16): an
    overflow halves the old optimizer's loss scale to 2**9 (the new one starts at 2**10), its ``opt.backward(loss)`` leaves gradients at that scale,
    and a new optimizer is built over the parameters: the old one kept, closed or dropped; with a
    micro-batch summed under ``no_sync``; after the old one stepped on them (not zeroed: the new one
    steps on them again); with the new one's ``opt.backward(loss)`` added, at its own scale; or a
    plain backward pass added after ``close()``, which mixes scales. With ``third`` (how: close or
    drop) they are handed on twice: the new one runs no backward pass and is closed or dropped in
    turn, and a third one (stage ``third``, loss scale 2**11) takes them. The last one's norm and two
    steps against torch.optim.AdamW on fp32 master weights and the same fp16 gradients scaled by hand."""
    rank = dist.get_rank()
    model = make_model(seed=24, dtype=torch.float16)
    ref = _Fp32Master(make_model(seed=24, dtype=torch.float16), 2.0**10)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=first, loss_scale=shardopt.DynamicScaler(2.0**10))
    opt.backward(model(batch(rank, 0)) * float("inf"))
    opt.step()
    out: dict = {"old scale": opt.loss_scale, "skipped": opt.step_was_skipped}
    opt.zero_grad()
    opt.backward(model(batch(rank, 1)))
    ref.backward(1)
    if how == "no_sync":
        with opt.no_sync():
            opt.backward(model(batch(rank, 2)))
        ref.backward(2, average=False)
    if how == "stepped":
        opt.step()
        ref.step()
    if how in ("close", "plain"):
        opt.close()
    if how == "plain":
        model(batch(rank, 2)).backward()
    if how == "drop":
        opt = None
        gc.collect()
    new = shardopt.ShardedAdamW(model.parameters(), **HP, stage=second, loss_scale=shardopt.DynamicScaler(2.0**10))
    if third is not None:  # handed on again, untouched by the middle optimizer
        if how == "close":
            new.close()
        else:
            del new
            gc.collect()
        new = shardopt.ShardedAdamW(model.parameters(), **HP, stage=third, loss_scale=shardopt.DynamicScaler(2.0**11))
    if how == "backward":
        new.backward(model(batch(rank, 3)))
        ref.backward(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["error"] = error_of(lambda: new.clip_grad_norm_(1e9))
        if out["error"] is not None:
            return out
        out["norm"] = new.clip_grad_norm_(1e9).item()
        new.step()
        out["ref norm"] = ref.step(new=True)
        new.zero_grad()
        new.backward(model(batch(rank, 4)))
        new.step()
    ref.model.zero_grad()
    ref.backward(4)
    ref.step()
    out["worst"] = param_diff(model, ref.model)
    out["warned"] = [str(w.message)[:80] for w in caught]
    out["new skipped"] = new.skipped_steps
    return out


@pytest.mark.parametrize("how", LEFT_SCALE_HOWS)
def test_a_new_optimizer_takes_fp16_gradients_the_old_one_left_at_their_loss_scale(pools, how):
    """The gradients an fp16 optimizer left carry its loss scale: the new optimizer brings them to
    its own and divides it out once, so its norm and steps are torch's on the unscaled gradients,
    with its own opt.backward(loss) added at its scale; a plain backward pass added to scaled
    gradients raises on every rank, as beside opt.backward(loss) in one optimizer."""
    pool = pools(2)
    for first in (1, 2):
        for second in (1, 2):
            for out in pool.run(fp16_left_case, first, second, how):
                assert out["old scale"] == 2.0**9 and out["skipped"], (first, second, how, out)
                if how == "plain":
                    assert out["error"] is not None and out["error"][0] == "RuntimeError", (first, second, out)
                    assert "some backward passes ran through opt.backward(loss)" in out["error"][1], out
                    continue
                assert out["error"] is None, (first, second, how, out)
                assert abs(out["norm"] - out["ref norm"]) <= 1e-2 * out["ref norm"], (first, second, how, out)
                assert out["worst"] <= 3e-3, (first, second, how, out)
                assert out["warned"] == [] and out["new skipped"] == 0, (first, second, how, out)


@pytest.mark.parametrize("stages", [(1, 1, 1), (2, 1, 2), (1, 2, 1), (2, 2, 2)])
def test_fp16_gradients_handed_on_twice_keep_their_loss_scale(pools, stages):
    """Gradients an fp16 optimizer left, taken by a new one that runs no backward pass and is
    closed or dropped in turn, still carry their loss scale when a third one takes them: its norm
    and steps are torch's on the unscaled gradients, without a warning."""
    pool = pools(2)
    first, second, third = stages
    for how in ("close", "drop"):
        for out in pool.run(fp16_left_case, first, second, how, third):
            assert out["old scale"] == 2.0**9 and out["skipped"], (stages, how, out)
            assert out["error"] is None, (stages, how, out)
            assert abs(out["norm"] - out["ref norm"]) <= 1e-2 * out["ref norm"], (stages, how, out)
            assert out["worst"] <= 3e-3, (stages, how, out)
            assert out["warned"] == [] and out["new skipped"] == 0, (stages, how, out)


# -- 11: backward from a parameter itself -------------------------------------------------------------
def leaf_backward_case(stage: int) -> float:
    model, ref = make_model(seed=12), make_model(seed=12)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    scale = float(dist.get_rank() + 1)
    for _ in range(2):
        for o in (opt, ref_opt):
            o.zero_grad()
        for net in (model, ref):
            for p in net.parameters():
                if p.requires_grad:
                    p.backward(torch.full_like(p, scale))  # one backward pass per parameter, from the leaf
        ddp_average(ref)
        opt.step()
        ref_opt.step()
    return param_diff(model, ref)


def test_a_backward_from_the_parameter_itself_steps_as_torch(pools):
    pool = pools(2)
    for stage in (1, 2):
        for worst in pool.run(leaf_backward_case, stage):
            assert worst == 0.0, (stage, worst)


# -- 12: torch's state-dict keys and opt.state[p] ------------------------------------------------------
def torch_state_case(moments: str) -> dict:
    model, ref = make_model(seed=13), make_model(seed=13)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=2, moments=moments)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    out = {"before": len(opt.state)}
    for step in range(3):
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()
        ref_step(ref, ref_opt, step)
    view = opt.inspect().buffers[0]
    worst, pieces, keys = 0.0, 0, set()
    records = {id(r.param): r for r in view.records}
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p in opt.state) == (q in ref_opt.state), "a state entry exactly where torch has one"
        if q not in ref_opt.state:
            continue
        mine, theirs = opt.state[p], ref_opt.state[q]
        assert mine["step"].dtype == torch.float32 and float(mine["step"]) == float(theirs["step"])
        r = records[id(p)]
        keys |= set(mine) - {"step"}
        if r.local is None:
            assert set(mine) == {"step"}, set(mine)
            continue
        local, glob = next(run for run in view.shard_runs if run[0].start <= r.local.start < run[0].end)
        start = glob.start + r.local.start - local.start - r.span.global_range.start  # in the flattened parameter
        for k in ("exp_avg", "exp_avg_sq"):
            want = theirs[k].reshape(-1)[start:start + r.local.size]
            worst = max(worst, (mine[k] - want).abs().max().item())
        pieces += 1
    sd = opt.state_dict()
    out.update(worst=worst, pieces=pieces, keys=sorted(keys), sd_keys=sorted(k for k in ("state", "param_groups") if k in sd),
               params=[g["params"] for g in sd["param_groups"]], torch_params=[g["params"] for g in ref_opt.state_dict()["param_groups"]],
               state_keys=sorted(sd["state"]), torch_state_keys=sorted(ref_opt.state_dict()["state"]))
    if moments == "fp32":  # views of the shard: a write in place is the optimizer's state
        p = next(p for p in model.parameters() if p in opt.state and "exp_avg" in opt.state[p])
        opt.state[p]["exp_avg"].mul_(0.0)
        out["written"] = float(opt.state[p]["exp_avg"].abs().max())
        out["assign"] = error_of(lambda: opt.state.__setitem__(p, {"step": torch.tensor(1.0)}))
        opt.state[p] = opt.state[p]  # handing back what it holds (a framework moving the state) is fine
    return out


def test_state_dict_has_torchs_keys_and_opt_state_holds_this_ranks_pieces(pools):
    pool = pools(2)
    for moments in ("fp32", "bf16"):
        results = pool.run(torch_state_case, moments)
        assert sum(out["pieces"] for out in results) >= 8, results  # every trained parameter has a piece somewhere
        for out in results:
            assert out["before"] == 0, out
            assert out["sd_keys"] == ["param_groups", "state"], out
            assert out["params"] == out["torch_params"], out
            assert out["state_keys"] == out["torch_state_keys"], out
            assert out["keys"] == ["exp_avg", "exp_avg_sq"], out
            assert out["worst"] <= (0.0 if moments == "fp32" else 1e-2), out
            if moments == "fp32":
                assert out["written"] == 0.0, out
                assert out["assign"] is not None and out["assign"][0] == "ValueError", out  # not all its keys


# -- 12b: writes into opt.state[p], against the same edit in torch.optim.AdamW's ----------------------
def _edit_state(edit: str, state, params) -> None:
    """``edit`` on the state of every parameter in ``params`` that has one: ``state`` is
    ``opt.state`` (torch's or shardopt's, the same code for both)."""
    for p in params:
        if p not in state:
            continue
        s = state[p]
        if edit == "step.fill_":
            s["step"].fill_(1.0)
        elif edit == "step=":
            s["step"] = torch.tensor(5.0)
        elif edit == "exp_avg=piece" and "exp_avg" in s:
            s["exp_avg"] = torch.zeros_like(s["exp_avg"])
        elif edit == "exp_avg=whole":
            s["exp_avg"] = torch.zeros_like(p)
        elif edit == "exp_avg.zero_" and "exp_avg" in s:
            s["exp_avg"].zero_()
        elif edit == "exp_avg_sq.mul_" and "exp_avg_sq" in s:
            s["exp_avg_sq"].mul_(4.0)
        elif edit == "max_exp_avg_sq.mul_" and "max_exp_avg_sq" in s:
            s["max_exp_avg_sq"].mul_(3.0)
        elif edit == "state={}":
            state[p] = {}
        elif edit == "clear":
            s.clear()
        elif edit == "del":
            del state[p]


def _moment_error(opt, model, ref_opt, ref) -> float:
    """The largest difference between this rank's pieces of the moments in ``opt.state`` and the same
    elements of ``ref_opt``'s, relative to the largest of those."""
    view = opt.inspect().buffers[0]
    records = {id(r.param): r for r in view.records}
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        r = records.get(id(p))  # None: frozen
        if r is None or r.local is None or p not in opt.state:
            continue
        local, glob = next(run for run in view.shard_runs if run[0].start <= r.local.start < run[0].end)
        start = glob.start + r.local.start - local.start - r.span.global_range.start  # in the flattened parameter
        for k, mine in opt.state[p].items():
            if k != "step":
                want = ref_opt.state[q][k].reshape(-1)[start:start + r.local.size]
                worst = max(worst, ((mine - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
    return worst


def state_edit_case(edit: str, moments: str, amsgrad: bool) -> dict:
    """3 steps, ``edit`` on every parameter's state, 3 more steps; torch.optim.AdamW the same."""
    model, ref = make_model(seed=15), make_model(seed=15)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=2, moments=moments, amsgrad=amsgrad)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, amsgrad=amsgrad)
    for step in range(6):
        if step == 3:
            _edit_state(edit, opt.state, list(model.parameters()))
            _edit_state(edit, ref_opt.state, list(ref.parameters()))
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()
        ref_step(ref, ref_opt, step)
        if step == 3:  # the moments one step after the edit
            moment_error = _moment_error(opt, model, ref_opt, ref)
    steps = [(float(opt.state[p]["step"]), float(ref_opt.state[q]["step"]))
             for p, q in zip(model.parameters(), ref.parameters()) if p in opt.state]
    return {"worst": param_diff(model, ref), "moments": moment_error, "steps": steps,
            "entries": (len(opt.state), len(ref_opt.state))}


# (edit, moments, amsgrad); with moments="fp32" in-place writes into the moments went through already
STATE_EDITS = [(e, m, False) for e in ("step.fill_", "step=", "exp_avg=piece", "exp_avg=whole", "state={}", "clear",
                                       "del") for m in ("fp32", "bf16", "8bit")] + \
              [(e, m, False) for e in ("exp_avg.zero_", "exp_avg_sq.mul_") for m in ("bf16", "8bit")] + \
              [("max_exp_avg_sq.mul_", "bf16", True)]
# the weights against torch's after 3 steps past the edit: 16-bit moments round, 8-bit moments
# quantize (0.012 apart with no edit at all: only their step counts and moments are compared)
WEIGHT_TOL = {"fp32": 1e-6, "bf16": 2e-3, "8bit": None}
MOMENT_TOL = {"fp32": 1e-6, "bf16": 1e-2, "8bit": 3e-2}


@pytest.mark.parametrize("edit,moments,amsgrad", STATE_EDITS)
def test_writes_into_opt_state_are_the_state_as_in_torch(pools, edit, moments, amsgrad):
    for r, got in enumerate(pools(2).run(state_edit_case, edit, moments, amsgrad)):
        tol = WEIGHT_TOL[moments]
        assert tol is None or got["worst"] <= tol, (r, got)
        assert got["moments"] <= MOMENT_TOL[moments], (r, got)
        assert all(a == b for a, b in got["steps"]) and got["entries"][0] == got["entries"][1], (r, got)


def held_state_case(moments: str) -> dict:
    """exp_avg of every parameter kept across a step (torch's step updates it in place), then
    zeroed in place and let go; torch.optim.AdamW the same."""
    model, ref = make_model(seed=15), make_model(seed=15)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=2, moments=moments)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    kept: dict = {}
    for step in range(6):
        if step == 2:
            kept = {"mine": [opt.state[p]["exp_avg"] for p in model.parameters() if "exp_avg" in opt.state.get(p, {})],
                    "torch": [ref_opt.state[q]["exp_avg"] for q in ref.parameters() if q in ref_opt.state]}
        if step == 3:
            current = [opt.state[p]["exp_avg"] for p in model.parameters() if "exp_avg" in opt.state.get(p, {})]
            kept["live"] = all(torch.equal(a, b) for a, b in zip(kept["mine"], current))
            for t in kept["mine"] + kept["torch"]:
                t.zero_()
            del current, t
            kept["mine"] = kept["torch"] = []
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()
        ref_step(ref, ref_opt, step)
        if step == 3:  # the moments one step after the edit
            moment_error = _moment_error(opt, model, ref_opt, ref)
    return {"live": kept["live"], "worst": param_diff(model, ref), "moments": moment_error,
            "other": len(opt.state) - len(ref_opt.state)}


def test_state_tensors_kept_across_a_step_are_the_state_as_in_torch(pools):
    for moments, tol in (("bf16", 2e-3), ("8bit", None)):
        for r, got in enumerate(pools(2).run(held_state_case, moments)):
            assert got["live"] and (tol is None or got["worst"] <= tol) and got["moments"] <= MOMENT_TOL[moments], \
                (r, moments, got)
            assert got["other"] == 0, (r, got)  # opt.state.get(p) adds no entry, as a dict's get


def fractional_step_case() -> list:
    """A step count written in place to 1.5 on rank 0 only: every rank raises at the next step."""
    model = make_model(seed=17)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP)
    _train(model, opt, range(2))
    if dist.get_rank() == 0:
        opt.state[next(p for p in model.parameters() if p in opt.state)]["step"].fill_(1.5)
    errors = []
    for step in (2, 3):
        errors.append(error_of(lambda: _train(model, opt, range(step, step + 1))))
    return errors


def test_a_step_count_that_is_not_whole_raises_on_every_rank(pools):
    for r, (first, then) in enumerate(pools(2).run(fractional_step_case)):
        assert first is not None and first[0] == "RuntimeError" and "whole steps" in first[1], (r, first)
        assert then is None, (r, then)  # reported once: the step count stays the optimizer's

# -- 13: torch.optim.AdamW's keywords ------------------------------------------------------------------
def adamw_keywords_case(kw: dict, stage: int, tensor_lr: bool) -> float:
    model, ref = make_model(seed=14), make_model(seed=14)
    lr = torch.tensor(HP["lr"]) if tensor_lr else HP["lr"]
    hp = {**HP, "lr": lr}
    opt = shardopt.ShardedAdamW(model.parameters(), **hp, stage=stage, **kw)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hp, **{k: v for k, v in kw.items() if k != "fused"})
    for step in range(4):
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()
        ref_step(ref, ref_opt, step)
    worst = param_diff(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):  # the sharded max_exp_avg_sq is torch's, piece by piece
        if "max_exp_avg_sq" in ref_opt.state.get(q, {}) and "max_exp_avg_sq" in opt.state[p]:
            full = ref_opt.state[q]["max_exp_avg_sq"].reshape(-1)
            assert torch.isin(opt.state[p]["max_exp_avg_sq"], full).all()
    return worst


def test_adamw_keywords_run_unedited_and_amsgrad_maximize_are_torchs_bit_for_bit(pools):
    pool = pools(2)
    cases = [({"amsgrad": True}, 1, False), ({"amsgrad": True}, 2, False), ({"maximize": True}, 2, False),
             ({"amsgrad": True, "maximize": True}, 2, True), ({"fused": True, "foreach": None}, 2, False),
             ({"foreach": False, "capturable": False, "differentiable": False}, 1, False), ({}, 2, True)]
    for kw, stage, tensor_lr in cases:
        for worst in pool.run(adamw_keywords_case, kw, stage, tensor_lr):
            assert worst == 0.0, (kw, stage, tensor_lr, worst)


def amsgrad_formats_case(path: str) -> dict:
    """amsgrad's max_exp_avg_sq through every format: a sharded checkpoint (resumed at this world
    size), the rank state dict, torch.optim.AdamW's format both ways; each resume equals the run
    that went on, and torch's AdamW(amsgrad=True) takes the exported state and keeps stepping as
    ShardedAdamW does."""
    rank = dist.get_rank()
    hp = {**HP, "amsgrad": True}

    def run(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            opt.zero_grad()
            loss = model(batch(rank, step))
            opt.backward(loss) if isinstance(opt, shardopt.ShardedAdamW) else loss.backward()
            if not isinstance(opt, shardopt.ShardedAdamW):
                ddp_average(model)
            opt.step()

    model = make_model(seed=16)
    opt = shardopt.ShardedAdamW(model.parameters(), **hp, stage=2)
    run(model, opt, range(3))
    shardopt.save_checkpoint(path, model, opt)
    rank_sd = opt.state_dict()
    whole = opt.full_state_dict()
    run(model, opt, range(3, 5))
    out = {"amsgrad_in_export": rank != 0 or all("max_exp_avg_sq" in v for v in whole["state"].values())}
    for how in ("checkpoint", "rank_state_dict", "adamw_format"):
        again = make_model(seed=99)
        opt2 = shardopt.ShardedAdamW(again.parameters(), **hp, stage=2)
        if how == "checkpoint":
            shardopt.load_checkpoint(path, again, opt2)
        else:
            again.load_state_dict(make_model(seed=16).state_dict())
            run(again, shardopt.ShardedAdamW(again.parameters(), **hp, stage=2), range(3))  # the same weights
            opt2 = shardopt.ShardedAdamW(again.parameters(), **hp, stage=2)
            opt2.load_state_dict(rank_sd if how == "rank_state_dict" else whole)
        run(again, opt2, range(3, 5))
        out[how] = param_diff(model, again)
    # torch's AdamW(amsgrad=True) from the exported state goes on as ShardedAdamW does
    ref = make_model(seed=16)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hp)
    run(ref, ref_opt, range(3))
    plain = make_model(seed=16)
    plain_opt = torch.optim.AdamW(plain.parameters(), **hp)
    plain.load_state_dict(ref.state_dict())
    exported = [copy.deepcopy(whole)]  # torch's optimizer steps the tensors it loads in place
    dist.broadcast_object_list(exported, src=0)
    plain_opt.load_state_dict(exported[0])
    run(plain, plain_opt, range(3, 5))
    run(ref, ref_opt, range(3, 5))
    out["torch_from_export"] = param_diff(plain, ref)
    if rank == 0:  # the offline converter gives torch's state too
        from shardopt.convert import convert_checkpoint

        convert_checkpoint(path, path + ".pt")
        converted = torch.load(path + ".pt", weights_only=True)["optim"]["state"]
        out["converted"] = max((converted[k]["max_exp_avg_sq"] - v["max_exp_avg_sq"]).abs().max().item()
                               for k, v in whole["state"].items())
    return out


def test_amsgrads_maximum_survives_checkpoints_and_both_state_dict_formats(pools, tmp_path):
    for out in pools(2).run(amsgrad_formats_case, str(tmp_path / "ckpt")):
        assert out["amsgrad_in_export"], out
        for how in ("checkpoint", "rank_state_dict", "adamw_format", "torch_from_export"):
            assert out[how] == 0.0, (how, out)
        assert out.get("converted", 0.0) == 0.0, out


def refused_keywords_case() -> dict:
    out = {}
    for key, kw in (("differentiable", {"differentiable": True}), ("capturable", {"capturable": True}),
                    ("amsgrad_8bit", {"amsgrad": True, "moments": "8bit"}),
                    ("group_differentiable", None)):
        model = make_model()
        if kw is None:
            out[key] = error_of(lambda: shardopt.ShardedAdamW([{"params": model.parameters(), "differentiable": True}]))
        else:
            out[key] = error_of(lambda: shardopt.ShardedAdamW(model.parameters(), **kw))
    out["muon_flag"] = error_of(lambda: shardopt.ShardedMuon([torch.nn.Parameter(torch.ones(3, 3))], maximize=True))
    # amsgrad turned on after construction: refused at the step, before any shard moves
    model = make_model()
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["amsgrad"] = True
    opt.backward(model(batch(dist.get_rank(), 0)))
    out["late_amsgrad"] = error_of(opt.step)
    out["late_amsgrad_untouched"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return out


def test_adamw_keywords_that_cannot_hold_name_the_flag_on_every_rank(pools):
    for out in pools(2).run(refused_keywords_case):
        assert out["differentiable"][0] == "ValueError" and "differentiable=True" in out["differentiable"][1], out
        assert out["group_differentiable"][0] == "ValueError" and "differentiable=True" in out["group_differentiable"][1]
        assert out["capturable"][0] == "ValueError" and "capturable=True" in out["capturable"][1], out
        assert "these are on cpu" in out["capturable"][1], out
        assert out["amsgrad_8bit"][0] == "ValueError" and "moments='8bit'" in out["amsgrad_8bit"][1], out
        assert out["muon_flag"][0] == "TypeError" and "'maximize'" in out["muon_flag"][1], out
        assert out["late_amsgrad"][0] == "ValueError" and "set after the optimizer was built" in out["late_amsgrad"][1]
        assert out["late_amsgrad_untouched"], out


# -- 14: a tensor learning rate, and ShardedMuon's messages --------------------------------------------
def muon_tensor_lr_case() -> float:
    torch.manual_seed(15)
    weights = [torch.randn(6, 4), torch.randn(5, 5), torch.randn(4, 7)]
    ours = [nn.Parameter(w.clone()) for w in weights]
    theirs = [nn.Parameter(w.clone()) for w in weights]
    opt = shardopt.ShardedMuon(ours, lr=torch.tensor(2e-2), stage=2)
    ref = torch.optim.Muon(theirs, lr=torch.tensor(2e-2))
    for step in range(4):
        g = torch.Generator().manual_seed(step)  # the same gradient on every rank: the average is exact
        for p, q in zip(ours, theirs):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    return max((p - q).abs().max().item() for p, q in zip(ours, theirs))


def muon_messages_case() -> dict:
    mat = nn.Parameter(torch.ones(3, 3))
    return {
        "lr2": error_of(lambda: shardopt.ShardedMuon([mat], lr=torch.tensor([1e-2, 2e-2]))),
        "adamw_lr2": error_of(lambda: shardopt.ShardedAdamW([mat], lr=torch.tensor([1e-2, 2e-2]))),
        "frozen3d": error_of(lambda: shardopt.ShardedMuon([nn.Parameter(torch.ones(2, 3, 4), requires_grad=False)])),
        "frozen_complex": error_of(lambda: shardopt.ShardedMuon(
            [nn.Parameter(torch.ones(3, 3, dtype=torch.complex64), requires_grad=False)])),
        "frozen_only": error_of(lambda: shardopt.ShardedAdamW([nn.Parameter(torch.ones(3), requires_grad=False)])),
    }


def test_muon_tensor_lr_is_torchs_and_its_messages_name_the_problem(pools):
    pool = pools(2)
    for worst in pool.run(muon_tensor_lr_case):
        assert worst == 0.0, worst
    for out in pool.run(muon_messages_case):
        for key in ("lr2", "adamw_lr2"):
            assert out[key][0] == "ValueError" and "must hold one element" in out[key][1] and "(2,)" in out[key][1], out
        assert out["frozen3d"][0] == "ValueError" and "(2, 3, 4)" in out["frozen3d"][1], out
        assert "2-D matrices" in out["frozen3d"][1], out
        assert out["frozen_complex"][0] == "TypeError" and "complex" in out["frozen_complex"][1], out
        assert "none with requires_grad=True" in out["frozen_only"][1] and "empty" not in out["frozen_only"][1], out
