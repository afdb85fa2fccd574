"""Tier 3: a script that ends right after ``step()`` with overlapped gathers still in flight exits
cleanly under a real ``torchrun``.

Catches collectives left running at interpreter shutdown, which used to end half the runs with
``terminate called without an active exception`` (SIGABRT) as torch tore the process group down.
Each rank records, from an exit handler that runs after shardopt's, whether every weight gather
of the last step was waited for: that part cannot flake. gloo itself aborts a clean exit now and
then (seen with plain DDP too); such a run, with every gather waited for, is run once more.
This file is also the worker: ``python tests/test_exit.py`` under torchrun.
"""
from __future__ import annotations

import pytest
import json
import os
import sys

from launch import note_retry, torchrun

pytestmark = pytest.mark.launch  # real torchrun launches (see tests/conftest.py)

GLOO_EXIT_RACE = "terminate called without an active exception"


def _one_run(out: str) -> list[dict]:
    try:
        return torchrun("tests/test_exit.py", nproc=2, out_dir=out, timeout=120)
    except AssertionError as e:
        if GLOO_EXIT_RACE not in str(e):
            raise
        for r in range(2):  # the abort came after the exit handlers: their records are there
            with open(os.path.join(out, f"rank{r}.json")) as f:
                assert json.load(f)["gathers_waited"], f"rank {r} exited with gathers in flight:\n{e}"
        note_retry("tests/test_exit.py")
        return torchrun("tests/test_exit.py", nproc=2, out_dir=out + "-again", timeout=120)


def test_a_script_ending_right_after_an_overlapped_step_exits_cleanly(tmp_path):
    for run in range(2):
        results = _one_run(str(tmp_path / str(run)))
        assert [r["gathers_waited"] for r in results] == [True, True], results


def _worker() -> None:
    import atexit

    import torch.distributed as dist

    import shardopt
    from launch import write_result
    from models import batch, make_model

    dist.init_process_group("gloo")
    handles: list = []  # the step's gather handles, not the optimizer: it goes when this function returns
    atexit.register(lambda: write_result({"gathers_waited": bool(handles) and all(h.done for h in handles)}))
    model = make_model(seed=1)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, overlap_param_gather=True, bucket_cap_mb=1e-3)
    opt.backward(model(batch(dist.get_rank(), 0)))
    opt.step()
    handles.extend(opt.inspect().gather_handles)
    # ends here: the gathers of that step are still in flight, the process group never destroyed


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _worker()
