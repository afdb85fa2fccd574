"""Tier 3: a nanoGPT-style train.py with the shardopt edits (examples/nanogpt_train.py), against
the same script with its original DDP + AdamW lines, under a real torchrun.

Catches an edit that changes the numbers (accumulation, clipping, the schedule written into
param_groups), a checkpoint block on rank 0 that hangs or saves one rank's shard, and a saved
optimizer state that is not what AdamW would have had: a checkpoint written by the sharded run
is resumed by both variants, at 1 and at 2 processes, and they must train alike.
"""
from __future__ import annotations

import pytest
import os
import re
import shutil
import sys

from launch import run_launcher

pytestmark = pytest.mark.launch  # real torchrun launches (see tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "nanogpt_train.py")


def launch(out_dir: str, *args: str, nproc: int = 2) -> list[tuple[float, float]]:
    """(loss, grad norm) of every iteration the run printed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", SCRIPT,
           f"--out_dir={out_dir}", "--max_iters=12", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDOPT_KERNEL="reference")
    proc = run_launcher(cmd, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [(float(a), float(b)) for a, b in re.findall(r"iter +\d+: loss ([0-9.]+), grad norm ([0-9.]+)", proc.stdout)]


def _close(a: list[tuple[float, float]], b: list[tuple[float, float]], tol: float = 1e-5) -> bool:
    return len(a) == len(b) > 0 and all(abs(x - y) <= tol for p, q in zip(a, b) for x, y in zip(p, q))


def test_nanogpt_edits_train_like_ddp_and_resume_like_adamw(tmp_path):
    sharded = launch(str(tmp_path / "sharded"))
    ddp = launch(str(tmp_path / "ddp"), "--use_shardopt=False")
    assert len(sharded) == 12 and _close(sharded, ddp), (sharded, ddp)  # grad_clip=1.0 bites: norms ~2-4
    assert min(n for _, n in ddp) > 1.0
    for nproc in (1, 2):  # the sharded run's checkpoint (iteration 10), resumed by both variants
        runs = []
        for variant in ("True", "False"):
            where = tmp_path / f"resume{nproc}{variant}"
            shutil.copytree(tmp_path / "sharded", where)
            runs.append(launch(str(where), "--init_from=resume", f"--use_shardopt={variant}", "--max_iters=14",
                               nproc=nproc))
        assert len(runs[0]) == 4 and _close(runs[0], runs[1]), (nproc, runs)
