"""Tier 2: uneven inputs, ``torch.distributed.algorithms.Join`` with ShardedAdamW and ShardedMuon.

Ranks with 3, 5 and 4 batches (2 and 3 gloo ranks) train inside ``Join([opt])``, and beside another
joinable (a counter that all-reduces once per step, first in the list). The reference is computed
the same way, in one process: at each step the gradient is the sum of the gradients of the ranks
that still have a batch, divided by the whole world size (DDP's default), and a parameter none of
them has a gradient for keeps ``grad=None``; torch.optim.AdamW (or Muon) steps on it, clipped
where the run clips. Stages 1 and 2, offload, 16-bit moments.

Catches: a hang or an abort when one rank runs out of batches, a joined rank whose shard of the
state is not updated as the others' average says (a stale gradient, a missing clip coefficient or
learning rate), an inf/NaN or norm in the joined rank's shard left out of the skip or the clip,
and a checkpoint call inside Join that would hang instead of raising.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

import shardopt
from models import batch, make_model
from usage_reference import HP, param_diff

COUNTS = (3, 5, 4)  # batches of rank 0, 1, 2


class Counter(Joinable):
    """A joinable beside the optimizer (torch's own tutorial shape): one all-reduce per step."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0.0

    def __call__(self) -> None:
        Join.notify_join_context(self)
        t = torch.ones(1)
        dist.all_reduce(t)
        self.total += t.item()

    def join_hook(self, **kwargs) -> JoinHook:
        counter = self

        class Hook(JoinHook):
            def main_hook(self) -> None:
                t = torch.zeros(1)
                dist.all_reduce(t)
                counter.total += t.item()

        return Hook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self):  # noqa: ANN201
        return dist.group.WORLD


def _reference(world: int, clip: float | None, muon: bool = False) -> nn.Module:
    """One process: the average over the ranks that still have a batch, divided by ``world``."""
    ref = make_model(seed=21)
    if muon:
        matrices = [p for p in ref.parameters() if p.requires_grad and p.dim() == 2]
        rest = [p for p in ref.parameters() if p.requires_grad and p.dim() != 2]
        opts = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, **HP)]
    else:
        opts = [torch.optim.AdamW(ref.parameters(), **HP)]
    counts = COUNTS[:world]
    params = list(ref.parameters())
    for i in range(max(counts)):
        total: list[torch.Tensor | None] = [None] * len(params)
        for r in range(world):  # summed in rank order, as shardopt's reduction sums
            if i < counts[r]:
                ref.zero_grad()
                ref(batch(r, i)).backward()
                for k, p in enumerate(params):
                    if p.grad is not None:
                        total[k] = p.grad.clone() if total[k] is None else total[k] + p.grad
        for p, g in zip(params, total):
            p.grad = None if g is None else g / world
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], clip)
        for o in opts:
            o.step()
    return ref


def join_case(stage: int, clip: float | None, options: dict, beside: bool, muon: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=21)
    if muon:
        groups = [{"params": [p for p in model.parameters() if p.dim() == 2], "lr": 0.02},
                  {"params": [p for p in model.parameters() if p.dim() != 2], "use_muon": False, **HP}]
        opt = shardopt.ShardedMuon(groups, stage=stage, **options)
    else:
        opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=stage, **options)
    counter = Counter()
    with Join([counter, opt] if beside else [opt]):
        for i in range(COUNTS[rank]):
            if beside:
                counter()
            opt.zero_grad()
            opt.backward(model(batch(rank, i)))
            if clip is not None:
                opt.clip_grad_norm_(clip)
            opt.step()
    ref = _reference(world, clip, muon)
    return {"diff": param_diff(model, ref), "steps": opt.step_count, "counted": counter.total,
            "weights": [float(p.detach().double().sum()) for p in model.parameters()]}


def _check(results: list[dict], world: int, tolerance: float, beside: bool) -> None:
    for out in results:
        assert out["steps"] == max(COUNTS[:world]), out  # every rank took every step: the joined ones too
        assert out["diff"] <= tolerance, out
        if beside:
            assert out["counted"] == sum(COUNTS[:world]), out  # the other joinable shadowed as well
    assert all(out["weights"] == results[0]["weights"] for out in results), "replicas differ"


def test_uneven_inputs_inside_join_train_as_the_average_over_the_ranks_that_have_batches(pools):
    for world in (2, 3):
        pool = pools(world)
        for stage in (1, 2):
            for clip in (None, 0.5):
                results = pool.run(join_case, stage, clip, {}, False, False)
                _check(results, world, 0.0 if clip is None else 2e-7, False)


def test_join_beside_another_joinable_with_offload_and_16_bit_moments(pools):
    for world in (2, 3):
        pool = pools(world)
        results = pool.run(join_case, 2, 0.5, {"offload": "cpu"}, True, False)
        _check(results, world, 2e-7, True)
    results = pools(3).run(join_case, 2, None, {"moments": "bf16"}, False, False)
    for out in results:  # bf16 moments: the same path, within their rounding
        assert out["steps"] == 5 and out["diff"] < 1e-2, out


def test_sharded_muon_joins_as_torch_muon_over_the_average(pools):
    results = pools(3).run(join_case, 2, None, {}, False, True)
    _check(results, 3, 0.0, False)


def nonfinite_case() -> dict:
    """A NaN reaches the shard of a rank that already joined: every rank skips that step."""
    rank = dist.get_rank()
    model = make_model(seed=21)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=2, max_consecutive_skips=None)
    with Join([opt]):
        for i in range(COUNTS[rank]):
            opt.zero_grad()
            loss = model(batch(rank, i))
            if i == 4:  # only rank 1 is left: its NaN lands in every rank's shard
                loss = loss + torch.sqrt((model.fc1.weight * 0).sum()) + (model.head.weight.sum() * float("nan"))
            opt.backward(loss)
            opt.step()
    return {"skipped": opt.skipped_steps, "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def test_an_inf_or_nan_in_a_joined_ranks_shard_skips_the_step_everywhere(pools):
    for out in pools(3).run(nonfinite_case):
        assert out["skipped"] == 1 and out["finite"], out


def checkpoint_inside_join_case(path: str) -> tuple[str, str] | None:
    rank = dist.get_rank()
    model = make_model(seed=21)
    opt = shardopt.ShardedAdamW(model.parameters(), **HP, stage=2, timeout=20)
    try:
        with Join([opt]):
            for i in range(COUNTS[rank]):
                opt.zero_grad()
                opt.backward(model(batch(rank, i)))
                opt.step()
                if i == 3:  # rank 0 has joined by now
                    shardopt.save_checkpoint(os.path.join(path, "inside"), model, opt)
    except RuntimeError as e:
        return type(e).__name__, str(e)
    return None


def test_a_checkpoint_inside_join_while_a_rank_joined_raises_on_every_rank(pools, tmp_path):
    for err in pools(2).run(checkpoint_inside_join_case, str(tmp_path)):
        assert err is not None and "save_checkpoint() ran inside torch.distributed.algorithms.Join" in err[1], err
        assert "after the Join block" in err[1], err
