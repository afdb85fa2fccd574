"""An optimizer the program no longer references is freed with everything it holds (flat buffers,
master weights, moments, gradient buckets), like torch.optim.AdamW: building one optimizer after
another in one process (a sweep, a benchmark, a test suite) must not keep the earlier ones' memory."""
import gc
import weakref

import pytest
import torch

import shardopt

pytestmark = pytest.mark.usefixtures("one_rank_group")


def _train_and_drop(**kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    if kwargs.pop("bf16", False):
        model = model.to(torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, **kwargs)
    for _ in range(2):
        x = torch.randn(8, 32, dtype=model[0].weight.dtype)
        opt.backward(model(x).float().square().mean())
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    opt.state_dict()  # a copy of the state, made and dropped
    # The last backward pass's gradient stays in p.grad, as when a loop stops before its step: a
    # stage-2 placeholder then keeps that gradient's shard for the next optimizer, not the optimizer.
    opt.backward(model(torch.randn(8, 32, dtype=model[0].weight.dtype)).float().square().mean())
    return weakref.ref(opt), weakref.ref(model[0].weight), weakref.ref(model)


@pytest.mark.parametrize("kwargs", [dict(stage=1), dict(stage=2), dict(stage=2, overlap_param_gather=True),
                                    dict(stage=2, bf16=True, master_weights="remainder", moments="8bit")],
                         ids=["stage1", "stage2", "stage2-overlap", "stage2-bf16-remainder-8bit"])
def test_a_dropped_optimizer_frees_its_parameters_and_state(kwargs):
    refs = _train_and_drop(**kwargs)
    gc.collect()
    alive = [name for name, r in zip(("optimizer", "parameter", "model"), refs) if r() is not None]
    assert not alive, f"still referenced after the program dropped them: {alive}"


def test_live_tensor_bytes_return_to_where_they_were():
    def live_bytes():
        gc.collect()
        return sum(o.untyped_storage().nbytes() for o in gc.get_objects()
                   if type(o) is torch.Tensor and o.device.type == "cpu")

    _train_and_drop(stage=2)  # the first run compiles kernels and fills caches
    before = live_bytes()
    for _ in range(3):
        _train_and_drop(stage=2)
    assert live_bytes() <= before


def test_hooks_of_a_freed_optimizer_go_at_the_next_construction_never_during_a_collection():
    # A collection can run while torch.compile traces a module call and reads the global hook
    # dict for its guards; removing a hook there breaks the compilation.
    from torch.nn.modules.module import _global_forward_pre_hooks

    shardopt.ShardedAdamW(torch.nn.Linear(2, 2).parameters()).close()
    before = set(_global_forward_pre_hooks)
    refs = _train_and_drop(stage=2, overlap_param_gather=True)
    installed = set(_global_forward_pre_hooks) - before
    assert installed  # the overlapped-gather watch
    gc.collect()
    assert refs[0]() is None and installed <= set(_global_forward_pre_hooks)
    opt = shardopt.ShardedAdamW(torch.nn.Linear(2, 2).parameters())
    assert not installed & set(_global_forward_pre_hooks)
    opt.close()


def test_torchs_hook_dicts_hold_no_hook_of_a_freed_optimizer_once_the_next_is_built():
    """Every hook of an optimizer freed without close() (the gradient hooks on the parameters, the
    global forward pre-hooks and forward hooks, the state-dict hooks of the overlapped gathers) is
    gone from torch's own hook dicts once the next optimizer over the same model is built; a
    collection removes none."""
    from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

    def hooks(model):  # the ids of every hook in the torch dicts that shardopt registers in
        ids = set(_global_forward_pre_hooks) | set(_global_forward_hooks)
        for m in model.modules():
            ids |= set(m._forward_pre_hooks) | set(m._forward_hooks) | set(m._state_dict_pre_hooks)
            ids |= set(m._load_state_dict_pre_hooks)
        for p in model.parameters():
            ids |= set(p._post_accumulate_grad_hooks or {})
        return ids

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    before = hooks(model)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=2, overlap_param_gather=True)
    for _ in range(2):
        opt.backward(model(torch.randn(4, 8)).square().mean())
        opt.step()
        opt.zero_grad()
    installed = hooks(model) - before
    params = len(list(model.parameters()))
    owning = sum(1 for m in model.modules() if list(m.parameters(recurse=False)))
    # gradient hooks; state-dict and load pre-hooks; the global forward pre-hook and forward hook
    assert len(installed) >= params + 2 * owning + 2
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None and installed <= hooks(model)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3)
    assert not installed & hooks(model)
    opt.close()
