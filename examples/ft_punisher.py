"""Run a fault-tolerant job on this machine and keep killing it: a torchft Lighthouse, --groups
replica groups of --ranks ranks (each ``torchrun ... examples/train_ft.py``, restarted by torchrun
when a rank dies), and a loop that sends SIGKILL to a random training rank every --kill-every
seconds, as torchft's punisher does (until the job is 60% done, so that the last group killed has
time to come back before the others finish). At the end it prints, for every rank, the fingerprint of its
weights and of its optimizer shard: the groups must agree.

    python examples/ft_punisher.py --groups 2 --ranks 2 --steps 60 --kill-every 8

Needs torchft (``pip install -e '.[ft]'``) and psutil. Exits 1 when a group fails for good or the
groups end with different states.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def training_ranks(launcher: subprocess.Popen) -> list[int]:
    """The pids of the training processes torchrun started (its children running train_ft.py)."""
    import psutil

    try:
        return [c.pid for c in psutil.Process(launcher.pid).children(recursive=True)
                if any("train_ft.py" in part for part in c.cmdline())]
    except psutil.Error:
        return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2, help="ranks per replica group")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--kill-every", type=float, default=8.0, help="seconds between kills (0: none)")
    p.add_argument("--max-kills", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-seconds", type=float, default=0.2, help="pause per step in train_ft.py")
    args, rest = p.parse_known_args()  # the rest goes to train_ft.py
    from torchft.coordination import LighthouseServer

    random.seed(args.seed)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=10_000)
    out = tempfile.mkdtemp(prefix="ft_punisher_")
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse.address(), OMP_NUM_THREADS="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # each restarted attempt gets a store of its own
    launchers = []
    for g in range(args.groups):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=10",
               os.path.join(HERE, "train_ft.py"), "--steps", str(args.steps), "--out", out,
               "--step-seconds", str(args.step_seconds), *rest]
        launchers.append(subprocess.Popen(cmd, env={**env, "REPLICA_GROUP": str(g)}, stdout=subprocess.PIPE,
                                          text=True))
    progress = [0]  # the highest step a group reported

    def echo(stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            print(line, end="", flush=True)
            parts = line.split()
            if len(parts) > 3 and parts[0] == "group" and parts[2] == "step":
                progress[0] = max(progress[0], int(parts[3]))
    for lp in launchers:
        threading.Thread(target=echo, args=(lp.stdout,), daemon=True).start()
    kills, deadline, next_kill = 0, time.monotonic() + args.timeout, time.monotonic() + args.kill_every
    try:
        while any(lp.poll() is None for lp in launchers):
            if time.monotonic() > deadline:
                print(f"ft_punisher: not done in {args.timeout:g} s", file=sys.stderr)
                return 1
            if args.kill_every and kills < args.max_kills and time.monotonic() > next_kill and \
                    progress[0] < 0.6 * args.steps:
                g = random.randrange(args.groups)
                pids = training_ranks(launchers[g])
                if pids:
                    victim = random.choice(pids)
                    print(f"ft_punisher: SIGKILL to a rank of group {g} (pid {victim})", flush=True)
                    os.kill(victim, signal.SIGKILL)
                    kills += 1
                next_kill = time.monotonic() + args.kill_every
            time.sleep(0.2)
    finally:
        for lp in launchers:
            if lp.poll() is None:
                lp.kill()
        lighthouse.shutdown()
    if any(lp.returncode != 0 for lp in launchers):
        print(f"ft_punisher: a group failed: exit codes {[lp.returncode for lp in launchers]}", file=sys.stderr)
        return 1
    records = []
    for name in sorted(os.listdir(out)):
        with open(os.path.join(out, name)) as f:
            records.append(json.load(f))
    print(f"\n{'group':>5} {'rank':>4} {'step':>5} {'weights':>16} {'optimizer shard':>16}")
    for r in records:
        print(f"{r['group']:>5} {r['rank']:>4} {r['step']:>5} {r['weights']:>16} {r['shard']:>16}")
    same = all(len({(r["weights"], r["shard"]) for r in records if r["rank"] == k}) == 1 for k in range(args.ranks))
    print(f"\n{kills} ranks killed; every group ends with the same weights and shards: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
