"""Tier 3: the example launched as two "nodes" of two processes each, against one node of four.

The two-node launch also runs with hybrid sharding (``--shard-size 2``: each node a shard group,
replicated across the nodes), which must give the single-node flat run's losses.

Both nodes run ``torchrun --nnodes=2`` with the c10d rendezvous: hybrid-sharded on loopback, and
flat in two network namespaces joined by a virtual Ethernet pair, each with its own address, so
that nothing can pass through a shared loopback (on loopback too where the machine cannot create
namespaces). Catches a
launch that only works on one node (local ranks taken for global ranks, a store or a gloo device
bound to localhost) and a loss curve that depends on how processes are spread over nodes: the
printed losses must equal those of ``torchrun --standalone --nproc_per_node=4``.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import uuid

import pytest

pytestmark = pytest.mark.launch  # real torchrun launches (see tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")
ARGS = ["--steps", "6", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
        "--batch-size", "4", "--log-every", "1", "--warmup", "2"]
TIMEOUT = 150  # seconds for one launch, rendezvous and teardown included
ENV = dict(os.environ, OMP_NUM_THREADS="1", SHARDOPT_KERNEL="reference")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*launch: str, prefix: tuple[str, ...] = (), env: dict | None = None,
              args: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", *launch, EXAMPLE, *ARGS, *args]
    # A session of its own, so that a hung launch can be killed with all its workers.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=env or ENV, start_new_session=True)


def _collect(procs: list[subprocess.Popen]) -> tuple[str, str | None]:
    """Wait for a launch's processes: (their stdout, None), or (stdout, a failure report). On a
    timeout the whole launch is killed."""
    outs, failed = [], False
    for p in procs:
        try:
            out, err = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            out, err = p.communicate()
            err += f"\n[killed after {TIMEOUT}s]"
        failed |= p.returncode != 0
        outs.append((p.returncode, out, err))
    text = "".join(out for _, out, _ in outs)
    if not failed:
        return text, None
    return text, "\n".join(f"--- process {i} exited {rc}\n{out[-2000:]}\n{err[-4000:]}"
                           for i, (rc, out, err) in enumerate(outs))


def _curve(out: str) -> dict:
    """Losses by step and the final validation loss, as printed by rank 0."""
    steps = {int(s): float(v) for s, v in re.findall(r"^step +(\d+) \| loss ([0-9.]+)", out, flags=re.M)}
    ranks = re.findall(r"\| (\d+) ranks \(gloo\)", out)
    val = re.findall(r"val loss ([0-9.]+)", out)
    assert len(steps) == 6 and ranks == ["4"] and len(val) == 1, out
    return {"steps": steps, "val": float(val[0])}


def _assert_same_curve(a: dict, b: dict) -> None:
    assert sorted(a["steps"]) == sorted(b["steps"])
    for step, loss in a["steps"].items():
        assert abs(loss - b["steps"][step]) <= 1e-4, (step, a, b)
    assert abs(a["val"] - b["val"]) <= 1e-4, (a, b)


def _two_nodes(endpoint: str, *, prefixes=((), ()), addrs=(None, None), envs=(None, None),
               args: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    run_id = f"shardopt-{uuid.uuid4().hex[:8]}"
    procs = []
    for node in (0, 1):
        launch = ["--nnodes=2", f"--node_rank={node}", "--nproc_per_node=2", "--rdzv_backend=c10d",
                  f"--rdzv_endpoint={endpoint}", f"--rdzv_id={run_id}",
                  # node 0 hosts the rendezvous store; fail fast rather than wait 15 minutes for a peer
                  f"--rdzv_conf=is_host={int(node == 0)},join_timeout=60"]
        if addrs[node]:
            launch.append(f"--local-addr={addrs[node]}")
        procs.append(_torchrun(*launch, prefix=prefixes[node], env=envs[node], args=args))
    return procs


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _make_namespaces(tag: str, made: list[str]) -> tuple[tuple[str, str], tuple[str, str]] | str:
    """Two network namespaces joined by a veth pair, 10.77.0.1 and 10.77.0.2: (names, interfaces),
    or why they cannot be made here. Names made are appended to ``made`` for cleanup."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    ns, veth, addr = (f"{tag}n0", f"{tag}n1"), (f"{tag}v0", f"{tag}v1"), NS_ADDRS
    for n in ns:
        r = _ip("netns", "add", n)
        if r.returncode != 0:
            return f"`ip netns add` failed ({r.stderr.strip()}); it needs root or CAP_SYS_ADMIN"
        made.append(n)
    setup = [("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])]
    for n, v, a in zip(ns, veth, addr):
        setup += [("link", "set", v, "netns", n), ("-n", n, "addr", "add", f"{a}/24", "dev", v),
                  ("-n", n, "link", "set", v, "up"), ("-n", n, "link", "set", "lo", "up")]
    for cmd in setup:
        r = _ip(*cmd)
        if r.returncode != 0:
            return f"`ip {' '.join(cmd)}` failed ({r.stderr.strip()})"
    return ns, veth


NS_ADDRS = ("10.77.0.1", "10.77.0.2")


@pytest.fixture(scope="module")
def launches() -> dict:
    """Run the launches at once (they mostly wait on each other's startup and teardown): one node
    of 4, two nodes hybrid-sharded on loopback, and two flat nodes in network namespaces, or on
    loopback where namespaces cannot be made (a flat two-node run over loopback adds nothing
    where the namespaces' run, over a real interface, passed: it is not run then). Values are
    (stdout, failure report or None), or for namespaces a string saying why not."""
    made: list[str] = []
    try:
        running = {"one node": [_torchrun("--standalone", "--nproc_per_node=4")],
                   # hybrid sharding: each node one shard group, the replicate dimension across the nodes
                   "hybrid": _two_nodes(f"127.0.0.1:{_free_port()}", args=("--shard-size", "2"))}
        made_ns = _make_namespaces(f"so{os.getpid() % 100000}", made)
        if isinstance(made_ns, tuple):
            ns, veth = made_ns
            # gloo must use the namespace's own interface, not whatever the hostname resolves to.
            running["namespaces"] = _two_nodes(
                f"{NS_ADDRS[0]}:29500", prefixes=tuple(("ip", "netns", "exec", n) for n in ns), addrs=NS_ADDRS,
                envs=tuple(dict(ENV, GLOO_SOCKET_IFNAME=v) for v in veth))
        else:
            running["loopback"] = _two_nodes(f"127.0.0.1:{_free_port()}")
        results = {name: _collect(procs) for name, procs in running.items()}
    finally:
        for n in made:  # deleting a namespace also deletes its end of the veth pair
            _ip("netns", "del", n)
    if not isinstance(made_ns, tuple):
        results["namespaces"] = made_ns
    return results


def _curve_of(launches: dict, name: str) -> dict:
    out, failure = launches[name]
    if failure is not None:
        pytest.fail(f"{name} launch failed:\n{failure}")
    return _curve(out)


def test_two_nodes_on_loopback_match_one_node(launches):
    """Flat over loopback where namespaces cannot be made; else the hybrid run is the loopback one."""
    _assert_same_curve(_curve_of(launches, "loopback" if "loopback" in launches else "hybrid"),
                       _curve_of(launches, "one node"))


def test_two_nodes_hybrid_sharded_match_one_node_flat(launches):
    out, _ = launches["hybrid"]
    assert "2 replicas x 2" in out, out[-2000:]
    _assert_same_curve(_curve_of(launches, "hybrid"), _curve_of(launches, "one node"))


def test_two_nodes_in_network_namespaces_match_one_node(launches):
    if isinstance(launches["namespaces"], str):
        pytest.skip(f"network namespaces unavailable: {launches['namespaces']}")
    _assert_same_curve(_curve_of(launches, "namespaces"), _curve_of(launches, "one node"))
