"""Running one benchmark configuration under torchrun with a deadline, and killing all of it.

torchrun's workers may sit in process groups of their own, so killing torchrun's group can leave
them running (and holding the output pipe open, so that reading it never ends). ``run`` kills the
whole tree of processes started from the launch instead, found through ``/proc``.
"""
from __future__ import annotations

import os
import signal
import subprocess


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process started from it (Linux; elsewhere its process group)."""
    victims = _descendants(pid) if os.path.isdir("/proc") else []
    for p in [pid, *victims]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


GLOO_EXIT_RACE = "terminate called without an active exception"  # gloo's abort at interpreter exit
EXIT_RACE_RUNS = 3  # a launch gloo aborted at exit runs again, this many runs in all (docs/troubleshooting.md)


def run(cmd: list[str], timeout: float, **kw) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of ``cmd``; exit code None when it outlived ``timeout`` seconds
    and was killed with everything it started. A launch that gloo aborted as a process exited (a
    race in torch's teardown, plain DDP's too; see docs/troubleshooting.md, "Messages from torch at
    exit") runs again, ``EXIT_RACE_RUNS`` runs at most; the last one's result is returned."""
    for _ in range(EXIT_RACE_RUNS):
        code, out, err = _run_once(cmd, timeout, **kw)
        if code is None or code == 0 or GLOO_EXIT_RACE not in err:
            break
    return code, out, err


def _run_once(cmd: list[str], timeout: float, **kw) -> tuple[int | None, str, str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        return None, out, err


def run_for_json(cmd: list[str], out: str, timeout: float, **kw) -> object | str:
    """What ``cmd`` wrote as JSON to the file ``out`` (then removed), or why there is nothing: "timed
    out after N s", or "failed: " and the last lines it printed."""
    import json

    code, stdout, stderr = run(cmd, timeout, **kw)
    if code is None:
        return f"timed out after {timeout} s"
    if code != 0 or not os.path.exists(out):
        tail = (stderr or stdout).strip().splitlines()[-3:]
        return "failed: " + " / ".join(tail)[:300]
    with open(out) as f:
        res = json.load(f)
    os.remove(out)
    return res


def emit(table: str, out: str = "") -> None:
    """Print a driver's ``table`` and, where ``out`` names a file, write it there too."""
    print(table)
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")
