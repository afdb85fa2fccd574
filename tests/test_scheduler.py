"""Tier 1, one process: the gradient scheduler's states, driven by real backward passes.

A world of one gloo rank inside the test process (spawned ranks cost seconds; these run in
milliseconds). Catches a round that does not return to IDLE after its backward, a backward that
raised but is not found LOST (and so not finished before the next call), a broken round that does
not refuse later calls, a bucket order that is not the reverse of the first forward's uses, and
parameter states left behind after a round. The multi-rank behaviour of the same code is in
tests/test_rank_agreement.py, tests/test_usage_*.py and tests/test_peak_memory.py.
"""
from __future__ import annotations


import pytest
import torch
from torch import nn

import shardopt
from shardopt.group._intake import ParamState
from shardopt.group._rounds import RoundState

pytestmark = pytest.mark.usefixtures("one_rank_group")  # see tests/conftest.py

ONE_PARAM_MB = 1e-5  # buckets of one small parameter each


def _chain(n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(3, 3, bias=False) for _ in range(n)))


def test_a_backward_pass_is_one_round_from_idle_to_idle():
    model = _chain()
    opt = shardopt.ShardedAdamW(model.parameters(), lr=0.1, bucket_cap_mb=ONE_PARAM_MB)
    view = opt.inspect()
    seen = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(view.round_state))
    assert view.round_state is RoundState.IDLE
    opt.backward(model(torch.ones(2, 3)).sum())
    assert seen == [RoundState.OPEN]  # inside the backward pass
    assert view.round_state is RoundState.IDLE and view.total_rounds == 1
    buf = view.buffers[0]
    assert all(s is ParamState.WAITING for s in buf.param_states)  # every parameter's round state was reset
    opt.step()
    opt.close()


def test_a_backward_pass_that_raises_is_lost_then_finished_by_the_next_call():
    model = _chain()
    opt = shardopt.ShardedAdamW(model.parameters(), lr=0.1, bucket_cap_mb=ONE_PARAM_MB)

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    x = torch.ones(2, 3, requires_grad=True)
    h = model[0](x)
    h.register_hook(fail)  # raises after the later layers' gradients have opened the round
    with pytest.raises(ValueError, match="boom"):
        opt.backward(model[3](model[2](model[1](h))).sum())
    view = opt.inspect()
    assert view.round_state is RoundState.LOST
    opt.zero_grad()  # meets the lost round: issues the rest of it
    assert view.round_state is RoundState.IDLE and view.lost_round
    opt.close()


def test_a_launch_that_raised_inside_backward_is_launched_again_when_the_round_is_finished():
    model = _chain()
    opt = shardopt.ShardedAdamW(model.parameters(), lr=0.1, bucket_cap_mb=ONE_PARAM_MB)
    store = opt._buffers[0].store  # instrumented: the first launch raises, as an allocation can
    launch, calls = store.launch, []

    def flaky(bucket):  # noqa: ANN001, ANN202
        calls.append(bucket.index)
        if len(calls) == 1:
            raise MemoryError("no memory for the bucket's reduction")
        return launch(bucket)
    store.launch = flaky
    with pytest.raises(MemoryError):
        opt.backward(model(torch.ones(2, 3)).sum())
    view = opt.inspect()
    assert view.round_state is RoundState.LOST
    opt.zero_grad()  # meets the lost round: issues the rest of it, the bucket whose launch raised first
    assert view.round_state is RoundState.IDLE and view.lost_round
    assert calls[1] == calls[0] and sorted(calls[1:]) == list(range(len(view.buffers[0].layout.buckets)))
    opt.close()


def test_a_broken_round_refuses_every_later_call_with_its_reason():
    model = _chain()
    opt = shardopt.ShardedAdamW(model.parameters(), lr=0.1)
    opt._rounds.fail("the ranks fell apart here")
    assert opt.inspect().round_state is RoundState.BROKEN
    opt._rounds.fail("a later reason")  # the first one is kept
    with pytest.raises(RuntimeError, match="the ranks fell apart here"):
        opt.backward(model(torch.ones(2, 3)).sum())
    opt.close()


def test_the_bucket_order_is_the_reverse_of_the_first_forward():
    model = _chain(5)
    order_of_use = [4, 0, 3, 1, 2]  # layers applied in this order, not their registration order
    opt = shardopt.ShardedAdamW(model.parameters(), lr=0.1, bucket_cap_mb=ONE_PARAM_MB)
    x = torch.ones(2, 3)
    for i in order_of_use:
        x = model[i](x)
    opt.backward(x.sum())
    buf = opt.inspect().buffers[0]
    layout = buf.layout
    params = buf.params
    layer_of = {id(m.weight): i for i, m in enumerate(model)}
    launched = [layer_of[id(params[layout.buckets[b].params[0]])] for b in buf.bucket_order]
    assert launched == order_of_use[::-1]
    opt.close()


def test_layers_used_only_inside_reentrant_checkpoints_wait_for_the_end_of_backward():
    from torch.utils.checkpoint import checkpoint

    model = _chain(3)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=0.1, bucket_cap_mb=ONE_PARAM_MB)
    x = torch.ones(2, 3, requires_grad=True)
    y = model[2](checkpoint(model[1], checkpoint(model[1], model[0](x), use_reentrant=True), use_reentrant=True))
    opt.backward(y.sum())  # model[1] gets two gradients, from two nested passes
    buf = opt.inspect().buffers[0]
    layout = buf.layout
    params = buf.params
    i1 = next(i for i, p in enumerate(params) if p is model[1].weight)
    b1 = next(b.index for b in layout.buckets if i1 in b.params)
    assert buf.may_nest[b1] and not any(buf.may_nest[b.index] for b in layout.buckets if b.index != b1)
    assert buf.bucket_order[-1] == b1  # guessed last: it waits for the end of the outer pass anyway
    ref = _chain(3)
    yr = ref[2](ref[1](ref[1](ref[0](torch.ones(2, 3, requires_grad=True)))))
    yr.sum().backward()
    got = buf.local_grad[layout.params[i1].global_range.as_slice()]
    torch.testing.assert_close(got, ref[1].weight.grad.reshape(-1))  # both nested gradients, reduced once
    opt.close()


def test_each_bucket_is_gathered_as_soon_as_its_part_of_the_shard_is_updated():
    model, ref = _chain(4), _chain(4)
    groups = lambda m: [{"params": [m[0].weight, m[3].weight]}, {"params": [m[1].weight, m[2].weight], "lr": 0.03}]  # noqa: E731
    opt = shardopt.ShardedAdamW(groups(model), lr=0.1, bucket_cap_mb=2 * ONE_PARAM_MB)
    torch_opt = torch.optim.AdamW(groups(ref), lr=0.1)
    buf = opt.inspect().buffers[0]
    assert len(buf.layout.buckets) > 1
    events = []
    master = opt._buffers[0].master  # instrumented: records each update, then runs it
    update, gather = master.update_, opt._comm.all_gather_inplace
    master.update_ = lambda r, *a: (events.append(("update", r.start, r.end)), update(r, *a))[1]
    opt._comm.all_gather_inplace = lambda flat, pieces: (events.append(("gather", pieces[0].start, pieces[-1].end)),
                                                         gather(flat, pieces))[1]
    for _ in range(2):
        for m, o in ((model, opt), (ref, torch_opt)):
            o.zero_grad()
            m(torch.ones(2, 3)).square().sum().backward()
            o.step()
    # Updates of a bucket's elements, then its gather, bucket by bucket in the forward pass's order.
    step_events = events[len(events) // 2:]
    spans = [(b.global_range.start, b.global_range.end) for b in (buf.layout.buckets[i] for i in buf.forward_order)]
    expect, covered = [], []
    for start, end in spans:
        updates = [e for e in step_events[len(expect):] if e[0] == "update" and start <= e[1] and e[2] <= end]
        expect += updates + [("gather", start, end)]
        covered += [(s, e) for _, s, e in updates]
    assert step_events == expect
    assert sum(e - s for s, e in covered) == buf.layout.numel  # every element updated once
    assert opt.pending_param_buckets() == []  # every gather landed when step() returned
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    opt.close()


def _train_mixed(stage: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[object]]:
    """Steps that meet the usual hook and its exceptions: fresh gradients, two backward passes per
    step, no_sync micro-batches, a parameter unused in some passes, gradients zeroed through the
    model between backward and step. Returns the weights and each step's memory report."""
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5), nn.LayerNorm(5)]).to(dtype)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=0.05, stage=stage, bucket_cap_mb=2e-4)

    def loss(i: int, skip: bool = False) -> torch.Tensor:
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(i)).to(dtype)
        for k, layer in enumerate(model):
            if not (skip and k == 1):
                x = torch.tanh(layer(x))
        return x.float().square().sum()

    reports = []
    for step in range(6):
        opt.zero_grad()
        if step % 3 == 1:
            with opt.no_sync():
                loss(10 * step).backward()
        loss(10 * step + 1, skip=step % 2 == 0).backward()
        if step % 2:
            loss(10 * step + 2).backward()  # a second round before the step
        if step == 4:
            model[2].zero_grad()  # dropped after its round: the step sees no gradient for it
        opt.step()
        reports.append(opt.memory_report())
    opt.close()
    return [p.detach().clone() for p in model.parameters()], reports


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_usual_hook_takes_what_the_full_path_takes(monkeypatch, stage, dtype):
    from shardopt.group._intake import GradIntake

    usual = GradIntake.take_fresh
    taken = []

    def counted(self: GradIntake, r: object) -> bool:
        taken.append(usual(self, r))
        return taken[-1]

    monkeypatch.setattr(GradIntake, "take_fresh", counted)
    fast_weights, fast_reports = _train_mixed(stage, dtype)
    assert sum(taken) >= 10, taken  # (stage 2: not a bucket's first gradient, which allocates its staging)
    monkeypatch.setattr(GradIntake, "take_fresh", lambda self, r: False)  # every hook takes the full path
    full_weights, full_reports = _train_mixed(stage, dtype)
    for a, b in zip(fast_weights, full_weights):
        assert torch.equal(a, b)
    assert fast_reports == full_reports  # the same bytes held, peaks included


def _peaks_of_a_late_large_gradient() -> tuple[int, int]:
    """One bucket whose first gradient is small (it allocates the staging) and whose second is
    large: the peak holds the staging and the large one. (held_peak, grads_peak) after a step."""
    torch.manual_seed(0)
    small, large = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4000))
    opt = shardopt.ShardedAdamW([large, small], lr=0.1, stage=2)
    for _ in range(2):  # the second round takes the usual path, and only its peak is kept
        opt.reset_peak_memory()
        opt.zero_grad()
        ((large * 2).sum() + (small * 3).sum()).backward()  # small's gradient comes first: used last
        opt.step()
    report = opt.memory_report()
    opt.close()
    return report.held_peak, report.grads_peak


def test_a_gradient_taken_at_once_counts_in_the_peak(monkeypatch):
    from shardopt.group._intake import GradIntake

    usual = _peaks_of_a_late_large_gradient()
    monkeypatch.setattr(GradIntake, "take_fresh", lambda self, r: False)
    assert usual == _peaks_of_a_late_large_gradient()
