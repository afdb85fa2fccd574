"""Tier 2: torch's own optimizer contracts, for ShardedAdamW (stages 1 and 2) and ShardedMuon, at 1 and 2 gloo ranks.

Each test restates one test of torch's ``test/test_optim.py`` (``TestOptimRenewed``), named after it,
and runs it over the sample inputs torch ships for ``torch.optim.AdamW`` and ``torch.optim.Muon``
(``torch.testing._internal.common_optimizers``: ``optim_inputs_func``, the inputs with torch's
global flags, ``optim_error_inputs_func``, ``scheduler_inputs``). Only those inputs are read from
torch's test internals (in the spawned ranks: importing them changes process-wide settings); the
tests are our own code. Where torch compares two of its implementations (foreach or fused against
the for-loop), the test here compares ShardedAdamW and ShardedMuon against torch's own optimizer,
parameters and every state tensor, bit for bit.

What does not apply, and why, is listed in ``NOT_APPLICABLE`` and in docs/semantics.md ("torch's
optimizer tests"); ``tests/test_torch_contracts.py`` holds the contracts found missing before
(gradients assigned by hand, ``opt.state``, the keywords, a tensor lr).

Catches: a sample input that raises or trains the wrong way, state dicts that do not round-trip
(or are not ``weights_only``-loadable), hooks that do not fire as torch fires them, a step that
differs from torch's on any input.
"""
from __future__ import annotations

import copy
import functools
import io
import os
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import Parameter
from torch.optim.lr_scheduler import ReduceLROnPlateau

import shardopt

KINDS = ("adamw-stage1", "adamw-stage2", "muon")
WORLDS = (1, 2)

# torch's tests (test/test_optim.py, TestOptimRenewed) that do not run here, and why; docs/semantics.md
# lists the same. The CUDA-only, sparse, complex and closure-only tests never run for AdamW or Muon on CPU.
NOT_APPLICABLE = {
    "test_deepcopy_copies_all_public_attrs": "copy.deepcopy(opt) raises a TypeError saying to build a new optimizer "
                                             "and load_state_dict (test_torch_contracts.py): a copy would share the "
                                             "process groups and hooks",
    "test_complex, test_complex_2d": "complex parameters are refused at construction (a TypeError naming the dtype)",
    "test_foreach_matches_forloop, test_fused_matches_forloop": "one fused update always runs; "
                                                                "test_matches_torch_step_for_step compares it with torch",
    "test_fused_error_on_params_on_meta": "meta parameters are refused at construction",
    "test_rosenbrock_sparse": "sparse gradients are refused (neither AdamW nor Muon supports them in torch either)",
}


@functools.cache
def _infos() -> dict[str, Any]:
    """torch's OptimizerInfo for AdamW and Muon. Imported in the ranks only: torch's test utilities
    set the inductor cache directory and freeze backend flags when imported, which is undone here."""
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    from torch.testing._internal import common_optimizers

    if cache is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    return {o.optim_cls.__name__: o for o in common_optimizers.optim_db if o.optim_cls.__name__ in ("AdamW", "Muon")}


def _info(kind: str) -> Any:
    return _infos()["Muon" if kind == "muon" else "AdamW"]


def _inputs(kind: str, flags: bool = False, skip: tuple[str, ...] = ()) -> list[Any]:
    """The sample inputs torch's tests use: ``optim_inputs_func``, or with ``flags`` those with
    torch's global flags (foreach, fused, differentiable) added one at a time, as torch adds them."""
    from torch.testing._internal.common_optimizers import _get_optim_inputs_including_global_cliquey_kwargs

    info = _info(kind)
    if flags:
        return _get_optim_inputs_including_global_cliquey_kwargs("cpu", torch.float32, info, skip=skip)
    return info.optim_inputs_func(device="cpu")


def _distinct(inputs: list[Any]) -> list[Any]:
    """``inputs`` without those that differ from an earlier one only in ``foreach``/``fused``, which
    choose torch's implementation and change nothing here (tests/test_torch_contracts.py checks
    that they are taken): the longer tests run each distinct input once."""
    seen, out = set(), []
    for inp in inputs:
        key = repr(sorted((k, repr(v)) for k, v in inp.kwargs.items() if k not in ("foreach", "fused")))
        if key not in seen:
            seen.add(key)
            out.append(inp)
    return out


def make(kind: str, params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    if kind == "muon":
        return shardopt.ShardedMuon(params, stage=2, **kwargs)
    return shardopt.ShardedAdamW(params, stage=int(kind[-1]), **kwargs)


def make_torch(kind: str, params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """torch's own optimizer with the same arguments (the for-loop implementation for AdamW: the one
    ShardedAdamW's reference kernels follow operation for operation)."""
    if kind == "muon":
        return torch.optim.Muon(params, **kwargs)
    return torch.optim.AdamW(params, **{**kwargs, "fused": False, "foreach": False})


def _weight_bias(kind: str, contiguous: bool = True) -> tuple[Parameter, Parameter | None]:
    """torch's (10, 5) weight and (10,) bias (non-contiguous views when asked); Muon takes the weight only."""
    if contiguous:
        weight, bias = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
    else:
        weight, bias = Parameter(torch.randn(10, 5, 2)[..., 0]), Parameter(torch.randn(10, 2)[..., 0])
    return weight, (None if kind == "muon" else bias)


def _loss(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    y = weight.mv(x)
    return (y if bias is None else y + bias).pow(2).sum()


def _same(a: Any, b: Any, path: str = "") -> None:
    """Nested equality, tensors bit for bit (dtype, shape and values), as torch's assertEqual on state dicts."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b) if isinstance(b, dict) else b)
        for k in a:
            _same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}/{i}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, (path, a, b)
        assert torch.equal(a, b), (path, (a - b).abs().max())
    else:
        assert a == b, (path, a, b)


def _run(pools: Any, fn: Callable, *args: Any) -> None:
    for world in WORLDS:
        pools(world).run(fn, *args)


# -- errors -----------------------------------------------------------------------------------------
# torch's error inputs whose outcome differs here, by description: what happens instead.
ERROR_EXCEPTIONS = {
    # ShardedAdamW's update is never foreach: a tensor lr with foreach=True is taken (and stepped as torch's tensor lr)
    "lr as a Tensor is not supported for capturable=False and foreach=True": "accepted",
    # Muon's complex parameter: refused at construction (a TypeError naming it), not at the first step
    "Muon does not support complex parameters": "TypeError at construction",
}


def errors_case(kind: str) -> list[str]:
    from torch.testing._internal.common_optimizers import OptimizerErrorEnum

    seen = []
    for error in _info(kind).optim_error_inputs_func(device="cpu", dtype=torch.float32):
        inp = error.optimizer_error_input
        params, kwargs = inp.params, dict(inp.kwargs)
        if params is None:  # torch checks keyword arguments before it looks at params
            params = [Parameter(torch.randn(2, 2))]
        expected = ERROR_EXCEPTIONS.get(error.error_regex, error.error_type)
        if expected == "accepted":
            make(kind, params, **kwargs)
        elif expected == "TypeError at construction":
            with pytest.raises(TypeError, match="complex"):
                make(kind, params, **kwargs)
        elif error.error_on == OptimizerErrorEnum.STEP_ERROR:
            opt = make(kind, params, **kwargs)
            with pytest.raises(error.error_type):
                opt.step()
        elif issubclass(error.error_type, Warning):
            with pytest.warns(error.error_type):
                make(kind, params, **kwargs)
        else:  # the same exception class as torch's; the message is shardopt's own, naming the value
            with pytest.raises(error.error_type) as caught:
                make(kind, params, **kwargs)
            assert str(caught.value), error.error_regex
        seen.append(error.error_regex)
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_errors(pools, kind):
    _run(pools, errors_case, kind)


# -- training goes the right way ------------------------------------------------------------------
def _schedulers(kind: str, opt: torch.optim.Optimizer, with_lrsched: bool) -> list[Any]:
    return [s(opt) for s in _info(kind).scheduler_inputs[0]] if with_lrsched else []


def _sched_step(schedulers: list[Any], loss: torch.Tensor) -> None:
    for s in schedulers:
        s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()


def forloop_direction_case(kind: str) -> None:
    for contiguous in (True, False):
        for with_lrsched in (True, False):
            for inp in _inputs(kind):
                torch.manual_seed(0)
                weight, bias = _weight_bias(kind, contiguous)
                x = torch.randn(5)
                opt = make(kind, [p for p in (weight, bias) if p is not None], **inp.kwargs)
                schedulers = _schedulers(kind, opt, with_lrsched)

                def closure() -> torch.Tensor:
                    opt.zero_grad()
                    loss = _loss(weight, bias, x)
                    loss.backward()
                    return loss

                initial = closure().item()
                for _ in range(20):
                    loss = closure()
                    opt.step()
                    _sched_step(schedulers, loss)
                final = closure().item()
                opt.zero_grad()
                maximize = inp.kwargs.get("maximize", False)
                assert (final > initial) if maximize else (final < initial), (inp.desc, contiguous, initial, final)


@pytest.mark.parametrize("kind", KINDS)
def test_forloop_goes_right_direction(pools, kind):
    _run(pools, forloop_direction_case, kind)


def param_group_lrscheduler_case(kind: str) -> None:
    for schedulers_c in _info(kind).scheduler_inputs:
        torch.manual_seed(1)
        weight, weight2, x = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10, 5)), torch.randn(5)
        opt = make(kind, [{"params": [weight]}, {"params": [weight2], "lr": 0.01}])
        schedulers = [s(opt) for s in schedulers_c]

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = (weight.mv(x) + weight2.mv(x)).pow(2).sum()
            loss.backward()
            return loss

        initial = closure().item()
        for _ in range(20):
            loss = opt.step(closure)
            _sched_step(schedulers, loss)
        assert closure().item() < initial


@pytest.mark.parametrize("kind", KINDS)
def test_param_group_with_lrscheduler_goes_right_direction(pools, kind):
    _run(pools, param_group_lrscheduler_case, kind)


def tensor_lr_case(kind: str) -> None:
    """A tensor lr (0-, 1- and 2-dimensional, one element) steps as the same float lr does, and as
    torch's own optimizer with that tensor lr, bit for bit."""
    for num_dim in (0, 1, 2):
        for inp in _distinct(_inputs(kind, flags=True, skip=("differentiable",))):
            torch.manual_seed(2)
            weight, bias = _weight_bias(kind)
            x = torch.randn(5)
            params = [p for p in (weight, bias) if p is not None]
            copies = [[Parameter(p.detach().clone()) for p in params] for _ in range(3)]
            kwargs = {k: v for k, v in inp.kwargs.items() if k != "lr"}
            lr_t = torch.tensor(1e-3).reshape([1] * num_dim)
            opts = [make(kind, params, lr=1e-3, **kwargs), make(kind, copies[0], lr=lr_t.clone(), **kwargs),
                    make_torch(kind, copies[1], lr=lr_t.clone(), **kwargs)]
            for _ in range(5):
                for opt, ps in zip(opts, (params, copies[0], copies[1])):
                    opt.zero_grad()
                    _loss(ps[0], ps[1] if len(ps) > 1 else None, x).backward()
                    opt.step()
            for a, b, c in zip(params, copies[0], copies[1]):
                assert (b - c).abs().max().item() == 0.0, ("tensor lr vs torch's", inp.desc, num_dim)
                assert torch.allclose(a, b, rtol=1.3e-6, atol=1e-5), ("float lr vs tensor lr", inp.desc, num_dim)


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_lr(pools, kind):
    _run(pools, tensor_lr_case, kind)


def param_groups_weight_decay_case(kind: str) -> None:
    for inp in _distinct(_inputs(kind, flags=True, skip=("differentiable",))):
        torch.manual_seed(3)
        weight = Parameter(torch.randn(10, 5))
        bias = Parameter(torch.randn(10, 1) if kind == "muon" else torch.randn(10))  # Muon: 2-D only
        x = torch.randn(5)
        opt = make(kind, [dict(params=[weight], **inp.kwargs), {"params": [bias], **inp.kwargs, "weight_decay": 0.0}])

        def loss_fn() -> torch.Tensor:
            return (weight.mv(x) + bias.view(-1)).pow(2).sum()

        initial = loss_fn().item()
        for _ in range(20):
            opt.zero_grad()
            loss_fn().backward()
            opt.step()
        final = loss_fn().item()
        maximize = inp.kwargs.get("maximize", False)
        assert (final > initial) if maximize else (final < initial), inp.desc


@pytest.mark.parametrize("kind", KINDS)
def test_param_groups_weight_decay(pools, kind):
    _run(pools, param_groups_weight_decay_case, kind)


def param_groups_lr_case(kind: str) -> None:
    for inp in _distinct(_inputs(kind, flags=True, skip=("differentiable",))):
        torch.manual_seed(4)
        weight, bias = _weight_bias(kind)
        x = torch.randn(5)
        irrelevant = Parameter(torch.randn(2, 2))
        kwargs = dict(inp.kwargs)
        if not kwargs.get("lr"):
            kwargs["lr"] = 1e-3
        params = [p for p in (weight, bias) if p is not None]
        opt = make(kind, [dict(params=params, **kwargs), dict(params=[irrelevant])], lr=1e-28)
        before = irrelevant.detach().clone()
        initial = _loss(weight, bias, x).item()
        for _ in range(20):
            opt.zero_grad()
            if kind != "adamw-stage1":  # stage 2 averages a gradient in backward: it is assigned before one
                irrelevant.grad = torch.rand_like(irrelevant)  # (docs/semantics.md), torch assigns it after
            _loss(weight, bias, x).backward()
            if kind == "adamw-stage1":
                irrelevant.grad = torch.rand_like(irrelevant)
            opt.step()
        final = _loss(weight, bias, x).item()
        maximize = kwargs.get("maximize", False)
        assert (final > initial) if maximize else (final < initial), inp.desc
        assert torch.allclose(irrelevant, before, rtol=1.3e-6, atol=1e-5), inp.desc


@pytest.mark.parametrize("kind", KINDS)
def test_param_groups_lr(pools, kind):
    _run(pools, param_groups_lr_case, kind)


# -- steps that change nothing ----------------------------------------------------------------------
def zero_grads_case(kind: str) -> None:
    for inp in _inputs(kind, flags=True):
        if inp.kwargs.get("weight_decay", 0) != 0 or inp.kwargs.get("differentiable"):
            continue  # differentiable=True is refused (test_torch_contracts.py)
        torch.manual_seed(5)
        param = Parameter(torch.randn(5, 1))
        kwargs = dict(inp.kwargs)
        kwargs["lr"] = torch.tensor(1e-5) if isinstance(kwargs.get("lr"), torch.Tensor) else 1e-5
        opt = make(kind, [param], **kwargs)
        old = param.detach().clone()
        param.grad = torch.zeros_like(param)
        opt.step(lambda: torch.tensor([1.0]))
        assert torch.allclose(old, param, rtol=1.3e-6, atol=1e-5), inp.desc


@pytest.mark.parametrize("kind", KINDS)
def test_step_is_noop_for_zero_grads(pools, kind):
    _run(pools, zero_grads_case, kind)


def no_grad_step_case(kind: str) -> None:
    """torch builds this test over parameters that require no gradient, which ShardedAdamW refuses
    (see NOT_APPLICABLE's neighbour in docs/semantics.md); the same contract over parameters that
    require one but have none: the step changes nothing."""
    for inp in _inputs(kind, flags=True):
        if inp.kwargs.get("differentiable"):
            continue
        torch.manual_seed(6)
        params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
        old = [p.detach().clone() for p in params]
        opt = make(kind, params, **inp.kwargs)
        opt.step(lambda: torch.tensor([1.0]))
        assert all(torch.equal(p, q) for p, q in zip(params, old)), inp.desc
        assert len(opt.state) == 0, inp.desc


@pytest.mark.parametrize("kind", KINDS)
def test_step_is_noop_when_params_have_no_grad(pools, kind):
    _run(pools, no_grad_step_case, kind)


def printed_case(kind: str) -> None:
    for inp in _inputs(kind, flags=True):
        if inp.kwargs.get("differentiable"):
            continue
        opt = make(kind, [Parameter(torch.randn(2, 3)) for _ in range(2)], **inp.kwargs)
        assert type(opt).__name__ in repr(opt)


@pytest.mark.parametrize("kind", KINDS)
def test_optimizer_can_be_printed(pools, kind):
    _run(pools, printed_case, kind)


# -- state dicts ------------------------------------------------------------------------------------
def _named(params: list[Parameter], named: bool) -> list[Any]:
    return [(f"name{i}", p) for i, p in enumerate(params)] if named else params


def _without_names(sd: dict[str, Any]) -> dict[str, Any]:
    sd = copy.deepcopy(sd)
    for g in sd["param_groups"]:
        g.pop("param_names", None)
    return sd


def state_dict_deterministic_case(kind: str) -> None:
    for named0, named1 in ((False, True), (True, False)):  # named into unnamed and back
        for inp in _distinct(_inputs(kind, flags=True, skip=("differentiable",))):
            torch.manual_seed(7)
            weight, bias = _weight_bias(kind)
            params = [p for p in (weight, bias) if p is not None]
            x = torch.randn(5)
            opt = make(kind, _named(params, named0), **inp.kwargs)

            def closure(o: torch.optim.Optimizer, ps: list[Parameter]) -> torch.Tensor:
                o.zero_grad()
                loss = _loss(ps[0], ps[1] if len(ps) > 1 else None, x)
                loss.backward()
                return loss

            for _ in range(3):  # torch steps 10 times each side: three show the same
                opt.step(lambda: closure(opt, params))
            copies = [Parameter(p.detach().clone()) for p in params]
            opt_c = make(kind, _named(copies, named1), **inp.kwargs)
            sd = copy.deepcopy(opt.state_dict())
            opt_c.load_state_dict(copy.deepcopy(sd))
            for _ in range(3):
                opt.step(lambda: closure(opt, params))
                opt_c.step(lambda: closure(opt_c, copies))
                for p, q in zip(params, copies):
                    assert torch.equal(p, q), inp.desc
            _same(_without_names(opt.state_dict()), _without_names(opt_c.state_dict()))
            opt_c.param_groups.extend(opt_c.param_groups)  # a repeated group packs as torch packs it
            _same(_without_names(opt.state_dict())["param_groups"][-1],
                  _without_names(opt_c.state_dict())["param_groups"][-1])


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_deterministic(pools, kind):
    _run(pools, state_dict_deterministic_case, kind)


def _small_model(kind: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(8)
    if kind == "muon":
        return nn.Linear(10, 4, bias=False), torch.rand(10)
    return nn.Sequential(nn.Conv2d(4, 2, 1, stride=2), nn.BatchNorm2d(2, eps=1e-05, momentum=0.1)), torch.rand(1, 4, 16, 16)


def older_state_dict_case(kind: str) -> None:
    flags = _info(kind).not_og_supported_flags
    for inp in _distinct(_inputs(kind, flags=True, skip=("differentiable",))):
        model, x = _small_model(kind)
        opt = make(kind, model.parameters(), **inp.kwargs)

        def fwd_bwd() -> None:
            opt.zero_grad()
            model(x).sum().backward()

        for _ in range(3):
            fwd_bwd()
            opt.step()
        sd = copy.deepcopy(opt.state_dict())
        for g in sd["param_groups"]:
            for flag in flags:
                g.pop(flag, None)
        opt.load_state_dict(sd)
        fwd_bwd()
        opt.step()
        assert all(flag in g for g in opt.param_groups for flag in flags if kind != "muon"), "missing flags default"


@pytest.mark.parametrize("kind", KINDS)
def test_can_load_older_state_dict(pools, kind):
    _run(pools, older_state_dict_case, kind)


def named_state_dict_case(kind: str) -> None:
    for named1 in (False, True):
        for named2 in (False, True):
            for inp in _distinct(_inputs(kind, flags=True, skip=("differentiable",))):
                model, x = _small_model(kind)
                opt = make(kind, model.named_parameters() if named1 else model.parameters(), **inp.kwargs)
                for _ in range(3):
                    opt.zero_grad()
                    model(x).sum().backward()
                    opt.step()
                sd = copy.deepcopy(opt.state_dict())
                opt2 = make(kind, model.named_parameters() if named2 else model.parameters(), **inp.kwargs)
                opt2.load_state_dict(sd)
                opt2.zero_grad()
                model(x).sum().backward()
                opt2.step()
                if named1 or named2:
                    want = [n for n, _ in model.named_parameters()]
                    assert opt2.state_dict()["param_groups"][0]["param_names"] == want, inp.desc


@pytest.mark.parametrize("kind", KINDS)
def test_can_load_from_to_named_state_dict(pools, kind):
    _run(pools, named_state_dict_case, kind)


def weights_only_case(kind: str) -> None:
    for named in (False, True):
        for inp in _distinct(_inputs(kind, flags=True, skip=("differentiable",))):
            torch.manual_seed(9)
            weight, bias = _weight_bias(kind)
            params = [p for p in (weight, bias) if p is not None]
            x = torch.randn(5)
            opt = make(kind, _named(params, named), **inp.kwargs)
            for _ in range(3):
                opt.zero_grad()
                _loss(weight, bias, x).backward()
                opt.step()
            sd = opt.state_dict()
            buf = io.BytesIO()
            torch.save(sd, buf)
            for weights_only in (False, True):
                buf.seek(0)
                _same(torch.load(buf, weights_only=weights_only), sd)


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_equality_with_weights_only(pools, kind):
    _run(pools, weights_only_case, kind)


def nontensor_step_case(kind: str) -> None:
    torch.manual_seed(10)
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)
    for inp in _inputs(kind, flags=True, skip=("differentiable",)):
        opt = make(kind, params, **inp.kwargs)
        for _ in range(3):
            opt.step()
        sd = copy.deepcopy(opt.state_dict())
        for state in sd["state"].values():
            if isinstance(state, dict) and torch.is_tensor(state.get("step")):
                state["step"] = state["step"].item()
        opt.load_state_dict(sd)
        opt.step()
        opt.close()


@pytest.mark.parametrize("kind", KINDS)
def test_load_nontensor_step(pools, kind):
    _run(pools, nontensor_step_case, kind)


def non_empty_state_case(kind: str) -> None:
    for inp in _inputs(kind):
        torch.manual_seed(11)
        model = nn.Linear(5, 5, bias=kind != "muon")
        opt = make(kind, model.parameters(), **inp.kwargs)
        model(torch.rand(2, 5)).sum().backward()
        opt.step()
        assert len(opt.state) > 0 or (kind == "muon" and dist.get_rank() > 0), inp.desc  # Muon: the owner holds it
        for state in opt.state.values():
            assert len(state) > 0, inp.desc


@pytest.mark.parametrize("kind", KINDS)
def test_non_empty_state(pools, kind):
    _run(pools, non_empty_state_case, kind)


# -- hooks --------------------------------------------------------------------------------------------
def _state_dict_pre_hook(opt: torch.optim.Optimizer) -> None:
    opt.state["test"] = 1


def _state_dict_post_hook(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    if "test" in sd["state"]:
        sd["state"].pop("test")
        sd["ran_state_dict_pre_hook"] = True
    else:
        sd["ran_state_dict_pre_hook"] = False
    return sd


def _load_pre_hook1(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    sd["param_groups"][0]["lr"] = 0.002


def _load_pre_hook2(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    sd = copy.deepcopy(sd)
    sd["param_groups"][0]["lr"] = 0.003
    return sd


def _load_post_hook(opt: torch.optim.Optimizer) -> None:
    opt.state["ran_load_state_dict_pre_hook2"] = opt.param_groups[0]["lr"] == 0.003
    opt.state["ran_load_state_dict_post_hook"] = True


def hooks_case(kind: str) -> None:
    for inp in _inputs(kind, flags=True, skip=("differentiable",)):
        param = Parameter(torch.rand(2, 3))
        for name in ("pre", "post", "pre_post"):
            opt = make(kind, [param], **inp.kwargs)
            if name != "post":
                opt.register_state_dict_pre_hook(_state_dict_pre_hook)
            if name != "pre":
                opt.register_state_dict_post_hook(_state_dict_post_hook)
            sd = opt.state_dict()
            if name == "pre":
                assert sd["state"]["test"] == 1, inp.desc
            elif name == "post":
                assert sd["ran_state_dict_pre_hook"] is False, inp.desc
            else:
                assert "test" not in sd["state"] and sd["ran_state_dict_pre_hook"] is True, inp.desc
            opt.close()
        # load_state_dict's hooks: a pre hook changing the dict in place, another prepended that returns a new one
        opt = make(kind, [param], **inp.kwargs)
        sd = opt.state_dict()
        opt.register_load_state_dict_pre_hook(_load_pre_hook1)
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["lr"] == 0.002, inp.desc
        opt.register_load_state_dict_pre_hook(_load_pre_hook2, prepend=True)
        opt.load_state_dict(opt.state_dict())
        assert opt.param_groups[0]["lr"] == 0.002, inp.desc  # hook2 ran first, then hook1
        opt.close()
        for with_pre in (False, True):
            opt = make(kind, [param], **inp.kwargs)
            if with_pre:
                opt.register_load_state_dict_pre_hook(_load_pre_hook2)
            opt.register_load_state_dict_post_hook(_load_post_hook)
            opt.load_state_dict(opt.state_dict())
            assert bool(opt.state["ran_load_state_dict_pre_hook2"]) is with_pre, inp.desc  # a tensor with tensor lr
            assert opt.state["ran_load_state_dict_post_hook"] is True, inp.desc
            opt.close()


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_and_load_state_dict_hooks(pools, kind):
    _run(pools, hooks_case, kind)


def step_hooks_case(kind: str) -> None:
    """torch's step-hook tests over a float parameter without a gradient (torch uses an int tensor,
    which ShardedAdamW cannot shard): the hooks' writes to the weight are the only change."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    for inp in _inputs(kind, flags=True, skip=("differentiable",)):
        for pre in (False, True):
            param = Parameter(torch.full((1, 2), 5.0 if pre else 2.0))
            opt = make(kind, [param], **inp.kwargs)

            def hook(*_: Any) -> None:
                param.data += 2

            handle = opt.register_step_pre_hook(hook) if pre else opt.register_step_post_hook(hook)
            opt.step()
            opt.step()
            assert param.flatten().tolist() == [9.0, 9.0] if pre else [6.0, 6.0], (inp.desc, param)
            handle.remove()
            opt.step()
            assert param.flatten().tolist() == [9.0, 9.0] if pre else [6.0, 6.0], (inp.desc, param)
            opt.close()
        param = Parameter(torch.ones(1, 2))
        opt, other = make(kind, [param], **inp.kwargs), torch.optim.SGD([Parameter(torch.ones(2))], lr=0.1)
        data: list[int] = []
        handles = [register_optimizer_step_pre_hook(lambda *_: data.append(0)),
                   register_optimizer_step_post_hook(lambda *_: data.append(5))]
        for o in (opt, other):
            handles += [o.register_step_pre_hook(lambda *_: data.append(1)),
                        o.register_step_post_hook(lambda *_: data.append(2))]
        opt.step()
        other.step()
        opt.step()
        assert data == [0, 1, 2, 5] * 3, (inp.desc, data)
        for h in handles:
            h.remove()
        opt.step()
        other.step()
        assert data == [0, 1, 2, 5] * 3, (inp.desc, data)
        opt.close()


@pytest.mark.parametrize("kind", KINDS)
def test_step_pre_post_and_all_hooks(pools, kind):
    _run(pools, step_hooks_case, kind)


# -- the same steps as torch's --------------------------------------------------------------------------
def _pieces(opt: torch.optim.Optimizer, p: Parameter) -> tuple[int, int] | None:
    """(start, size) of this rank's piece of ``p`` in the flattened parameter, None without one."""
    for b in opt.inspect().buffers:
        for r in b.records:
            if r.param is p and r.local is not None:
                local, glob = next(run for run in b.shard_runs if run[0].start <= r.local.start < run[0].end)
                return glob.start + r.local.start - local.start - r.span.global_range.start, r.local.size
    return None


def step_for_step_case(kind: str, dtype_name: str) -> None:
    """torch's foreach/fused-against-for-loop test, against torch's own optimizer: a small MLP, seven
    iterations with the third a step without gradients and a layer frozen for the fourth and fifth;
    every parameter and every state tensor (this rank's piece of it) equal to torch's after each."""
    dtype = getattr(torch, dtype_name)
    for inp in _inputs(kind):
        kwargs = dict(inp.kwargs)
        torch.manual_seed(1)
        if kind == "muon":
            model = nn.Sequential(nn.Linear(2, 3, bias=False), nn.Sigmoid(), nn.Linear(3, 4, bias=False), nn.Sigmoid())
        else:
            model = nn.Sequential(nn.Linear(2, 3), nn.Sigmoid(), nn.Linear(3, 1), nn.Sigmoid())
        model = model.to(dtype)
        ref = copy.deepcopy(model)
        x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype).reshape(3, 2)
        ref_kwargs = dict(kwargs)
        if isinstance(ref_kwargs.get("lr"), torch.Tensor):
            ref_kwargs["lr"] = ref_kwargs["lr"].clone()  # each optimizer its own tensor (schedulers write it)
        opt, ref_opt = make(kind, model.parameters(), **kwargs), make_torch(kind, ref.parameters(), **ref_kwargs)
        for i in range(7):
            for net, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                if i == 3:
                    net[2].requires_grad_(False)
                if i == 5:
                    net[2].requires_grad_(True)
                if i != 2:  # a step with every gradient None
                    net(x).sum().backward()
                o.step()
            for p, q in zip(model.parameters(), ref.parameters()):
                assert torch.equal(p, q), (inp.desc, dtype_name, i, (p - q).abs().max())
                mine, theirs = opt.state[p] if p in opt.state else {}, ref_opt.state.get(q, {})
                piece = _pieces(opt, p)
                for key, want in theirs.items():
                    if key == "step":
                        assert float(mine["step"]) == float(want), (inp.desc, i)
                    elif piece is not None:
                        start, size = piece
                        got = mine[key].reshape(-1)
                        assert torch.equal(got, want.reshape(-1)[start:start + size].float()), (inp.desc, key, i)


@pytest.mark.parametrize("kind", KINDS)
def test_matches_torch_step_for_step(pools, kind):
    for world in WORLDS:
        pools(world).run(step_for_step_case, kind, "float32")
