"""Tier 3, on a machine with two or more CUDA GPUs: the production path, NCCL between real GPUs.

Each test launches ``torchrun --nproc_per_node=<GPUs>`` on this file, one rank per GPU, and runs
one case against an independent reference computed in the same processes: ``torch.optim.AdamW``
on a copy of the model whose gradients are averaged with ``dist.all_reduce`` (what DDP computes,
``usage_reference.ddp_average``).

- parity: stage 1 and 2, fp32 weights, every step within fp32 rounding of the reference;
- hybrid: ``device_mesh=(replicas, shards)`` over 4 GPUs, the same reference;
- offload: ``offload="cpu"`` against the same optimizer without offload, bit for bit;
- collectives: one profiled stage-2 step makes one ``reduce_scatter_tensor`` and one
  ``all_gather_into_tensor`` per bucket and no other bucket collective (comm._bucket_paths [Note:
  the bucket paths]), beside shardopt's own messages on its control group;
- waits: with ``timeout=`` set, no data wait (a bucket's reduction, a weight gather) passes a
  timeout to NCCL, which would block the CPU thread until the collective finished, while every
  control message keeps its deadline; on gloo, whose waits block the host anyway, the data waits
  keep it (comm._pending [Note: deadlines of data waits]). A wrapper around ``Work.wait`` counts
  them.

Skipped where fewer GPUs than a case needs are visible, as torch's own ``skip_if_lt_x_gpu``. So that
the cases stay runnable where no GPU is (CI), the same ranks also run every case on gloo and the
CPU (``test_the_cases_run_on_gloo``) on NCCL's bucket path (``SHARDOPT_COLLECTIVES=native``): the
same code, only the backend and the device differ.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from launch import run_launcher

pytestmark = pytest.mark.launch

HERE = os.path.dirname(os.path.abspath(__file__))
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def skip_if_lt_x_gpu(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(n > GPUS, reason=f"needs {n} CUDA GPUs, this machine has {GPUS}")


def _launch(case: str, nproc: int, backend: str = "nccl") -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__, case,
           backend]
    env = dict(os.environ, SHARDOPT_COLLECTIVES="native")  # NCCL's default; gloo takes it too here
    run = run_launcher(cmd, timeout=600, env=env)  # run again where gloo aborted it at exit
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    return run.stdout


@skip_if_lt_x_gpu(2)
def test_nccl_parity_with_averaged_adamw_at_both_stages():
    out = _launch("parity", 2)
    assert out.count("parity ok") == 2 * 2, out[-2000:]  # two stages on two ranks


@skip_if_lt_x_gpu(4)
def test_nccl_hybrid_mesh_parity():
    out = _launch("hybrid", 4)
    assert out.count("hybrid ok") == 4, out[-2000:]


@skip_if_lt_x_gpu(2)
def test_nccl_offload_is_bit_for_bit_the_same_training():
    out = _launch("offload", 2)
    assert out.count("offload ok") == 2, out[-2000:]


@skip_if_lt_x_gpu(2)
def test_nccl_makes_one_reduce_scatter_and_one_all_gather_per_bucket():
    out = _launch("collectives", 2)
    assert out.count("collectives ok") == 2, out[-2000:]


@skip_if_lt_x_gpu(2)
def test_nccl_data_waits_pass_no_timeout_and_control_messages_keep_theirs():
    out = _launch("waits", 2)
    assert out.count("waits ok") == 2, out[-2000:]


def test_the_cases_run_on_gloo():
    """The cases above on gloo and the CPU, 4 ranks: the ranks' code stays runnable without GPUs."""
    out = _launch("all", 4, "gloo")
    assert out.count("parity ok") == 2 * 4 and out.count("hybrid ok") == 4 and out.count("offload ok") == 4, out[-2000:]
    assert out.count("collectives ok") == 4 and out.count("waits ok") == 4, out[-2000:]


# -- the ranks ---------------------------------------------------------------------------------
def _worker(case: str, backend: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import shardopt
    from models import batch, make_model
    from usage_reference import ddp_average

    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    hp = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}

    def train(model, opt, steps):
        for step in steps:
            opt.zero_grad()
            loss = model(batch(rank, step).to(device))
            if isinstance(opt, torch.optim.AdamW):
                loss.backward()
                ddp_average(model)  # what DDP computes
            else:
                opt.backward(loss)
            opt.step()

    def diff(a, b) -> float:
        return max((p.detach().float() - q.detach().float()).abs().max().item()
                   for p, q in zip(a.parameters(), b.parameters()))

    def build(**kw):
        model = make_model(seed=7).to(device)
        return model, shardopt.ShardedAdamW(model.parameters(), **hp, bucket_cap_mb=1e-4, **kw)

    ref = make_model(seed=7).to(device)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hp)
    train(ref, ref_opt, range(5))
    if case in ("parity", "all"):
        for stage in (1, 2):
            model, opt = build(stage=stage)
            train(model, opt, range(5))
            worst = diff(model, ref)
            assert worst < 1e-5, (stage, worst)
            print(f"rank {rank}: stage {stage} parity ok ({worst:.2e})", flush=True)
    if case in ("hybrid", "all"):
        mesh = init_device_mesh(device, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        model, opt = build(stage=2, device_mesh=mesh)
        train(model, opt, range(5))
        worst = diff(model, ref)
        assert worst < 1e-5, worst
        print(f"rank {rank}: hybrid ok ({worst:.2e})", flush=True)
    if case in ("offload", "all"):
        (a, opt_a), (b, opt_b) = build(stage=2), build(stage=2, offload="cpu")
        train(a, opt_a, range(5))
        train(b, opt_b, range(5))
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        print(f"rank {rank}: offload ok", flush=True)
    if case in ("collectives", "all"):
        from collections import Counter

        from torch.profiler import ProfilerActivity, profile

        model, opt = build(stage=2)
        train(model, opt, range(2))
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            train(model, opt, range(2, 3))
        # shardopt's own messages are all-to-alls of a (ranks, numbers) table on its control group
        # (comm._control [Note: a message is an exchange]); a bucket's tensors are flat
        counts = Counter(e.name for e in prof.events() if e.name.startswith("c10d::") and not (
            e.name == "c10d::alltoall_base_" and e.input_shapes and len(e.input_shapes[0]) == 2))
        buckets = len(opt.inspect().buffers[0].buckets)
        assert counts["c10d::_reduce_scatter_base_"] == counts["c10d::_allgather_base_"] == buckets > 1, counts
        assert not {"c10d::alltoall_base_", "c10d::broadcast_", "c10d::reduce_scatter_"} & set(counts), counts
        print(f"rank {rank}: collectives ok ({buckets} buckets)", flush=True)
    if case in ("waits", "all"):
        seen: list[tuple[bool, bool]] = []  # (a control message's wait, a timeout passed), per Work.wait
        wait = dist.Work.wait

        def counted(work, *args, **kwargs):
            waiter = sys._getframe(1).f_locals.get("self")  # the handle waiting (comm._pending.Pending)
            seen.append((bool(getattr(waiter, "control", False)), bool(args) or "timeout" in kwargs))
            return wait(work, *args, **kwargs)

        def count(on_device: bool) -> tuple[list[bool], list[bool]]:
            seen.clear()
            dist.Work.wait = counted
            try:
                model, opt = build(stage=2, timeout=60)
                if on_device and backend == "gloo":  # the rule for a device's stream, with gloo's works
                    opt._comm.host_waits = False
                    seen.clear()  # construction's own waits (rank 0's weights) ran under gloo's rule
                train(model, opt, range(2))
                opt.clip_grad_norm_(1.0)
            finally:
                dist.Work.wait = wait
            return [timed for control, timed in seen if not control], [timed for control, timed in seen if control]

        data, control = count(backend == "nccl")
        assert data and control and all(control), seen
        assert not any(data) if backend == "nccl" else all(data), (backend, seen)
        if backend == "gloo":  # no data wait passes a timeout where they are a device stream's
            data, control = count(True)
            assert data and control and all(control) and not any(data), seen
        print(f"rank {rank}: waits ok ({len(data)} data waits, {len(control)} control messages)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__" and sys.argv[1:2] in (["parity"], ["hybrid"], ["offload"], ["collectives"], ["waits"], ["all"]):
    sys.path.insert(0, HERE)
    _worker(sys.argv[1], sys.argv[2])
