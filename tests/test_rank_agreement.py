"""Tier 2: ranks that build the optimizer differently are told so, on every rank, within seconds.

Catches settings that differ between ranks (``stage``, ``bucket_cap_mb``, ``loss_scale``, a
group's ``lr``), which used to end in a gloo abort naming nothing or in a silently wrong result,
and same-shape parameters passed in another order on one rank, which used to leave the ranks
with different models. Each case is built on rank 1 only differently; every rank must raise a
ValueError that names the setting (or the parameters) and both values.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn

import shardopt
from models import batch, make_model
from usage_reference import ddp_average


def _timed(call, kind: type) -> tuple[str | None, float]:
    """(the message of the ``kind`` exception ``call()`` raised, or None; seconds it took)."""
    start = time.perf_counter()
    try:
        call()
        error = None
    except kind as e:
        error = str(e)
    return error, time.perf_counter() - start


def _load_into_another(path: str) -> tuple[str | None, bool]:
    """Load ``path`` into a differently initialised model: (the ValueError's message or None,
    whether the model was left unchanged)."""
    other = make_model(seed=9)
    opt = shardopt.ShardedAdamW(other.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    error, _ = _timed(lambda: shardopt.load_checkpoint(path, other, opt), ValueError)
    return error, all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def _after_one_backward(**kw) -> tuple:
    """A model and its ShardedAdamW with one backward done, on this rank's batch."""
    model = make_model(seed=2)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, **kw)
    opt.zero_grad()
    opt.backward(model(batch(dist.get_rank(), 0)))
    return model, opt


def differing_case(what: str) -> tuple:
    rank = dist.get_rank()
    model = make_model(seed=1)
    kw: dict = dict(lr=1e-3, stage=2, bucket_cap_mb=25.0, loss_scale="auto")
    params: object = model.parameters()
    if rank == 1:
        if what == "stage":
            kw["stage"] = 1
        elif what == "bucket_cap_mb":
            kw["bucket_cap_mb"] = 1e-4
        elif what == "loss_scale":
            kw["loss_scale"] = 1024.0
        elif what == "lr":
            kw["lr"] = 2e-3
    if what == "order":  # two parameters of the same shape, swapped on rank 1: told apart by name
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        a, b = [i for i, (n, p) in enumerate(named) if n in ("fc1.bias", "norm.weight")]
        if rank == 1:
            named[a], named[b] = named[b], named[a]
        params = named
    return _timed(lambda: shardopt.ShardedAdamW(params, **kw), ValueError)


def test_settings_and_parameter_order_must_agree_across_ranks(pools):
    pool = pools(2)
    expect = {"stage": ("stage", "2", "1"), "bucket_cap_mb": ("bucket_cap_mb", "25.0", "0.0001"),
              "loss_scale": ("loss_scale", "LossScaler", "StaticScaler"), "lr": ("param group 0 lr", "0.001", "0.002"),
              "order": ("fc1.bias", "norm.weight", "rank 1")}
    for what, words in expect.items():
        for rank, (error, seconds) in enumerate(pool.run(differing_case, what)):
            assert error is not None, (what, rank)
            assert all(w in error for w in words), (what, rank, error)
            assert seconds < 10, (what, seconds)


def test_equal_settings_still_build(pools):
    assert pools(2).run(_build_plain) == [1, 1]


def _build_plain() -> int:
    model = nn.Linear(3, 3)
    return len(shardopt.ShardedAdamW(model.named_parameters(), lr=1e-3).param_groups)


def clip_on_one_rank_case() -> tuple:
    """clip_grad_norm_ on rank 0 only (to log the norm there): its all-reduce meets rank 1's step."""
    _, opt = _after_one_backward(stage=2)
    return _timed(lambda: opt.clip_grad_norm_(1.0) if dist.get_rank() == 0 else opt.step(), RuntimeError)


def test_clipping_on_one_rank_only_is_refused_on_every_rank(pools):
    for rank, (error, seconds) in enumerate(pools(2).run(clip_on_one_rank_case)):
        assert error and "different optimizer calls" in error, (rank, error)
        assert ("clip_grad_norm_()" if rank == 0 else "step()") in error.split("another rank")[0], (rank, error)
        assert seconds < 10


def changed_on_one_rank_after_clip_case(what: str, stage: int) -> tuple:
    """Between clip_grad_norm_ and step, rank 0 alone zeroes the gradients or writes a weight. The
    step must not issue a collective on rank 0 only (it would meet rank 1's weight all-gather)."""
    model, opt = _after_one_backward(stage=stage)
    opt.clip_grad_norm_(1.0)
    if dist.get_rank() == 0:
        if what == "zero_grad":
            model.zero_grad()
        elif what == "opt.zero_grad":
            opt.zero_grad()
        else:
            with torch.no_grad():
                model.fc1.weight.fill_(0.5)
    error, seconds = _timed(opt.step, RuntimeError)
    return error, seconds, model.fc1.weight.detach().clone()


def test_a_change_on_one_rank_between_clipping_and_step_is_seen_by_every_rank(pools):
    pool = pools(2)
    for stage in (1, 2):
        for rank, (error, seconds, _) in enumerate(pool.run(changed_on_one_rank_after_clip_case, "zero_grad", stage)):
            assert error and "zeroed on some ranks only" in error and "rank 0" in error, (stage, rank, error)
            assert seconds < 10, (stage, seconds)
        # opt.zero_grad() on one rank makes it gather its (now absent) gradients again: another call.
        for rank, (error, seconds, _) in enumerate(pool.run(changed_on_one_rank_after_clip_case, "opt.zero_grad", stage)):
            assert error and "it alone called opt.zero_grad()" in error, (stage, rank, error)
            assert seconds < 10, (stage, seconds)
        # A weight written on one rank is followed as any write is: rank 0's value, on every rank.
        results = pool.run(changed_on_one_rank_after_clip_case, "write", stage)
        for rank, (error, seconds, weight) in enumerate(results):
            assert error is None, (stage, rank, error)
            assert torch.equal(weight, results[0][2]), (stage, rank)
            assert (weight - 0.5).abs().max() <= 2e-3, (stage, rank)  # one step of lr 1e-3 from the written value
            assert seconds < 10, (stage, seconds)


# -- checkpoints: a path per rank, an extra that cannot be read back ------------------------------
def per_rank_path_case(root: str) -> tuple:
    model = make_model(seed=3)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3)
    where = os.path.join(root, f"ckpt-{dist.get_rank()}")  # e.g. a per-rank timestamp
    error, _ = _timed(lambda: shardopt.save_checkpoint(where, model, opt), ValueError)
    dist.barrier()
    return error, sorted(os.listdir(root))


def unreadable_extra_case(root: str) -> tuple:
    import numpy as np

    model = make_model(seed=3)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3)
    refused, _ = _timed(lambda: shardopt.save_checkpoint(os.path.join(root, "bad"), model, opt,
                                                         extra={"rng": np.random.get_state()}), ValueError)
    dist.barrier()
    listed = sorted(os.listdir(root))
    import shardopt.checkpoint as ck

    check, ck._check_loadable = ck._check_loadable, lambda extra: None  # as a version without the check saved
    good = os.path.join(root, "old")
    try:
        shardopt.save_checkpoint(good, model, opt, extra={"rng": np.random.get_state()})
    finally:
        ck._check_loadable = check
    return (refused, listed, *_load_into_another(good))


def test_a_checkpoint_path_that_differs_per_rank_is_refused(pools, tmp_path):
    for rank, (error, listed) in enumerate(pools(2).run(per_rank_path_case, str(tmp_path))):
        assert error and "different paths" in error and "ckpt-0" in error and "ckpt-1" in error, (rank, error)
        assert listed == [], listed  # nothing written, no stranded .tmp- directory


def test_an_extra_that_cannot_be_read_back_is_refused_at_save_and_a_load_changes_nothing(pools, tmp_path):
    for rank, (refused, listed, load_error, unchanged) in enumerate(pools(2).run(unreadable_extra_case,
                                                                                 str(tmp_path))):
        assert refused and "weights_only" in refused, (rank, refused)
        assert listed == [], listed  # nothing written
        assert load_error and "extra.pt" in load_error and "nothing was loaded" in load_error, load_error
        assert unchanged, rank


def flipped_bytes_case(root: str) -> tuple:
    rank = dist.get_rank()
    model, opt = _after_one_backward()
    opt.step()
    path = os.path.join(root, "ckpt")
    start = time.perf_counter()
    shardopt.save_checkpoint(path, model, opt)
    save_seconds = time.perf_counter() - start
    if rank == 0:  # 4 bytes in the middle of rank 1's tensor file, same size
        name = os.path.join(path, "__1_0.distcp")
        with open(name, "r+b") as f:
            f.seek(os.path.getsize(name) // 2)
            data = f.read(4)
            f.seek(-4, os.SEEK_CUR)
            f.write(bytes(b ^ 0xFF for b in data))
    dist.barrier()
    return (*_load_into_another(path), save_seconds)


def test_a_tensor_file_with_flipped_bytes_is_refused_before_anything_is_loaded(pools, tmp_path):
    for rank, (error, unchanged, _) in enumerate(pools(2).run(flipped_bytes_case, str(tmp_path))):
        assert error and "__1_0.distcp" in error and "checksum" in error, (rank, error)
        assert unchanged, rank


# -- a backward pass that raises on one rank, two flat buffers used differently per rank ---------
class Injected(Exception):
    """Raised from inside a backward pass by the tests below."""


def _raise_in_backward(module: nn.Module, when: dict) -> None:
    """Raise Injected when the gradient reaches ``module``, if ``when["now"]``: late in backward,
    after the buckets of the layers above it were launched."""
    def hook(mod, grad_output):
        if when["now"]:
            raise Injected("injected")
    module.register_full_backward_pre_hook(hook)


_GROUPS: list = []  # kept alive: a group left with collectives in flight must not be destroyed


def _own_group():
    """A fresh process group for a case that leaves collectives in flight on an error; they fail
    after its short timeout instead of pairing with the next case's."""
    import datetime

    _GROUPS.append(dist.new_group(timeout=datetime.timedelta(seconds=20)))
    return _GROUPS[-1]


def skipped_batch_case(fail_at: int, ranks: tuple, micro: int) -> tuple:
    """Train 4 steps of ``micro`` backward passes each; at step ``fail_at`` the first backward
    raises on ``ranks`` (late, after buckets were launched) and is caught there, which skips the
    batch (micro == 1) or that micro-batch (micro == 2). (the RuntimeError, seconds to it, the
    largest difference from torch's AdamW over DDP skipping the same batches on every rank.)"""
    rank = dist.get_rank()
    model, ref = make_model(seed=5), make_model(seed=5)
    when = {"now": False}
    _raise_in_backward(model.fc1, when)
    opt = shardopt.ShardedAdamW(model.named_parameters(), lr=1e-2, stage=2, bucket_cap_mb=1e-4,
                                process_group=_own_group())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    start = time.perf_counter()
    try:
        for step in range(4):
            opt.zero_grad()
            skipped = False
            for m in range(micro):
                when["now"] = step == fail_at and m == 0 and rank in ranks
                try:
                    model(batch(rank, 10 * step + m)).backward()
                except Injected:
                    skipped = True
                    if micro == 1:
                        break
            when["now"] = False
            if skipped and micro == 1:
                continue
            opt.step()
            ref_opt.zero_grad()
            if not (step == fail_at and len(ranks) == dist.get_world_size()):
                for m in range(micro):
                    ref(batch(rank, 10 * step + m)).backward()
                ddp_average(ref, fp32=True)
                ref_opt.step()
    except RuntimeError as e:
        return str(e), time.perf_counter() - start, None
    return None, time.perf_counter() - start, _worst(model, ref)


def _worst(a: nn.Module, b: nn.Module) -> float:
    return max((p.detach().float() - q.detach().float()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


def test_a_batch_skipped_on_one_rank_after_its_backward_raised_stops_every_rank(pools):
    pool = pools(2)
    for fail_at in (0, 2):  # the learning round, and a round that launches buckets from its hooks
        for rank, (error, seconds, _) in enumerate(pool.run(skipped_batch_case, fail_at, (1,), 1)):
            assert error and "different optimizer calls" in error and "a backward pass" in error, (fail_at, rank, error)
            assert ("this rank's backward pass raised" if rank == 1 else "of 1 of 2 ranks raised") in error, error
            assert seconds < 20, seconds


def test_a_micro_batch_skipped_on_one_rank_stops_every_rank(pools):
    for rank, (error, seconds, _) in enumerate(pools(2).run(skipped_batch_case, 1, (1,), 2)):
        assert error and "fell out of step" in error, (rank, error)
        assert ("this rank's backward pass raised" if rank == 1 else "of 1 of 2 ranks raised") in error, error
        assert seconds < 20, seconds


def test_a_backward_that_raised_on_every_rank_alike_is_skipped_like_torch(pools):
    for fail_at in (0, 2):
        for error, _, worst in pools(2).run(skipped_batch_case, fail_at, (0, 1), 1):
            assert error is None, error
            assert worst < 1e-6, (fail_at, worst)


class Routed(nn.Module):
    """Four experts, two in fp32 and two in bf16 (two flat buffers); a route picks two of them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.inp = nn.Linear(8, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.experts[1].to(torch.bfloat16)
        self.experts[3].to(torch.bfloat16)

    def forward(self, x: torch.Tensor, route: list[int]) -> torch.Tensor:
        h = self.inp(x)
        for e in route:
            expert = self.experts[e]
            h = torch.tanh(expert(h.to(expert.weight.dtype)).float())
        return h.square().mean()


ROUTES = {0: [[0, 1], [1, 2], [3, 0], [0, 1]], 1: [[3, 2], [2, 3], [1, 0], [2]]}  # per rank, per step


def routed_case(stage: int) -> tuple:
    """MoE-style routing that differs per rank, over an fp32 and a bf16 buffer, one bucket per
    parameter: (this rank's weights after 4 steps, largest difference from torch's AdamW over
    DDP with fp32 master weights)."""
    rank = dist.get_rank()
    model, ref = Routed(), Routed()
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, stage=stage, bucket_cap_mb=1e-4, loss_scale=None)
    master = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(master, lr=1e-2)
    for step, route in enumerate(ROUTES[rank]):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        model(x, route).backward()
        opt.step()
        ref.zero_grad()
        ref(x, route).backward()
        ddp_average(ref, fp32=True)
        for p, m in zip(ref.parameters(), master):
            m.grad = None if p.grad is None else p.grad.float()
        ref_opt.step()
        with torch.no_grad():
            for p, m in zip(ref.parameters(), master):
                p.copy_(m)
    worst = max((p.detach().float() - q.detach().float()).abs().max().item()
                for p, q in zip(model.parameters(), ref.parameters()))
    return [p.detach().clone() for p in model.parameters()], worst


def test_two_buffers_used_differently_per_rank_train_like_ddp(pools):
    for stage in (1, 2):
        (w0, worst0), (w1, worst1) = pools(2).run(routed_case, stage)
        assert all(torch.equal(a, b) for a, b in zip(w0, w1)), stage  # the replicas stay equal
        assert max(worst0, worst1) < 4e-3, (stage, worst0, worst1)  # within one bf16 rounding


# -- last in this module: it leaves the pool's process group unusable ------------------------------
def skipped_step_case() -> tuple:
    """Rank 1 skips step(); with timeout=3 rank 0 raises a TimeoutError naming step() instead of
    waiting for the process group's 30 minutes."""
    _, opt = _after_one_backward(timeout=3.0)
    if dist.get_rank() == 1:
        time.sleep(6)
        return None, 0.0
    return _timed(opt.step, TimeoutError)


def test_a_rank_that_skips_step_times_out_with_the_call_named(pools):
    error, seconds = pools(2).run(skipped_step_case)[0]
    assert error and "step() waited 3 s" in error and "rank 0 of 2" in error, error
    assert 2.5 <= seconds < 10, seconds


def staggered_step_case() -> tuple:
    """Ranks reach step() 0, 2.5 and 9 s late with timeout=3: gloo gives each rank's part of the
    message its own 3 s, so rank 0, whose wait for rank 1 ended at 2.5 s, waits on for rank 2 past
    the deadline. Rank 2 never steps (it returns at 9 s)."""
    _, opt = _after_one_backward(timeout=3.0)
    time.sleep((0.0, 2.5, 9.0)[dist.get_rank()])
    if dist.get_rank() == 2:
        return None, 0.0
    return _timed(opt.step, TimeoutError)


def test_a_message_stretched_by_ranks_arriving_one_after_another_says_how_long_it_waited(pools):
    """The error states the time this rank actually waited, not the deadline it was given (rank 0
    waits about 5 s in all on a 3 s deadline: comm._control [Note: shardopt's own control group])."""
    import re

    results = pools(3).run(staggered_step_case)
    for rank, (error, seconds) in enumerate(results[:2]):
        assert error and f"rank {rank} of 3: step() waited" in error, (rank, error)
        said = float(re.search(r"step\(\) waited ([\d.]+) s", error).group(1))
        assert abs(said - seconds) <= 0.6, (rank, said, seconds, error)
    assert results[0][1] >= 3.5, results[0]  # rank 0's message was stretched past its deadline
