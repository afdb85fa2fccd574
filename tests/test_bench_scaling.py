"""Tier 3: ``benchmarks/bench_scaling.py`` launched as users launch it (torchrun, 2 CPU ranks).

Catches a scaling benchmark that does not run, hangs at exit, loses a configuration's row, or
whose table cannot be built from the CSV it writes. Speed is not asserted: benchmarks measure it.
"""
from __future__ import annotations

import pytest
import csv
import os
import subprocess
import sys

pytestmark = pytest.mark.launch  # real torchrun launches (see tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_scaling.py")


def test_two_ranks_write_one_row_per_configuration_and_the_table_reads_them(tmp_path):
    out = tmp_path / "scaling.csv"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT,
           "--size", "tiny", "--steps", "2", "--warmup", "1", "--batch-size", "2", "--block-size", "32",
           "--shard-size", "1", "--configs", "ddp,fsdp2,shardopt-flat,shardopt-hybrid,nonesuch", "--csv", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out, newline="") as f:
        rows = {r["config"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"ddp", "fsdp2", "shardopt-flat", "shardopt-hybrid", "nonesuch"}, rows
    for name in ("ddp", "fsdp2", "shardopt-flat", "shardopt-hybrid"):
        r = rows[name]
        assert r["status"] == "ok" and r["world_size"] == "2", r
        assert float(r["step_ms"]) > 0 and float(r["tokens_per_s_rank"]) > 0 and float(r["peak_mb"]) > 0, r
    # An unknown configuration fails on every rank and the launch goes on to the next one.
    assert rows["nonesuch"]["status"].startswith("failed"), rows["nonesuch"]
    flat, hybrid = rows["shardopt-flat"], rows["shardopt-hybrid"]
    assert (flat["shard_size"], hybrid["shard_size"]) == ("2", "1")
    # Flat: everything inside the shard group. Hybrid 2 x 1: nothing inside, the all-reduce across.
    assert float(flat["sent_inside_mb"]) > 0 and float(flat["sent_cross_mb"]) == 0, flat
    assert float(hybrid["sent_inside_mb"]) == 0 and float(hybrid["sent_cross_mb"]) > 0, hybrid
    table = subprocess.run([sys.executable, SCRIPT, "--plot", str(out)], capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert "| 2 | 1 | shardopt-hybrid | 1 |" in table.stdout and "1.00 (vs N=2)" in table.stdout, table.stdout
