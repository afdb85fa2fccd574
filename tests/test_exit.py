"""Tier 3: a script that ends right after ``step()`` with overlapped gathers still in flight exits
cleanly under a real ``torchrun``.

Catches collectives left running at interpreter shutdown, which used to end 2 runs in 3 with
``terminate called without an active exception`` (SIGABRT) as torch tore the process group down.
This file is also the worker: ``python tests/test_exit.py`` under torchrun.
"""
from __future__ import annotations

import os
import sys

from launch import torchrun


def test_a_script_ending_right_after_an_overlapped_step_exits_cleanly(tmp_path):
    for run in range(4):  # it failed in half the runs
        out = tmp_path / str(run)
        results = torchrun("tests/test_exit.py", nproc=2, out_dir=str(out), timeout=120)
        assert [r["stepped"] for r in results] == [1, 1], results


def _worker() -> None:
    import torch.distributed as dist

    import shardopt
    from launch import write_result
    from models import batch, make_model

    dist.init_process_group("gloo")
    model = make_model(seed=1)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, overlap_param_gather=True, bucket_cap_mb=1e-3)
    opt.backward(model(batch(dist.get_rank(), 0)))
    opt.step()
    write_result({"stepped": 1})
    # ends here: the gathers of that step are still in flight, the process group never destroyed


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _worker()
