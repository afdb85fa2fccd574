"""Tier 2: zeroing gradients the ways torch code does gives torch's result on every rank.

Param groups from generators, ``model.zero_grad()`` or no zeroing at all, zeroing after a round
or between 16-bit micro-batches, ``p.grad`` replaced after backward, weights written during an
overlapped gather, parameters re-bound late, ``opt.zero_grad(set_to_none=False)``. The reference
is a plain ``torch.optim.AdamW`` on the gradient averaged over ranks as DDP averages it
(``usage_reference``).
"""
from __future__ import annotations

import copy
import threading

import torch
import torch.distributed as dist

import shardopt
from models import batch, make_model
from usage_reference import HP, ddp_average, error_of, param_diff, ref_step


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
        ref_step(ref, ref_opt, step)
        ref_step(single_ref, ref1, step)
    return param_diff(model, ref), param_diff(single, single_ref), param_diff(model, start)


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
        ref_step(ref, ref_opt, step, zero=how == "model")
    return param_diff(model, ref)


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
        ddp_average(ref)
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
    return param_diff(model, ref)


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
    return param_diff(*runs)


def replaced_grad_case(stage: int) -> tuple[float, tuple[str, str] | None]:
    model, ref = make_model(seed=2), make_model(seed=2)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    opt.backward(model(batch(dist.get_rank(), 0)))
    ref(batch(dist.get_rank(), 0)).backward()
    ddp_average(ref)
    ref.fc1.weight.grad = ref.fc1.weight.grad + 0.01
    ref_opt.step()
    if stage == 1:
        model.fc1.weight.grad = model.fc1.weight.grad + 0.01
        opt.step()
        return param_diff(model, ref), None
    model.fc1.weight.grad = torch.full_like(model.fc1.weight, 0.01)
    return 0.0, error_of(opt.step)


def test_gradient_replaced_after_backward(pools):
    pool = pools(2)
    for worst, _ in pool.run(replaced_grad_case, 1):
        assert worst <= 2e-6
    for _, got in pool.run(replaced_grad_case, 2):
        assert got is not None and got[0] == "RuntimeError" and "was replaced by a tensor after backward" in got[1]


def write_during_overlapped_gather_case(how: str) -> tuple[tuple[str, str] | None, float]:
    """Weights written right after an overlapped step. In the thread that called ``step()``, through
    the parameters (``load_state_dict``) or through a view taken before ``step()``, the write waits
    for the gathers and is kept. From another thread (which no torch mechanism can make wait, see
    group._gather_wait [Note: other threads]) the gather may overwrite it, and the next step says so
    on every rank."""
    rank = dist.get_rank()
    model = make_model(seed=2)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, overlap_param_gather=True)
    views = [p.view(-1) for p in model.parameters()]  # plain tensors sharing the parameters' storage
    opt.backward(model(batch(rank, 0)))
    opt.step()
    written = make_model(seed=5)

    def write_views() -> None:
        with torch.no_grad():
            for v, q in zip(views, written.parameters()):
                v.copy_(q.view(-1))

    if how == "load_state_dict":
        model.load_state_dict(written.state_dict())  # the gathers may still be landing
    elif how == "view":
        write_views()
    else:
        writer = threading.Thread(target=write_views)
        writer.start()
        writer.join()
    if how != "thread":
        for g in opt.param_groups:
            g["lr"] = 0.0  # the next step keeps the written weights as they are
    got = error_of(lambda: (opt.zero_grad(), opt.backward(model(batch(rank, 1))), opt.step()))
    if how != "thread":
        opt.finish_param_gather()
        return got, param_diff(model, written)
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
    return got, param_diff(model, target)


def test_weights_written_during_an_overlapped_gather(pools):
    pool = pools(2)
    for got, worst in pool.run(write_during_overlapped_gather_case, "thread"):
        assert got is not None and "call opt.finish_param_gather() before writing" in got[1], got
        assert worst <= 2e-3  # lr=0 leaves only weight decay of 0: the loaded weights, decayed by 1 - 0
    for how in ("load_state_dict", "view"):
        for got, worst in pool.run(write_during_overlapped_gather_case, how):
            assert got is None, (how, got)  # the write waited for the gathers
            assert worst <= 2e-3, (how, worst)


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
        return error_of(lambda: model.fc1.weight.grad.norm())
    model.float()

    def finish() -> None:
        opt.backward(model(batch(rank, 1)))
        opt.step()

    return error_of(finish)


def test_between_16bit_micro_batches(pools):
    pool = pools(2)
    for stage in (1, 2):
        for got in pool.run(read_between_micro_batches_case, stage, False):
            assert got is not None and "being summed in fp32" in got[1] and "stage=2" not in got[1], got
        for got in pool.run(read_between_micro_batches_case, stage, True):
            assert got is not None and "torch.bfloat16 on cpu when the optimizer was built" in got[1], got


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
                    ddp_average(ref)
            o.step()
    return param_diff(model, ref)


def test_opt_zero_grad_keeping_zero_gradients(pools):
    pool = pools(2)
    for stage in (1, 2):
        assert max(pool.run(opt_zero_keep_case, stage)) <= 2e-6, stage


def opt_zero_at_construction_case(stage: int, set_to_none: bool) -> dict:
    """A gradient there when the optimizer is built (a backward pass before it), then
    ``opt.zero_grad(set_to_none=...)`` and ``step()``, then one more step: as torch, a zero gradient
    that still counts (weight decay, a step counted) where there was one, or none."""
    rank = dist.get_rank()
    model, ref = make_model(seed=24), make_model(seed=24)
    model(batch(rank, 0)).backward()
    ref(batch(rank, 0)).backward()
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP)
    for o in (opt, ref_opt):
        o.zero_grad(set_to_none=set_to_none)
        o.step()
    out = {"worst": param_diff(model, ref),
           "steps": [float(opt.state[p]["step"]) if "step" in opt.state[p] else None for p in model.parameters()],
           "ref steps": [float(ref_opt.state[q]["step"]) if "step" in ref_opt.state[q] else None
                         for q in ref.parameters()]}
    ref_step(ref, ref_opt, 1, zero=False)
    opt.backward(model(batch(rank, 1)))
    opt.step()
    out["then"] = param_diff(model, ref)
    return out


def test_opt_zero_grad_keeping_a_gradient_there_at_construction(pools):
    pool = pools(2)
    for stage in (1, 2):
        for set_to_none in (False, True):
            for out in pool.run(opt_zero_at_construction_case, stage, set_to_none):
                assert out["worst"] <= 2e-6 and out["then"] <= 2e-6, (stage, set_to_none, out)
                assert out["steps"] == out["ref steps"], (stage, set_to_none, out)
