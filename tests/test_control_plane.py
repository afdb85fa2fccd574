"""Tier 2 (2 and 4 ranks) and one launch of 16: shardopt's own messages in a training step, counted.

Beside its bucket collectives (the gradient reductions and the weight gathers, on the optimizer's
process group) shardopt sends small messages of its own, a few dozen numbers each, on a gloo group
of its own over the same ranks (comm._control [Note: shardopt's own control group]): its control
plane. Each is one collective, an exchange (an all-to-all of every rank's numbers, combined on
each rank, see comm._control [Note: a message is an exchange]). In a step of gradient
accumulation they are

* one round tag per backward pass that reduces (group._rounds [Note: a round that did not end]):
  which call the rank is in and whether it lost a round; none for a backward under ``no_sync()``,
  which reduces nothing;
* one message for ``clip_grad_norm_`` and one for ``step`` (step._step_agreement): which call,
  the inf/NaN count, the norm, the usage checks, the hyperparameters' digest;
* nothing in ``zero_grad``.

So a step of three micro-batches (two under ``no_sync``), clipped, sends 3 messages, and 2 without
the clip. Each costs every rank a round trip of latency, so one more per backward or per bucket
is a regression the loss curve never shows; this counts them.

How: torch's profiler records every gloo collective on the rank (``gloo:all_reduce``,
``gloo:all_to_all``, ``gloo:broadcast``, ``gloo:all_gather``) with its tensor's shape, one
``profile()`` per phase of the step (each no_sync backward, the reducing backward, the clip, the
step, zero_grad). A small message is a collective of fewer than ``SMALL`` elements (but some),
whatever its kind: the model's buckets are made far larger, and the test checks it. Which group each ran on comes from torch's
count of collectives per process group (``_get_sequence_number_for_group``): in every phase the
groups other than the optimizer's must have run exactly the small messages, and the
optimizer's group exactly the rest. The same counter on plain DDP with ``torch.optim.AdamW``
(the reference) sees DDP's bucket all-reduce and no small message; on shardopt it must see the
bucket collectives too, so a counter that sees nothing cannot pass. The expected counts are the
description above, not numbers read from shardopt; the counter shardopt keeps
(``opt.last_step_comm.control_messages``) must agree with the profiler's.

Both bucket paths (comm._bucket_paths [Note: the bucket paths]) and both stages run at 2 and 4
ranks (the ``pools`` fixture); the 16-rank case is a real ``torchrun`` on loopback, one stage and
one path, and the file is also its worker: ``python tests/test_control_plane.py`` under torchrun.
Catches a message sent per bucket or per micro-batch, a message that moved onto the optimizer's
group (where a user's own collective could pair with it), and a bucket collective that moved
onto shardopt's control group.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

import shardopt
from launch import torchrun, write_result

SMALL = 1024  # elements: a collective of fewer is a small message; every bucket here is far larger (checked)
MICRO = 3  # micro-batches a step: the first MICRO - 1 under no_sync()
WIDTH = 128  # the model's layers: WIDTH x WIDTH, so a bucket holds tens of thousands of elements

# The messages of one step, by phase: the control plane as described in the module's docstring.
NO_SYNC = [f"no_sync backward {i + 1}" for i in range(MICRO - 1)]
WITH_CLIP = {**dict.fromkeys(NO_SYNC, 0), "backward": 1, "clip_grad_norm_": 1, "step": 1, "zero_grad": 0}
WITHOUT_CLIP = {**dict.fromkeys(NO_SYNC, 0), "backward": 1, "step": 1, "zero_grad": 0}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH))


def _batches() -> torch.Tensor:
    """This rank's micro-batches, (MICRO, 8, WIDTH): different on every rank."""
    return torch.randn(MICRO, 8, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))


def _collectives_by_group() -> dict:
    """Collectives each process group of this rank has issued so far (torch's own count per group)."""
    groups = dist.distributed_c10d._world.pg_map  # torch's registry of the groups this rank is in, shardopt's too
    return {g: g._get_sequence_number_for_group() for g in groups}


def _count(phase: Callable[[], object]) -> dict[str, int]:
    """Run ``phase`` under the profiler: its small all-reduces and its other gloo collectives, and
    how many collectives the default group (the optimizer's) and the other groups issued meanwhile."""
    world = dist.group.WORLD
    before = _collectives_by_group()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        phase()
    after = _collectives_by_group()
    gloo = [(e.name, math.prod(e.input_shapes[0]) if e.input_shapes and e.input_shapes[0] else 0)
            for e in prof.events() if e.name.startswith("gloo:")]
    small = sum(1 for _, numel in gloo if 0 < numel < SMALL)  # a bucket path's empty piece is no message
    return {"small": small, "bucket": len(gloo) - small, "data_group": after[world] - before[world],
            "other_groups": sum(n - before.get(g, 0) for g, n in after.items() if g is not world)}


def _step(model: nn.Module, no_sync: Callable[[], contextlib.AbstractContextManager], clip: Callable[[], object] | None,
          step: Callable[[], object], zero_grad: Callable[[], object],
          run: Callable[[Callable[[], object]], object]) -> dict[str, object]:
    """One step of gradient accumulation, each phase run by ``run``: MICRO backwards, the first
    MICRO - 1 under ``no_sync()``, then ``clip`` (None: no clip), ``step``, ``zero_grad``."""
    x = _batches()
    out: dict[str, object] = {}

    def backward(i: int) -> None:
        with no_sync() if i < MICRO - 1 else contextlib.nullcontext():
            model(x[i]).square().mean().backward()

    for i in range(MICRO):
        out[NO_SYNC[i] if i < MICRO - 1 else "backward"] = run(lambda i=i: backward(i))
    if clip is not None:
        out["clip_grad_norm_"] = run(clip)
    out["step"] = run(step)
    out["zero_grad"] = run(zero_grad)
    return out


def _steps(model: nn.Module, no_sync: Callable[[], contextlib.AbstractContextManager], clip: Callable[[], object],
           step: Callable[[], object], zero_grad: Callable[[], object]) -> dict:
    """Two warm-up steps (the first round agrees on the buckets' launch order), then one step
    counted with the clip and one without: ``{"clip": phases, "no clip": phases}``."""
    for _ in range(2):
        _step(model, no_sync, clip, step, zero_grad, run=lambda f: f())
    return {"clip": _step(model, no_sync, clip, step, zero_grad, run=_count),
            "no clip": _step(model, no_sync, None, step, zero_grad, run=_count)}


def shardopt_case(stage: int, path: str | None) -> dict:
    """On every rank: one ShardedAdamW step counted (``_steps``) on bucket path ``path`` (None: the
    backend's default), and the sizes of its buckets."""
    previous = os.environ.get("SHARDOPT_COLLECTIVES")
    if path is not None:
        os.environ["SHARDOPT_COLLECTIVES"] = path  # read when the optimizer is built
    try:
        model = _model()
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=stage, bucket_cap_mb=0.08)
        kept: list[int] = []  # shardopt's own count of its messages, after each step

        def step() -> None:
            opt.step()
            kept.append(opt.last_step_comm.control_messages)

        try:
            counted = _steps(model, opt.no_sync, lambda: opt.clip_grad_norm_(1.0), step, opt.zero_grad)
            counted["buckets"] = [b.global_range.size for b in opt.inspect().buffers[0].layout.buckets]
            counted["kept"] = kept[-2:]  # the two counted steps: with the clip, without
        finally:
            opt.close()
        return counted
    finally:
        if previous is None:
            os.environ.pop("SHARDOPT_COLLECTIVES", None)
        else:
            os.environ["SHARDOPT_COLLECTIVES"] = previous


def ddp_case() -> dict:
    """On every rank: the same step counted on DistributedDataParallel and torch.optim.AdamW."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _steps(model, model.no_sync, lambda: nn.utils.clip_grad_norm_(model.parameters(), 1.0), opt.step,
                  opt.zero_grad)


def _check_shardopt(r: dict, where: str) -> None:
    assert min(r["buckets"]) >= 8 * SMALL and len(r["buckets"]) > 1, (where, r["buckets"])  # several, all large
    for clipped, want in (("clip", WITH_CLIP), ("no clip", WITHOUT_CLIP)):
        phases = r[clipped]
        assert list(phases) == list(want), (where, clipped, list(phases))
        got = {name: c["small"] for name, c in phases.items()}
        assert got == want, (where, clipped, got, want)
        assert sum(got.values()) == (3 if clipped == "clip" else 2)
        for name, c in phases.items():
            # the small all-reduces ran on a group of shardopt's own, and nothing else did; the rest on the
            # optimizer's group
            assert c["other_groups"] == c["small"] and c["data_group"] == c["bucket"], (where, clipped, name, c)
        # the counter sees the bucket collectives: the gradients' in the backward that reduces, the gathers in step
        assert phases["backward"]["bucket"] > 0 and phases["step"]["bucket"] > 0, (where, clipped, phases)
        assert all(phases[n]["bucket"] == 0 for n in NO_SYNC), (where, clipped, phases)  # no_sync reduces nothing
        assert phases["zero_grad"]["bucket"] == 0, (where, clipped, phases)
    assert r["kept"] == [3, 2], (where, r["kept"])  # opt.last_step_comm says what the profiler saw


@pytest.mark.parametrize("path", ["native", "rank-order"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_step_sends_one_message_per_reducing_backward_one_for_clip_and_one_for_step(pools, world_size, stage,
                                                                                       path):
    for rank, r in enumerate(pools(world_size).run(shardopt_case, stage, path)):
        _check_shardopt(r, f"rank {rank} of {world_size}, stage {stage}, {path}")


def _check_ddp(r: dict, where: str) -> None:
    for clipped in ("clip", "no clip"):
        phases = r[clipped]
        for name, c in phases.items():
            assert c["small"] == 0 and c["other_groups"] == 0 and c["data_group"] == c["bucket"], \
                (where, clipped, name, c)
            # DDP's bucket all-reduce, in the backward that reduces only
            assert (c["bucket"] > 0) == (name == "backward"), (where, clipped, name, c)


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_counter_sees_ddps_bucket_all_reduce_and_no_small_message(pools, world_size):
    for rank, r in enumerate(pools(world_size).run(ddp_case)):
        _check_ddp(r, f"DDP, rank {rank} of {world_size}")


@pytest.mark.launch
def test_sixteen_ranks_send_the_same_messages_per_step(tmp_path):
    results = torchrun("tests/test_control_plane.py", nproc=16, out_dir=str(tmp_path),
                       env={"SHARDOPT_KERNEL": "reference"})
    for rank, r in enumerate(results):
        _check_shardopt(r["shardopt"], f"rank {rank} of 16, stage 2, gloo's default path")
        _check_ddp(r["ddp"], f"DDP, rank {rank} of 16")


def _worker() -> None:
    """One rank of the 16-rank launch: shardopt's step and DDP's, counted."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        write_result({"shardopt": shardopt_case(2, None), "ddp": ddp_case()})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # under torchrun: tests/ is the script's folder, on sys.path
    _worker()
