"""Launch a worker script under a real ``torchrun`` and collect what each rank wrote.

Workers write one JSON file per rank into ``$SHARDOPT_TEST_OUT`` (``rank{r}.json``) and exit; the
launch has a hard timeout so a hang fails the test instead of stalling the suite.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# gloo sometimes aborts a process at interpreter exit after it finished its work (seen with plain
# DDP and no shardopt in the process too); tests/test_exit.py checks that shardopt leaves nothing
# in flight, and a launch that ends this way is run once more.
GLOO_EXIT_RACE = "terminate called without an active exception"
RETRIED: list[str] = []  # launches run again after that abort; tests/conftest.py prints them in the summary


def note_retry(what: str) -> None:
    """Record a launch that is run once more because gloo aborted it at exit."""
    RETRIED.append(what)


EXIT_RACE_RUNS = 5  # a launch gloo aborted at exit is run again, this many runs in all (about 1 launch in 10 of the
                   # suite aborts so; three in a row were seen once, in a clean checkout's first run)


def run_launcher(cmd: list[str], *, timeout: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``subprocess.run`` of a launcher command, run again (and counted) while gloo aborted it at exit,
    ``EXIT_RACE_RUNS`` runs at most."""
    for _ in range(EXIT_RACE_RUNS):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        if proc.returncode == 0 or GLOO_EXIT_RACE not in proc.stderr:
            break
        note_retry(" ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd[3:6]))
    return proc


def torchrun(script: str, *args: str, nproc: int = 2, out_dir: str, timeout: int = 300,
             env: dict[str, str] | None = None) -> list[dict]:
    """Run ``script`` (a path relative to the repository root) on ``nproc`` local ranks; return each
    rank's JSON result, rank order. Fails with the tail of both streams if any rank fails."""
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, script), *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", SHARDOPT_TEST_OUT=out_dir, TOKENIZERS_PARALLELISM="false",
                    HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1", **(env or {}))
    try:
        proc = run_launcher(cmd, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{script} {' '.join(args)} timed out after {timeout} s:\n"
                             f"{(e.stdout or b'')[-3000:]!r}\n{(e.stderr or b'')[-5000:]!r}") from None
    assert proc.returncode == 0, f"{script} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = []
    for r in range(nproc):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results


def write_result(result: dict) -> None:
    """Worker side: write this rank's result where ``torchrun`` above collects it."""
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(os.environ["SHARDOPT_TEST_OUT"], f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
