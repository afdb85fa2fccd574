"""Launch tier: replica groups under torchft that die, come back, heal from a live group and train on.

Each replica group is a job of its own, as torchft runs them: its ranks are real processes with
their own gloo process group and TCPStore; a ``torchft.Manager`` per rank joins the Lighthouse
(torchft's ``LighthouseServer``, in this test's process on 127.0.0.1), and shardopt shards inside
the group and averages across groups through the manager (``ShardedAdamW(..., replicas=manager)``,
``torchft.optim.OptimizerWrapper``, ``shardopt.fault_tolerance.register``). A rank is killed with
SIGKILL at a chosen step and place; the test then does what torchelastic does: it ends the
group's other ranks and starts the group again, which heals from a live group and rejoins.

Each rank logs, for every step it ran, the manager's step before and after (a commit moves it by
one) and whether its group took part in the quorum. The reference is independent of shardopt
and of torchft: one process, ``torch.optim.AdamW`` over the same model, applying exactly the
steps every log says were committed, each with the average of the gradients of the batches of the
groups that took part in it (batches depend on group, step and rank only). After the last step
every rank's weights and its group's moments must equal the reference's (1e-6), and the groups'
shards must be equal bit for bit.

The file is also the worker: ``python tests/test_fault_tolerance.py`` with the environment below.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = int(os.environ.get("FT_STEPS", "12"))  # a test with many restarts runs longer (its worker reads it too)
WIDTH = 16
SHARD = 2  # ranks in a replica group
# How long the Lighthouse waits for every heartbeating group to ask for the next quorum before it
# forms one without them: longer than a step, so that two groups never train apart (each in a
# quorum of its own at the same step, which torchft would not heal: see docs/fault-tolerance.md)
JOIN_TIMEOUT_MS = 5000


def _model(muon: bool = False) -> nn.Module:
    torch.manual_seed(0)  # every group starts alike (init_sync=False, as torchft recommends for seeded models)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))


def _batch(group: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * group + 10 * step + rank)
    x = torch.randn(8, WIDTH, generator=g)
    return x, torch.randn(8, 4, generator=g)


def _loss(model: nn.Module, group: int, step: int, rank: int, overflow: bool = False) -> torch.Tensor:
    x, y = _batch(group, step, rank)
    loss = ((model(x) - y) ** 2).mean()
    return loss * float("inf") if overflow else loss


MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW = dict(lr=5e-3, betas=(0.8, 0.99), weight_decay=0.0)
OVERFLOW_GROUP = 0  # the group whose batch overflows at FT_OVERFLOW's step


def _split(model: nn.Module) -> tuple[list, list]:
    return [p for p in model.parameters() if p.ndim == 2], [p for p in model.parameters() if p.ndim != 2]


# -- the worker ------------------------------------------------------------------------------------
def _worker() -> None:
    import torch.distributed as dist
    from torchft import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    import shardopt
    import shardopt.fault_tolerance

    group, rank = int(os.environ["FT_GROUP"]), int(os.environ["RANK"])
    kill = os.environ.get("FT_KILL", "")  # "group:rank:step:where" of the first incarnation
    overflow_step = int(os.environ.get("FT_OVERFLOW", "-1"))
    muon = os.environ.get("FT_MUON") == "1"
    out = os.environ["SHARDOPT_TEST_OUT"]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model = _model()
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), load_state_dict=None, state_dict=None,
                      min_replica_size=1, replica_id=f"group{group}", rank=rank, world_size=dist.get_world_size(),
                      store_addr="127.0.0.1", store_port=int(os.environ["MASTER_PORT"]),
                      lighthouse_addr=os.environ["FT_LIGHTHOUSE"], hostname="127.0.0.1",
                      init_sync=os.environ.get("FT_INIT_SYNC") == "1",
                      timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=30),
                      connect_timeout=timedelta(seconds=10))
    if muon:
        mats, rest = _split(model)
        opt = shardopt.ShardedMuon([{"params": mats}, {"params": rest, "use_muon": False, **ADAMW}], **MUON,
                                   replicas=manager, stage=2, bucket_cap_mb=1e-3)
        sched = None
    else:
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, replicas=manager, stage=2, bucket_cap_mb=1e-3,
                                    loss_scale=None if overflow_step < 0 else "dynamic")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        opt.register_step_post_hook(lambda *a: sched.step())  # with each step the optimizer takes: each committed one
    for _ in range(int(os.environ.get("FT_REGISTER", "1"))):  # 0 and 2: the mistakes
        shardopt.fault_tolerance.register(manager, opt, scheduler=sched)
    wrapped = OptimizerWrapper(manager, opt)

    where, kill_step = None, 0
    for one in filter(None, kill.split(";")):
        kg, kr, ks, place = one.split(":")
        if (int(kg), int(kr)) == (group, rank):
            where, kill_step = place, int(ks)

    def die(place: str) -> None:
        if where == place and kill_step in (manager.current_step(), -1):
            os.kill(os.getpid(), signal.SIGKILL)

    if where == "reduction":  # inside a bucket's cross-replica reduction, before it is issued
        allreduce = manager.allreduce

        def dying_allreduce(t: torch.Tensor, *a: object, **k: object) -> object:
            die("reduction")
            return allreduce(t, *a, **k)
        manager.allreduce = dying_allreduce  # type: ignore[method-assign]
    if where == "step":
        opt.register_step_pre_hook(lambda *a: die("step"))
    if where == "heal":  # the live group's rank dies while a returning group takes its state
        send = manager._checkpoint_transport.send_checkpoint

        def dying_send(*a: object, **k: object) -> object:
            die("heal")
            return send(*a, **k)
        manager._checkpoint_transport.send_checkpoint = dying_send  # type: ignore[method-assign]

    log: list[dict] = []
    open(os.path.join(out, f"ready-g{group}-r{rank}-{os.getpid()}"), "w").close()
    pause = float(os.environ.get("FT_STEP_SECONDS", "0"))
    while manager.current_step() < STEPS:
        _hold(out)
        time.sleep(pause)
        before = manager.current_step()
        wrapped.zero_grad()
        if group == 0 and before == int(os.environ.get("FT_HALVE_LR_AT", "-1")):  # one group's own decision
            for g in opt.param_groups:
                g["lr"] *= 0.5
        loss = _loss(model, group, before, rank, overflow=before == overflow_step and group == OVERFLOW_GROUP)
        opt.backward(loss)  # scaled by the loss scale where there is one
        if group == 0 and before == int(os.environ.get("FT_HALVE_LR_AFTER_BACKWARD_AT", "-1")):
            for g in opt.param_groups:
                g["lr"] *= 0.5
        participating = manager.is_participating()
        # whether this group's batch went into this step's average, written before anything can die
        log.append({"before": before, "participating": participating, "participants": manager.num_participants(),
                    "quorum": manager._quorum_id})
        _write_log(out, group, rank, log)
        die("backward")
        wrapped.step()
        sched_lr = opt.param_groups[0]["lr"]
        log[-1].update({"after": manager.current_step(), "lr": sched_lr, "skipped": bool(opt.step_was_skipped)})
        _write_log(out, group, rank, log)
    from shardopt.checkpoint._rank_state import heal_state_dict

    torch.save({"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
                "shard": heal_state_dict(opt), "full": opt.full_state_dict(), "loss_scale": opt.loss_scale,
                "lr": opt.param_groups[0]["lr"], "skipped_steps": opt.skipped_steps, "step": opt.step_count},
               os.path.join(out, f"final-g{group}-r{rank}.pt"))
    dist.barrier()
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def _hold(out: str) -> None:
    """Wait while the driver holds every group: a group that died is being started again, and the
    live groups must not finish (or form quorums of their own) before it joins."""
    until = time.monotonic() + 120
    while os.path.exists(os.path.join(out, "hold")) and time.monotonic() < until:
        time.sleep(0.05)


def _write_log(out: str, group: int, rank: int, log: list[dict]) -> None:
    path = os.path.join(out, f"log-g{group}-r{rank}-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(log, f)
    os.replace(path + ".tmp", path)


# -- the driver ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Group:
    """One replica group's ranks, started (again) as torchelastic would: a fresh store each time."""

    def __init__(self, index: int, env: dict[str, str], ranks: int = SHARD) -> None:
        self.index, self.env, self.procs, self.starts, self.ranks = index, env, [], 0, ranks

    def start(self, kill: str = "") -> None:
        port = _free_port()
        self.starts += 1
        self.started = time.time()
        self.procs = [subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)], cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.env["SHARDOPT_TEST_OUT"],
                                                              f"err-g{self.index}-r{r}-{self.starts}.txt"), "w"),
            env={**self.env, "FT_GROUP": str(self.index), "RANK": str(r), "LOCAL_RANK": str(r),
                 "WORLD_SIZE": str(self.ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "FT_KILL": kill if self.starts == 1 else ""})
            for r in range(self.ranks)]

    def poll(self) -> str:
        """'running', 'done' (every rank exited 0) or 'failed' (a rank died: the rest are ended)."""
        codes = [p.poll() for p in self.procs]
        if any(c not in (None, 0) for c in codes):
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            return "failed"
        return "done" if all(c == 0 for c in codes) else "running"

    def ready(self) -> bool:
        """Every rank of this incarnation built its manager and optimizer."""
        out = self.env["SHARDOPT_TEST_OUT"]
        pids = {str(p.pid) for p in self.procs}
        return sum(1 for n in os.listdir(out) if n.startswith(f"ready-g{self.index}-") and
                   n.rsplit("-", 1)[1] in pids) == self.ranks

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _run(tmp: str, groups: int, *, kills: list[str], restarts_max: int = 3, timeout: float = 240,
         extra_env: dict[str, str] | None = None, until_error: str = "", ranks: list[int] | None = None) -> dict:
    assert int((extra_env or {}).get("FT_STEPS", STEPS)) == STEPS, "set FT_STEPS with monkeypatch for both sides"
    """Run ``groups`` replica groups to ``STEPS`` committed steps; ``kills``: "group:rank:step:where"
    for the first incarnations. ``until_error``: stop once some rank's output says it, and return
    which (group, rank) incarnations said it (under "said"). Returns the starts of each group."""
    pytest.importorskip("torchft", reason="torchft is an optional extra (pip install -e '.[ft]'); make test has it")
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS)
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDOPT_TEST_OUT=tmp, FT_LIGHTHOUSE=lighthouse.address(),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **(extra_env or {}))
    running = [_Group(g, env, (ranks or [SHARD] * groups)[g]) for g in range(groups)]
    kill_of: dict[int, str] = {}
    for k in kills:
        kill_of[int(k.split(":")[0])] = ";".join(filter(None, [kill_of.get(int(k.split(":")[0]), ""), k]))
    hold = os.path.join(tmp, "hold")
    open(hold, "w").close()  # the first quorum has every group in it
    try:
        for g in running:
            g.start(kill_of.get(g.index, ""))
        deadline = time.monotonic() + timeout
        while True:
            if until_error:
                said = _said(tmp, until_error)
                if said:
                    time.sleep(2)  # the others raise too, at their own pace
                    return {"starts": [g.starts for g in running], "said": _said(tmp, until_error)}
            states = [g.poll() for g in running]
            for g, state in zip(running, states):
                if state == "failed":
                    assert g.starts <= restarts_max, f"group {g.index} failed {g.starts} times: {_errors(tmp, g)}"
                    open(hold, "w").close()  # the live groups wait for it (see _hold)
                    g.start()
            if os.path.exists(hold) and all(g.ready() for g in running if g.poll() == "running"):
                os.remove(hold)
            if all(s == "done" for s in states):
                break
            assert time.monotonic() < deadline, f"not done in {timeout} s: {[_errors(tmp, g) for g in running]}"
            time.sleep(0.2)
    finally:
        for g in running:
            g.stop()
        lighthouse.shutdown()
    return {"starts": [g.starts for g in running]}


def _said(tmp: str, text: str) -> list[str]:
    """The output files (err-g{group}-r{rank}-{start}.txt) that contain ``text``."""
    out = []
    for name in sorted(os.listdir(tmp)):
        if name.startswith("err-"):
            with open(os.path.join(tmp, name)) as f:
                if text in f.read():
                    out.append(name[4:-4])
    return out


def _errors(tmp: str, g: _Group) -> str:
    tails = []
    for name in sorted(os.listdir(tmp)):
        if name.startswith(f"err-g{g.index}-"):
            with open(os.path.join(tmp, name)) as f:
                tails.append(f"{name}: {f.read()[-1500:]}")
    return "\n".join(tails)


def _logs(tmp: str) -> list[tuple[int, int, dict]]:
    """(group, rank, entry) for every step every incarnation of every rank ran."""
    out = []
    for name in os.listdir(tmp):
        if name.startswith("log-"):
            _, g, r, _pid = name[:-5].split("-")
            with open(os.path.join(tmp, name)) as f:
                out += [(int(g[1:]), int(r[1:]), e) for e in json.load(f)]
    return out


def _reference(committed: dict[int, list[int]], *, muon: bool = False,
               overflow_step: int = -1) -> tuple[nn.Module, list[torch.optim.Optimizer], int]:
    """torch.optim.AdamW (or torch.optim.Muon beside it) in one process over the committed steps,
    each with the average gradient of the batches of the groups that took part in it (and every
    rank of each); a step whose average is not finite is skipped, its scheduler step still taken.
    Returns the model, the optimizers and the steps skipped."""
    model = _model()
    if muon:
        mats, rest = _split(model)
        opts: list[torch.optim.Optimizer] = [torch.optim.Muon(mats, **MUON), torch.optim.AdamW(rest, **ADAMW)]
        sched = None
    else:
        opts = [torch.optim.AdamW(model.parameters(), lr=1e-2)]
        sched = torch.optim.lr_scheduler.StepLR(opts[0], step_size=4, gamma=0.5)
    params, skipped = list(model.parameters()), 0
    for step in range(STEPS):
        takers = committed[step]
        total = [torch.zeros_like(p) for p in params]
        for g in takers:
            for r in range(SHARD):
                loss = _loss(model, g, step, r, overflow=step == overflow_step and g == OVERFLOW_GROUP)
                for t, gr in zip(total, torch.autograd.grad(loss, params)):
                    t += gr
        for p, t in zip(params, total):
            p.grad = t / (len(takers) * SHARD)
        if all(bool(torch.isfinite(p.grad).all()) for p in params):
            for o in opts:
                o.step()
        else:
            skipped += 1
        if sched is not None:
            sched.step()
    return model, opts, skipped


def _committed(tmp: str, groups: int) -> dict[int, list[int]]:
    """For each step, the groups whose batches went into it: the groups that took part in the
    quorum (torchft's quorum id) of the attempt that was committed; a group may die after its
    batch went in. Read from every rank's log; their count must be the quorum's size every
    committing rank saw."""
    attempts: dict[int, list[tuple[int, dict]]] = {}
    for g, r, e in _logs(tmp):
        attempts.setdefault(e["before"], []).append((g, e))
    out = {}
    for s in range(STEPS):
        done = [(g, e) for g, e in attempts.get(s, []) if e.get("after") == s + 1]
        assert done, f"step {s} was never committed: {attempts.get(s)}"
        quorums = {(e["quorum"], e["participants"]) for _, e in done}
        assert len(quorums) == 1, f"step {s} was committed in different quorums: {done}"
        quorum, size = quorums.pop()
        out[s] = sorted({g for g, e in attempts[s] if e["quorum"] == quorum and e["participating"]})
        assert len(out[s]) == size, f"step {s}: groups {out[s]} took part, the quorum had {size}: {attempts[s]}"
    return out


def _check_against_reference(tmp: str, groups: int, *, muon: bool = False,
                             overflow_step: int = -1) -> dict[int, list[int]]:
    committed = _committed(tmp, groups)
    ref, ref_opts, skipped = _reference(committed, muon=muon, overflow_step=overflow_step)
    finals = {(g, r): torch.load(os.path.join(tmp, f"final-g{g}-r{r}.pt"), weights_only=False)
              for g in range(groups) for r in range(SHARD)}
    for (g, r), fin in finals.items():
        for n, p in ref.named_parameters():
            torch.testing.assert_close(fin["weights"][n], p.detach(), rtol=0, atol=1e-6,
                                       msg=lambda m: f"group {g} rank {r} weight {n}: {m}")
        assert fin["step"] == STEPS - skipped, (fin["step"], skipped)
        assert fin["skipped_steps"] == skipped
        assert fin["lr"] == ref_opts[0].param_groups[0]["lr"]
        assert fin["loss_scale"] == finals[(0, 0)]["loss_scale"]
    ref_state = {id(p): st for o in ref_opts for p, st in o.state.items()}
    name_of = {id(p): n for n, p in ref.named_parameters()}
    params = [*_split(ref)[0], *_split(ref)[1]] if muon else list(ref.parameters())  # the optimizer's order
    for g in range(groups):
        full = finals[(g, 0)]["full"]  # torch.optim's format, gathered from every rank of the group
        for i, p in enumerate(params):
            keys = [k for k in ("exp_avg", "exp_avg_sq", "momentum_buffer") if k in ref_state[id(p)]]
            assert keys and sorted(keys) == sorted(k for k in full["state"][i] if k != "step")
            for k in keys:
                torch.testing.assert_close(full["state"][i][k], ref_state[id(p)][k], rtol=0, atol=1e-6,
                                           msg=lambda m: f"group {g} {k} of {name_of[id(p)]}: {m}")
    for g in range(1, groups):
        for r in range(SHARD):
            a, b = finals[(0, r)]["shard"], finals[(g, r)]["shard"]
            for x, y in zip(a["buffers"], b["buffers"]):
                for k in x:
                    if isinstance(x[k], torch.Tensor):
                        assert torch.equal(x[k], y[k]), f"group {g} rank {r} {k} differs from group 0's"
            for x, y in zip(a["weights"], b["weights"]):
                assert torch.equal(x, y), f"group {g} rank {r} weights differ from group 0's"
    return committed


def test_a_group_killed_at_step_5_heals_from_the_live_group_and_both_equal_adamw(tmp_path):
    info = _run(str(tmp_path), 2, kills=["1:1:5:backward"])
    assert info["starts"] == [1, 2], info  # group 0 never restarted, group 1 once
    committed = _check_against_reference(str(tmp_path), 2)
    assert any(takers == [0] for takers in committed.values()), committed  # group 0 trained alone for a while
    assert committed[STEPS - 1] == [0, 1], committed  # and group 1 took part again at the end


@pytest.mark.parametrize("where", ["reduction", "step"])
def test_a_kill_inside_a_reduction_or_inside_step_loses_nothing(tmp_path, where):
    info = _run(str(tmp_path), 2, kills=[f"1:0:5:{where}"])
    assert info["starts"] == [1, 2], info
    _check_against_reference(str(tmp_path), 2)


def test_two_failures_in_a_row_each_group_heals_from_the_other(tmp_path):
    info = _run(str(tmp_path), 2, kills=["1:1:3:backward", "0:0:7:backward"])
    assert info["starts"] == [2, 2], info
    _check_against_reference(str(tmp_path), 2)


def test_sharded_muon_heals_and_equals_torch_muon(tmp_path):
    info = _run(str(tmp_path), 2, kills=["1:1:5:backward"], extra_env={"FT_MUON": "1"})
    assert info["starts"] == [1, 2], info
    _check_against_reference(str(tmp_path), 2, muon=True)


def test_an_overflow_on_the_step_a_group_dies_is_skipped_by_every_group_alike(tmp_path):
    info = _run(str(tmp_path), 2, kills=["1:1:5:backward"], extra_env={"FT_OVERFLOW": "5"})
    assert info["starts"] == [1, 2], info
    committed = _check_against_reference(str(tmp_path), 2, overflow_step=5)
    assert OVERFLOW_GROUP in committed[5]  # the overflowing batch was in the committed step: it was skipped
    scales = {torch.load(os.path.join(tmp_path, f"final-g{g}-r{r}.pt"), weights_only=False)["loss_scale"]
              for g in range(2) for r in range(SHARD)}
    assert len(scales) == 1 and scales.pop() < 2.0 ** 16, scales  # halved once, the same everywhere


def test_the_healer_dies_while_a_group_heals_from_it_and_a_third_group_heals_both(tmp_path, monkeypatch):
    # A group that healed on one rank only raises at its next backward pass and starts again; a group
    # that heals from it refuses the state and starts again too; each time the live group trains on a
    # few steps, so this run is longer and each step takes a little time
    monkeypatch.setenv("FT_STEPS", "30")
    monkeypatch.setenv("FT_STEP_SECONDS", "0.1")
    monkeypatch.setattr(sys.modules[__name__], "STEPS", 30)
    # group 1 dies at step 3; group 0's rank 1 dies as it sends group 1 its state; group 2 then heals both
    info = _run(str(tmp_path), 3, kills=["1:1:3:backward", "0:0:-1:heal", "0:1:-1:heal"], restarts_max=8)
    # group 0 died as it sent (its heal kill fired); group 1, which may have healed on one rank only,
    # raised and came back as often as it took; group 2 never stopped
    assert info["starts"][0] >= 2 and info["starts"][1] >= 2 and info["starts"][2] == 1, info
    _check_against_reference(str(tmp_path), 3)


def test_a_learning_rate_changed_in_one_group_only_raises_in_every_group(tmp_path):
    # As a ReduceLROnPlateau stepped on each group's own loss would: group 0 halves its learning
    # rate at step 3, alike on its ranks (so no check inside the group sees it). Averaging both
    # groups' gradients into updates with different rates would part their states for good: every
    # rank of both groups raises, naming the fix, before the step's reductions.
    info = _run(str(tmp_path), 2, kills=[], extra_env={"FT_HALVE_LR_AT": "3"},
                until_error="do not hold the same training state")
    ranks = {name.rsplit("-", 1)[0] for name in info["said"]}
    assert ranks == {"g0-r0", "g0-r1", "g1-r0", "g1-r1"}, info
    steps = {e["before"] for _, _, e in _logs(str(tmp_path)) if e.get("after") == e["before"] + 1}
    assert max(steps) == 2, steps  # steps 0..2 committed; step 3, with the rates apart, nowhere


def test_groups_of_one_rank_heal_and_equal_adamw(tmp_path, monkeypatch):
    # one rank per replica group, torchft's most common layout: no round tag inside a group, yet the
    # groups' check and the heal run all the same
    monkeypatch.setattr(sys.modules[__name__], "SHARD", 1)
    info = _run(str(tmp_path), 2, kills=["1:0:5:backward"], ranks=[1, 1])
    assert info["starts"] == [1, 2], info
    _check_against_reference(str(tmp_path), 2)


def test_groups_of_one_rank_whose_learning_rates_part_raise(tmp_path):
    info = _run(str(tmp_path), 2, kills=[], extra_env={"FT_HALVE_LR_AT": "3"}, ranks=[1, 1],
                until_error="do not hold the same training state")
    assert {name.rsplit("-", 1)[0] for name in info["said"]} == {"g0-r0", "g1-r0"}, info


def test_init_sync_starts_every_group_from_one_state_and_they_stay_one(tmp_path):
    # torchft's default: at step 0 each rank k but one primary's heals from it (torchft picks the
    # primary per rank: rank k of group k mod 2) and adds zeros, so step 0's pieces average only the
    # primaries' batches; from step 1 both groups' batches go in. Every group must hold the same
    # state throughout: the final shards and weights equal bit for bit, and no rank raised.
    info = _run(str(tmp_path), 2, kills=[], extra_env={"FT_INIT_SYNC": "1"})
    assert info["starts"] == [1, 1], info
    steps = {(g, e["before"]) for g, _, e in _logs(str(tmp_path)) if e.get("after") == e["before"] + 1}
    assert steps == {(g, s) for g in range(2) for s in range(STEPS)}, steps
    finals = {(g, r): torch.load(os.path.join(tmp_path, f"final-g{g}-r{r}.pt"), weights_only=False)
              for g in range(2) for r in range(SHARD)}
    for r in range(SHARD):
        for x, y in zip(finals[(0, r)]["shard"]["buffers"], finals[(1, r)]["shard"]["buffers"]):
            assert all(torch.equal(x[k], y[k]) for k in x if isinstance(x[k], torch.Tensor)), r
        for n, w in finals[(0, r)]["weights"].items():
            assert torch.equal(w, finals[(1, r)]["weights"][n]), (r, n)
    assert not _said(str(tmp_path), "Error"), _said(str(tmp_path), "Error")


def test_a_learning_rate_changed_between_backward_and_step_raises_before_any_update(tmp_path):
    # the groups compared the values of the backward pass; a change after it cannot be compared
    info = _run(str(tmp_path), 2, kills=[], extra_env={"FT_HALVE_LR_AFTER_BACKWARD_AT": "3"},
                until_error="changed between this step's backward pass and step()")
    assert {name.rsplit("-", 1)[0] for name in info["said"]} == {"g0-r0", "g0-r1"}, info


@pytest.mark.parametrize("times, says", [("0", "never registered with the manager"),
                                         ("2", "register was already called for this optimizer")])
def test_register_forgotten_or_called_twice_raises_at_once(tmp_path, times, says):
    info = _run(str(tmp_path), 2, kills=[], extra_env={"FT_REGISTER": times}, until_error=says)
    assert {name.rsplit("-", 1)[0] for name in info["said"]} == {"g0-r0", "g0-r1", "g1-r0", "g1-r1"}, info


def test_groups_of_different_sizes_raise_clearly(tmp_path):
    info = _run(str(tmp_path), 2, kills=[], ranks=[2, 1], until_error="do not hold the same training state")
    assert {"g0-r0", "g1-r0"} <= {name.rsplit("-", 1)[0] for name in info["said"]}, info


if __name__ == "__main__":
    _worker()
