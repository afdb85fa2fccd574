"""Tier 2: checkpoints under kills and under the DDP habit of saving on rank 0 only.

Catches two ways a run was lost or hung:

* a process killed while it commits a checkpoint over an existing one (between moving the old
  one aside and renaming the new one in) left two complete checkpoints under names that
  ``latest_checkpoint`` skipped, so a restart began again from step 0. Each test run is killed
  with ``os._exit`` at one rename or file move of the commit, in real gloo ranks of their own;
  the next run must find a checkpoint at the same path, equal to one of the two saves, and the
  next save must remove what the kill left.
* ``save_checkpoint`` / ``load_checkpoint`` on rank 0 only: gloo aborted the process (SIGABRT) on
  collectives of different sizes, or both ranks waited out the group's 30-minute timeout in a
  ``dist.barrier()``. Every rank that made the call must raise a Python exception naming it within
  seconds, the others an error too when they go on training, and no rank may die by a signal.
  The same for ``opt.load_state_dict`` (which gloo aborted) and the other state-dict calls that
  every rank must make.
* deadlines that were not what they said: a weights-only load that gave up after the group's
  timeout while naming its own, and a rank that came to a call after another had given up on it,
  whose message paired with the one left in flight and took it into the save alone.
* a rank that died where the others waited in torch's own calls rather than shardopt's messages:
  the default store a save claims its path in (hosted by rank 0 under a plain launch), the weight
  gather at the end of a load (whose other parts' ranks returned as if it had succeeded), a step's
  weight gather after the other rank's update raised: bare torch errors that named neither the call
  nor the death.
* an OSError other than FileNotFoundError on one rank in a load or a save: that rank left the call
  alone and gloo aborted a rank at the next call; every rank must raise it, so that a resume loop
  falling back to an older checkpoint works.
"""
from __future__ import annotations

import datetime
import glob
import json
import multiprocessing as mp
import os
import re
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import shardopt
from models import batch, make_model
from shardopt.convert import convert_checkpoint

WORLD = 2


def _spawn(target, root: str, *args, timeout: float = 90.0, linger: bool = False,
           world: int = WORLD, group_timeout: float = 300.0, tcp_store: bool = False) -> list[int | None]:
    """Run ``target(rank, root, *args)`` on WORLD fresh gloo ranks of their own; their exit codes.
    ``linger``: each rank stays up until every rank has written its result (see ``_main``);
    ``group_timeout``: seconds, the default group's timeout; ``tcp_store``: the default store is a
    TCPStore that rank 0 hosts, as under a plain launch (torchrun's agent hosts it apart), so that
    it goes down with rank 0, instead of a file."""
    ctx = _context()
    store = os.path.join(root, f"store-{time.monotonic_ns()}")
    procs = [ctx.Process(target=_main, args=(target, r, store, root, args, linger, world, group_timeout, tcp_store),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes


def _context():
    """Fresh processes forked from one server that imported torch and shardopt once (a spawned
    process would take seconds to import them, for each of the many runs here)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "shardopt", "models"])
    return ctx


def _main(target, rank: int, store: str, root: str, args: tuple, linger: bool, world: int,
          group_timeout: float, tcp_store: bool = False) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    wait = datetime.timedelta(seconds=group_timeout)
    dist.init_process_group("gloo", store=_tcp_store(store, rank, world, wait) if tcp_store else
                            dist.FileStore(store, world), rank=rank, world_size=world, timeout=wait)
    try:
        result = target(rank, root, *args)
    except BaseException:  # noqa: BLE001 - reported to the test, which decides
        result = {"traceback": traceback.format_exc()}
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # With linger, stay up until every rank has its result: an exit would reset the connections a
    # peer may still be reading a refused call's message from.
    deadline = time.monotonic() + (30 if linger else 0)
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(root, f"rank{r}.json")) for r in range(world)):
        time.sleep(0.05)
    os._exit(0)  # results are written; collectives a refused call left in flight need no teardown


def _tcp_store(where: str, rank: int, world: int, timeout: datetime.timedelta):
    """A TCPStore on a free port, hosted by rank 0, which leaves its port in the file ``where``."""
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)
        with open(where + ".partial", "w") as f:
            f.write(str(store.port))
        os.replace(where + ".partial", where)
        return store
    while not os.path.exists(where):
        time.sleep(0.02)
    with open(where) as f:
        return dist.TCPStore("127.0.0.1", int(f.read()), world, False, timeout=timeout)


def _results(root: str, world: int = WORLD) -> list[dict]:
    out = []
    for r in range(world):
        with open(os.path.join(root, f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def _train(model, opt, steps) -> None:
    for step in steps:
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()


def _state(model, opt) -> dict[str, list]:
    fsd = opt.full_state_dict()
    state = {k: v.tolist() for k, v in model.state_dict().items()}
    if dist.get_rank() == 0:
        state.update({f"{i}.{k}": v.tolist() for i, s in fsd["state"].items() for k, v in s.items() if k != "step"})
    return state


# -- a kill at each rename or file move of a commit over an existing checkpoint -------------------
MOVES = ("replace", "rename", "rmtree")  # the marker's os.replace, the two os.rename, shutil.rmtree of the old one


class _KillAt:
    """Stands in for ``os`` or ``shutil`` inside ``_checkpoint_files`` while a commit runs: the
    process dies (``os._exit``) before its ``at``-th move, or after the last one (``at`` = -1)."""

    count = 0

    def __init__(self, real, at: int) -> None:
        self._real, self._at = real, at

    def __getattr__(self, name: str):
        attr = getattr(self._real, name)
        if name not in MOVES:
            return attr

        def move(*args, **kwargs):
            _KillAt.count += 1
            if _KillAt.count == self._at:
                os._exit(17)
            out = attr(*args, **kwargs)
            if self._at == -1 and name == "rmtree":
                os._exit(17)
            return out

        return move


def killed_commit_case(rank: int, root: str, at: int) -> dict:
    import shardopt.checkpoint._files as files
    import shardopt.checkpoint as ck

    model = make_model(seed=4)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, stage=2)
    path = os.path.join(root, "latest")
    _train(model, opt, range(1))
    first = _state(model, opt)
    shardopt.save_checkpoint(path, model, opt)
    _train(model, opt, range(1, 2))
    second = _state(model, opt)
    if rank == 0:
        with open(os.path.join(root, "saves.json"), "w") as f:
            json.dump([first, second], f)
        commit = ck.commit

        def commit_then_die(*args, **kwargs):
            files.os, files.shutil = _KillAt(os, at), _KillAt(files.shutil, at)
            commit(*args, **kwargs)

        ck.commit = commit_then_die
    shardopt.save_checkpoint(path, model, opt)  # rank 0 dies inside; rank 1 then fails in the last agreement
    return {"survived": True}


def load_case(rank: int, root: str, names: list[str]) -> dict:
    """The next run, for each killed run's directory under ``root``: find, load, save again."""
    out = {}
    for name in names:
        where = os.path.join(root, name)
        model = make_model(seed=9)
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, stage=1)
        found = shardopt.latest_checkpoint(where)
        shardopt.load_checkpoint(found, model, opt)
        state = _state(model, opt)
        listed = shardopt.list_checkpoints(where)
        shardopt.save_checkpoint(found, model, opt)  # the next successful save removes what the kill left
        dist.barrier()
        out[name] = {"found": found, "listed": listed, "state": state, "left": sorted(os.listdir(where))}
    return out


KILLS = {"marker": 1, "old-aside": 2, "new-in": 3, "old-removed": 4, "after": -1}  # the move the kill comes before


@pytest.mark.launch  # processes of its own
def test_a_kill_at_each_move_of_a_commit_leaves_a_checkpoint_the_next_run_finds(tmp_path):
    left_by_kill, saves = {}, {}
    for name, at in KILLS.items():
        root = str(tmp_path / name)
        os.makedirs(root)
        codes = _spawn(killed_commit_case, root, at)
        assert codes[0] == 17, (name, codes, _results(root) if os.path.exists(os.path.join(root, "rank1.json")) else None)
        assert codes[1] is not None and codes[1] >= 0, (name, codes)  # rank 1 ended by itself, not by a signal
        saves[name] = json.load(open(os.path.join(root, "saves.json")))
        left_by_kill[name] = sorted(n for n in os.listdir(root) if ".tmp-" in n or ".old-" in n)
        for f in glob.glob(os.path.join(root, "rank*.json")) + glob.glob(os.path.join(root, "store-*")):
            os.remove(f)
    root = str(tmp_path)
    codes = _spawn(load_case, root, list(KILLS))
    got = _results(root)
    assert codes == [0, 0] and "traceback" not in got[0] and "traceback" not in got[1], (codes, got)
    for name, at in KILLS.items():
        path = os.path.join(root, name, "latest")
        for rank in range(WORLD):
            r = got[rank][name]
            assert r["found"] == path and r["listed"] == [path], (name, rank, r["found"], r["listed"], left_by_kill[name])
        full = {**got[1][name]["state"], **got[0][name]["state"]}  # rank 0 adds the optimizer's state
        assert full in saves[name], (name, left_by_kill[name])  # equal to one of the two saves
        if at == 1:  # killed before the new checkpoint was complete: the old one
            assert full == saves[name][0], name
        if at in (3, 4, -1):  # the new one was complete and the old one moved aside: the new one
            assert full == saves[name][1], name
        leftovers = [n for n in got[0][name]["left"] if ".tmp-" in n or ".old-" in n]
        assert leftovers == [], (name, left_by_kill[name], got[0][name]["left"])
    assert left_by_kill["old-aside"] and left_by_kill["new-in"], left_by_kill  # the kills did leave work behind


def test_an_interrupted_commit_is_recovered_once_when_every_rank_lists_at_once(tmp_path):
    """Both leftovers complete, the path missing (a kill between the two renames); two processes
    list the directory at the same instant: both find the new checkpoint under its own name."""
    from shardopt.checkpoint._files import MANIFEST, MARKER, list_checkpoints

    root = tmp_path / "ckpt"
    for name, step in (("latest.old-aaaa", 1), ("latest.tmp-aaaa", 2)):
        d = root / name
        d.mkdir(parents=True)
        (d / MANIFEST).write_text(json.dumps({"format": "shardopt.checkpoint.v1", "step": step}))
        (d / ".metadata").write_text("m")
        files = {MANIFEST: (d / MANIFEST).stat().st_size, ".metadata": 1}
        (d / MARKER).write_text(json.dumps({"format": "shardopt.checkpoint.v1", "files": files}))
    ctx = mp.get_context("fork")
    with ctx.Pool(2) as pool:
        listed = pool.map(list_checkpoints, [str(root)] * 2)
    assert listed == [[str(root / "latest")]] * 2, listed
    assert json.loads((root / "latest" / MANIFEST).read_text())["step"] == 2
    assert sorted(os.listdir(root)) == ["latest", "latest.old-aaaa"]


# -- a rank killed in a save of a model split over tensor-parallel ranks ---------------------------
# 2 x 2 (dp x tp), Megatron-style shards with model_parallel_group=. One rank dies (os._exit) at
# one point of the second save to the same path; the others used to raise gloo's bare
# "Connection closed by peer" from inside DCP, or a ControlGone that named "a backward or forward
# pass" (the ranks of the other parts were not marked as being in save_checkpoint). Each survivor
# must name save_checkpoint() and say that a rank died (or that it waited for one that may have);
# the next run (4 fresh ranks) finds the first save intact and loads it, equal to what was saved.
TP_WORLD = 4
TP_KILLS = {"entry": 3, "plan": 3, "write": 1, "checksums": 3, "commit": 0}  # where the victim dies -> victim


def _tp_parts(timeout: float | None = None):
    from torch.distributed.device_mesh import init_device_mesh

    from parallel_models import MegatronTP, Whole

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    model = MegatronTP(Whole(0), tp.get_group(), tp.get_local_rank(), 2)
    opt = shardopt.ShardedAdamW([{"params": model.sharded()}, {"params": model.replicated(), "replicated": True}],
                                lr=1e-2, device_mesh=mesh["dp"], model_parallel_group=tp, timeout=timeout)
    return mesh, model, opt


def _tp_train(mesh, model, opt, steps) -> None:
    from parallel_models import batch as tp_batch

    for step in steps:
        opt.zero_grad()
        opt.backward(model(*tp_batch(mesh["dp"].get_local_rank(), step)))
        opt.step()


def _tp_state(model, opt) -> dict:
    """This rank's weights, and at data-parallel rank 0 its part's optimizer state (torch's format)."""
    fsd = opt.full_state_dict()
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": {i: {k: v.clone() for k, v in s.items()} for i, s in fsd.get("state", {}).items()}}


def tp_killed_save_case(rank: int, root: str, at: str, victim: int) -> dict:
    import torch.distributed.checkpoint as dcp

    import shardopt.checkpoint as ck

    mesh, model, opt = _tp_parts(timeout=10)
    path = os.path.join(root, "ckpt")
    _tp_train(mesh, model, opt, range(2))
    shardopt.save_checkpoint(path, model, opt)
    torch.save(_tp_state(model, opt), os.path.join(root, f"saved{rank}.pt"))
    _tp_train(mesh, model, opt, range(2, 3))

    def die(*args, **kwargs):
        os._exit(17)

    if rank == victim:
        if at == "entry":  # before the call: the others wait for it to enter
            die()
        elif at == "plan":  # in DCP's planning: the others wait in DCP's gather of the plans
            dcp.FileSystemWriter.prepare_local_plan = die
        elif at == "write":  # its shard written: the others wait in DCP's gather of what was written
            write_data = dcp.FileSystemWriter.write_data

            def write_then_die(self, plan, planner):
                write_data(self, plan, planner).wait()
                die()

            dcp.FileSystemWriter.write_data = write_then_die
        elif at == "checksums":  # every shard written: the others wait in the agreement on the checksums
            ck.data_checksums = die
        else:  # rank 0, about to commit: the others wait in the last agreement
            ck.commit = die
    start = time.perf_counter()
    try:
        shardopt.save_checkpoint(path, model, opt)
        error = "no error"
    except (RuntimeError, TimeoutError) as e:
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "seconds": time.perf_counter() - start}


def tp_load_case(rank: int, root: str, names: list[str]) -> dict:
    """The next run: in each killed run's directory, find the latest checkpoint and load it."""
    out = {}
    for name in names:
        where = os.path.join(root, name)
        mesh, model, opt = _tp_parts()
        found = shardopt.latest_checkpoint(where)
        shardopt.load_checkpoint(found, model, opt)
        saved, got = torch.load(os.path.join(where, f"saved{rank}.pt"), weights_only=True), _tp_state(model, opt)
        same = got["model"].keys() == saved["model"].keys() and all(
            torch.equal(v, saved["model"][k]) for k, v in got["model"].items())
        same = same and got["optim"].keys() == saved["optim"].keys() and all(
            torch.equal(v, saved["optim"][i][k]) for i, s in got["optim"].items() for k, v in s.items() if k != "step")
        out[name] = {"found": found, "same": same, "optim_entries": len(got["optim"])}
    return out


@pytest.mark.launch  # processes of its own
def test_a_rank_killed_in_a_tensor_parallel_save_is_named_and_the_last_checkpoint_loads(tmp_path):
    for name, victim in TP_KILLS.items():
        root = str(tmp_path / name)
        os.makedirs(root)
        codes = _spawn(tp_killed_save_case, root, name, victim, world=TP_WORLD, timeout=120)
        assert codes[victim] == 17 and all(c == 0 for r, c in enumerate(codes) if r != victim), (name, codes)
        for rank in sorted(set(range(TP_WORLD)) - {victim}):
            with open(os.path.join(root, f"rank{rank}.json")) as f:
                got = json.load(f)
            msg = got.get("error", str(got))
            assert "save_checkpoint()" in msg and "died" in msg, (name, rank, msg)
            assert victim in _named_as_ended(msg), (name, rank, msg)  # which rank died (others may have exited since)
            assert "a backward or forward pass" not in msg and "Connection" not in msg.split("(gloo")[0], \
                (name, rank, msg)
            assert got["seconds"] < 30, (name, rank, got)
        for f in glob.glob(os.path.join(root, "rank*.json")) + glob.glob(os.path.join(root, "store-*")):
            os.remove(f)
    root = str(tmp_path)
    codes = _spawn(tp_load_case, root, list(TP_KILLS), world=TP_WORLD, timeout=120)
    got = _results(root, TP_WORLD)
    assert codes == [0] * TP_WORLD and all("traceback" not in r for r in got), (codes, got)
    for name in TP_KILLS:
        for rank in range(TP_WORLD):
            r = got[rank][name]
            assert r["found"] == os.path.join(root, name, "ckpt") and r["same"], (name, rank, r)
            assert r["optim_entries"] == (6 if rank in (0, 1) else 0), (name, rank, r)  # the part's, at dp rank 0


# -- a rank that dies where the others wait in torch's own calls ----------------------------------
# Under a plain launch the default store (a TCPStore) lives in rank 0: a save whose rank 0 died
# before the others claimed the path in it gave them torch's bare DistNetworkError ("Failed to
# recv, got 0 bytes"). A rank that died after DCP's read in a load left its data-parallel peers
# with gloo's bare "Connection reset by peer" from the weight gather, and the ranks of the model's
# other parts returning from load_checkpoint as if it had succeeded (to fail at their next forward
# pass). Every survivor must raise, within seconds, naming the call and saying that a rank died.
def _named_as_ended(msg: str) -> set[int]:
    """The ranks (of the job) that ``msg`` says the processes of have ended: "the process of rank 2
    has ended", "the processes of ranks 1 (global rank 3), 2 have ended" (a group's numbers, then the
    job's)."""
    found = re.search(r"the process(?:es)? of ranks? (.*?) ha(?:s|ve) ended", msg)
    if found is None:
        return set()
    return {int(glob_ or group) for group, glob_ in re.findall(r"(\d+)(?: \(global rank (\d+)\))?", found.group(1))}


def _names_a_death(msg: str, call: str) -> bool:
    """Whether ``msg`` names ``call`` and a rank's death in shardopt's words (torch's own follow in
    parentheses, after them)."""
    ours = msg.split("(gloo:")[0].split("(store:")[0]
    return call in ours and "died" in ours and "Connection" not in ours and "Failed to recv" not in ours


def killed_before_claim_case(rank: int, root: str) -> dict:
    import shardopt.checkpoint as ck

    model = make_model(seed=4)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, timeout=20)
    path = os.path.join(root, "ckpt")
    _train(model, opt, range(1))
    shardopt.save_checkpoint(path, model, opt)
    saved = _state(model, opt)
    if rank == 0:
        with open(os.path.join(root, "saved.json"), "w") as f:
            json.dump(saved, f)
    _train(model, opt, range(1, 2))
    claim = ck.claim

    def claim_once_rank_0_died(*args, **kwargs):
        if rank == 0:  # the store's host
            os._exit(17)
        time.sleep(0.5)
        return claim(*args, **kwargs)

    ck.claim = claim_once_rank_0_died
    start = time.perf_counter()
    try:
        shardopt.save_checkpoint(path, model, opt)
        error = "no error"
    except Exception as e:  # noqa: BLE001 - the test reads what it was
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "seconds": time.perf_counter() - start}


@pytest.mark.launch  # processes of its own
def test_a_save_whose_store_host_died_before_the_claim_is_named_and_commits_nothing(tmp_path):
    root = str(tmp_path)
    codes = _spawn(killed_before_claim_case, root, world=3, tcp_store=True, timeout=120)
    assert codes == [17, 0, 0], codes
    for rank, got in enumerate(_results_of(root, (1, 2)), start=1):
        assert _names_a_death(got.get("error", str(got)), "save_checkpoint()"), (rank, got)
        assert got["seconds"] < 30, (rank, got)
    # the first save is still the checkpoint at the path (read without ranks: the converter)
    out = str(tmp_path / "plain.pt")
    convert_checkpoint(os.path.join(root, "ckpt"), out)
    plain = torch.load(out, weights_only=True)
    with open(os.path.join(root, "saved.json")) as f:
        saved = json.load(f)
    for key, value in saved.items():
        index, _, name = key.partition(".")
        got = plain["optim"]["state"][int(index)][name] if index.isdigit() else plain["model"][key]
        assert got.tolist() == value, key


def _results_of(root: str, ranks) -> list[dict]:
    out = []
    for r in ranks:
        with open(os.path.join(root, f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def _dtensor_parts(timeout: float):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from parallel_models import Whole

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Whole(0)
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return mesh, model, shardopt.ShardedAdamW(model.parameters(), lr=1e-2, device_mesh=mesh["dp"], timeout=timeout)


def killed_after_the_read_case(rank: int, root: str, layout: str, victim: int) -> dict:
    """Save, then load with ``victim`` dying once every rank has read and restored its shard, as
    the gather of the weights starts: its data-parallel peers wait in that gather, the other parts'
    ranks finish theirs. ``layout``: "dp" (2 ranks), "megatron" (plain shards with
    model_parallel_group) or "dtensor" (DTensor parameters), each 2 x 2 (dp x tp)."""
    if layout == "dp":
        model = make_model(seed=4)
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, timeout=20)

        def train(steps):
            _train(model, opt, steps)
    else:
        mesh, model, opt = _tp_parts(timeout=20) if layout == "megatron" else _dtensor_parts(timeout=20)

        def train(steps):
            _tp_train(mesh, model, opt, steps)
    path = os.path.join(root, "ckpt")
    train(range(2))
    shardopt.save_checkpoint(path, model, opt)
    train(range(2, 3))
    if rank == victim:
        def die():
            os._exit(17)

        for b in opt._buffers:
            b.gather_params = die
    start = time.perf_counter()
    try:
        shardopt.load_checkpoint(path, model, opt)
        error = "no error"
    except Exception as e:  # noqa: BLE001 - the test reads what it was
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "seconds": time.perf_counter() - start}


@pytest.mark.launch  # processes of its own
@pytest.mark.parametrize("layout,world,victim", [("dp", 2, 0), ("megatron", 4, 3), ("dtensor", 4, 3)])
def test_a_rank_killed_in_a_load_after_the_read_is_named_on_every_rank(tmp_path, layout, world, victim):
    root = str(tmp_path)
    codes = _spawn(killed_after_the_read_case, root, layout, victim, world=world, timeout=150)
    assert codes[victim] == 17 and all(c == 0 for r, c in enumerate(codes) if r != victim), codes
    survivors = [r for r in range(world) if r != victim]
    for rank, got in zip(survivors, _results_of(root, survivors)):
        assert _names_a_death(got.get("error", str(got)), "load_checkpoint()"), (rank, got)
        assert victim in _named_as_ended(got["error"]), (rank, got)
        assert got["seconds"] < 30, (rank, got)


# -- an error of one rank in a load or a save: every rank raises it and leaves the call -----------
def fallback_case(rank: int, root: str) -> dict:
    """Two checkpoints; a save to a new path and a load of the newest each meet a PermissionError on
    rank 1 only (an OSError that is not FileNotFoundError: EACCES, EIO). A resume loop falls back to
    the older checkpoint, and every rank trains on."""
    import shardopt.checkpoint as ck

    model, opt, saved = _two_checkpoints(root)
    out: dict = {}
    check = ck.check_replaceable

    def denied(path):
        if rank == 1:
            raise PermissionError(13, "Permission denied", path)
        check(path)

    ck.check_replaceable = denied
    try:
        shardopt.save_checkpoint(os.path.join(root, "step_3"), model, opt)
        out["save"] = "no error"
    except Exception as e:  # noqa: BLE001 - the test reads what it was
        out["save"] = f"{type(e).__name__}: {e}"
    ck.check_replaceable = check
    verify = ck.verify_data

    def unreadable(path, *args, **kwargs):
        if rank == 1 and path.endswith("step_2"):
            raise PermissionError(13, "Permission denied", os.path.join(path, "__1_0.distcp"))
        verify(path, *args, **kwargs)

    ck.verify_data = unreadable
    model = make_model(seed=9)  # a restarted run
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, timeout=20)
    out["tried"] = []
    for found in reversed(shardopt.list_checkpoints(root)):
        try:
            extra = shardopt.load_checkpoint(found, model, opt)
            out["tried"].append([os.path.basename(found), f"loaded {extra}"])
            break
        except Exception as e:  # noqa: BLE001 - the test reads what it was
            out["tried"].append([os.path.basename(found), f"{type(e).__name__}: {e}"])
    return _after_resume(out, root, model, opt, saved[1])


@pytest.mark.launch  # processes of its own
def test_an_oserror_on_one_rank_is_raised_on_every_rank_and_a_fallback_loop_resumes(tmp_path):
    """A PermissionError on one rank was not taken to the agreement: that rank left the call alone,
    its next load's first message met the others' agreement of another size, and gloo aborted a
    rank (SIGABRT). Every rank must raise it, and the loop then load the older checkpoint on every
    rank, equal to what was saved, and train on together."""
    root = str(tmp_path)
    codes = _spawn(fallback_case, root, timeout=120)
    assert codes == [0, 0], codes  # none killed by a signal, none hung
    got = _results(root)
    assert all("traceback" not in r for r in got), got
    denied = "PermissionError: [Errno 13] Permission denied"
    for rank, r in enumerate(got):
        assert r["save"].startswith("PermissionError: ") and denied.split(": ", 1)[1] in r["save"], (rank, r["save"])
        assert [name for name, _ in r["tried"]] == ["step_2", "step_1"], (rank, r["tried"])
        assert r["tried"][0][1].startswith("PermissionError: ") and "__1_0.distcp" in r["tried"][0][1], (rank, r)
        assert r["tried"][1][1] == "loaded {'step': 1}", (rank, r)
        assert r["as_saved"], rank
        assert r["listed"] == ["step_1", "step_2"], (rank, r["listed"])  # the refused save wrote nothing
    assert "on rank 1" in got[0]["save"] and "on rank 1" in got[0]["tried"][0][1], got[0]
    assert got[0]["trained"] == got[1]["trained"]  # the ranks stepped together after the fallback


# -- out of memory on one rank, and OSErrors inside DCP ------------------------------------------
def _after_resume(out: dict, root: str, model, opt, saved: object) -> dict:
    """``out`` with what the resumed run shows: whether it holds the state saved at step 1, its
    weights after one more step, and the checkpoints left under ``root``."""
    out["as_saved"] = _state(model, opt) == saved
    _train(model, opt, range(1, 2))
    out["trained"] = {k: v.tolist() for k, v in model.state_dict().items()}
    out["listed"] = [os.path.basename(p) for p in shardopt.list_checkpoints(root)]
    return out


def _resume_loop(root: str, model, opt) -> list[list[str]]:
    """docs/checkpoints.md's resume loop: newest first, skipping a checkpoint that raises OSError or
    ValueError. What each try gave."""
    tried = []
    for found in reversed(shardopt.list_checkpoints(root)):
        try:
            extra = shardopt.load_checkpoint(found, model, opt)
            tried.append([os.path.basename(found), f"loaded {extra}"])
            break
        except (OSError, ValueError) as e:  # raised on every rank alike
            tried.append([os.path.basename(found), f"{type(e).__name__}: {e}"])
    return tried


def _two_checkpoints(root: str) -> tuple:
    """A model and its optimizer (timeout 20 s) trained two steps, each saved under ``root`` as
    ``step_1``, ``step_2``: (model, optimizer, the state after each step)."""
    model = make_model(seed=4)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, timeout=20)
    saved = {}
    for step in (1, 2):
        _train(model, opt, range(step - 1, step))
        shardopt.save_checkpoint(os.path.join(root, f"step_{step}"), model, opt, extra={"step": step})
        saved[step] = _state(model, opt)
    return model, opt, saved


def _saved(path: str, model, opt) -> dict:
    """What ``save_checkpoint(path, model, opt)`` gave: ``{"class": "no error"}`` or its error (``_error``)."""
    start = time.perf_counter()
    try:
        shardopt.save_checkpoint(path, model, opt)
        return {"class": "no error"}
    except Exception as e:  # noqa: BLE001 - the test reads what it was
        return _error(e, start)


def _error(e: BaseException, start: float) -> dict:
    return {"class": type(e).__name__, "message": str(e), "errno": getattr(e, "errno", None),
            "oserror": isinstance(e, OSError), "seconds": time.perf_counter() - start}


def test_a_peer_error_is_raised_as_its_nearest_built_in_class_with_its_errno():
    """What the other ranks raise for one rank's error (``agree``, DCP's failures): Python's own
    class hierarchy decides, so a caller's ``except OSError`` / ``except ValueError`` /
    ``except torch.OutOfMemoryError`` and its checks of ``e.errno`` behave on every rank as on the
    rank that failed."""
    import errno
    import shutil

    from shardopt.checkpoint._files import described, restated

    class Mine(ValueError):
        pass

    cases = [(PermissionError(errno.EACCES, "denied"), PermissionError, errno.EACCES),
             (OSError(errno.ENOSPC, "No space left on device"), OSError, errno.ENOSPC),
             (OSError(errno.ENOENT, "gone"), FileNotFoundError, errno.ENOENT),
             (shutil.Error("copy failed"), OSError, None),
             (Mine("bad"), ValueError, None), (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), ValueError, None),
             (torch.OutOfMemoryError("CUDA out of memory"), torch.OutOfMemoryError, None),
             (MemoryError(), MemoryError, None), (KeyError("k"), RuntimeError, None)]
    for error, cls, code in cases:
        got = restated(described(error), "on rank 1: ...")
        assert type(got) is cls and str(got) == "on rank 1: ...", (error, got)
        assert getattr(got, "errno", None) == code, (error, got)
        if isinstance(error, OSError):
            assert got.errno == error.errno


def out_of_memory_case(rank: int, root: str, victim: int, kind: str) -> dict:
    """A save whose ``victim`` runs out of memory making the fp32 copies it writes (as a GPU rank
    whose neighbours' memory is fuller: ``kind`` torch.OutOfMemoryError or MemoryError). Then the
    same save again, the resume loop, and a step on every rank."""
    import shardopt.checkpoint as ck

    model = make_model(seed=4)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, timeout=20)
    _train(model, opt, range(1))
    shardopt.save_checkpoint(os.path.join(root, "step_1"), model, opt, extra={"step": 1})
    saved = _state(model, opt)
    _train(model, opt, range(1, 2))
    blocks_to_save = ck._blocks_to_save

    def out_of_memory(*args, **kwargs):
        if rank == victim:
            raise (torch.OutOfMemoryError if kind == "OutOfMemoryError" else MemoryError)("out of memory (test)")
        return blocks_to_save(*args, **kwargs)

    ck._blocks_to_save = out_of_memory
    out: dict = {"save": _saved(os.path.join(root, "step_2"), model, opt)}
    ck._blocks_to_save = blocks_to_save
    out["listed"] = [os.path.basename(p) for p in shardopt.list_checkpoints(root)]
    out["tried"] = _resume_loop(root, model, opt)
    out["as_saved"] = _state(model, opt) == saved
    _train(model, opt, range(1, 2))
    out["trained"] = {k: v.tolist() for k, v in model.state_dict().items()}
    return out


@pytest.mark.launch  # processes of its own
@pytest.mark.parametrize("victim,kind", [(1, "OutOfMemoryError"), (0, "MemoryError")])
def test_out_of_memory_on_one_rank_in_a_save_is_raised_on_every_rank_and_the_last_checkpoint_loads(
        tmp_path, victim, kind):
    """The fp32 copies a save writes were made between the call's agreements: the rank out of memory
    raised alone, the other waited in DCP's exchange of plans until the timeout and then said that a
    rank had died, and every later call, the resume loop's load of the older checkpoint included,
    said the ranks could no longer agree. Every rank must raise it at once (the others naming the
    rank), and the loop then load the older checkpoint, equal to what was saved, on every rank."""
    root = str(tmp_path)
    codes = _spawn(out_of_memory_case, root, victim, kind, timeout=60)
    assert codes == [0, 0], codes
    got = _results(root)
    assert all("traceback" not in r for r in got), got
    for rank, r in enumerate(got):
        assert r["save"]["class"] == kind and "out of memory (test)" in r["save"]["message"], (rank, r["save"])
        assert ("on rank " + str(victim)) in r["save"]["message"] or rank == victim, (rank, r["save"])
        assert r["save"]["seconds"] < 10, (rank, r["save"])  # at once: not the 20 s timeout
        assert r["listed"] == ["step_1"], (rank, r)  # nothing of the failed save
        assert r["tried"] == [["step_1", "loaded {'step': 1}"]], (rank, r["tried"])
        assert r["as_saved"], rank
    assert got[0]["trained"] == got[1]["trained"]


def dcp_oserror_case(rank: int, root: str) -> dict:
    """Rank 1's file I/O inside DCP fails: a full disk writing its shard (ENOSPC), an EIO reading the
    newest checkpoint. docs/checkpoints.md's resume loop must skip it and load the older one."""
    import errno

    import torch.distributed.checkpoint as dcp

    model, opt, saved = _two_checkpoints(root)
    write_data, read_data = dcp.FileSystemWriter.write_data, dcp.FileSystemReader.read_data

    def disk_full(self, plan, planner):
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(self.path, "__1_0.distcp"))
        return write_data(self, plan, planner)

    def unreadable(self, plan, planner):
        if rank == 1 and os.path.basename(str(self.path)) == "step_2":
            raise OSError(errno.EIO, "Input/output error", os.path.join(self.path, "__1_0.distcp"))
        return read_data(self, plan, planner)

    dcp.FileSystemWriter.write_data, dcp.FileSystemReader.read_data = disk_full, unreadable
    out: dict = {"save": _saved(os.path.join(root, "step_3"), model, opt)}
    dcp.FileSystemWriter.write_data = write_data
    model = make_model(seed=9)  # a restarted run
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, timeout=20)
    try:
        out["tried"] = _resume_loop(root, model, opt)
    except Exception as e:  # noqa: BLE001 - escaped the loop
        out["escaped"] = f"{type(e).__name__}: {e}"
        return out
    return _after_resume(out, root, model, opt, saved[1])


@pytest.mark.launch  # processes of its own
def test_an_oserror_inside_dcp_is_an_oserror_on_every_rank_and_the_resume_loop_skips_it(tmp_path):
    """DCP's failures came back as RuntimeError whatever they were, so the documented resume loop
    (``except (OSError, ValueError)``) let an EIO of one rank escape instead of falling back, and a
    full disk could not be told apart from a bug. Every rank must raise an OSError with the failing
    rank's errno, naming the rank."""
    import errno

    root = str(tmp_path)
    codes = _spawn(dcp_oserror_case, root, timeout=120)
    assert codes == [0, 0], codes
    got = _results(root)
    assert all("traceback" not in r and "escaped" not in r for r in got), got
    for rank, r in enumerate(got):
        save = r["save"]
        assert save["oserror"] and save["errno"] == errno.ENOSPC and "rank 1: OSError" in save["message"], (rank, save)
        assert [name for name, _ in r["tried"]] == ["step_2", "step_1"], (rank, r["tried"])
        assert r["tried"][0][1].startswith("OSError: ") and "rank 1: OSError: [Errno 5]" in r["tried"][0][1], (rank, r)
        assert r["tried"][1][1] == "loaded {'step': 1}", (rank, r)
        assert r["as_saved"], rank
        assert r["listed"] == ["step_1", "step_2"], (rank, r["listed"])  # the failed save left nothing
    assert got[0]["trained"] == got[1]["trained"]


# -- a rank whose step raises: the other names the step ------------------------------------------
def one_rank_fails_in_step_case(rank: int, root: str) -> dict:
    model = make_model(seed=4)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, timeout=20)
    _train(model, opt, range(1))
    if rank == 0:  # as a fused kernel that fails to compile on one rank only (torch.compile's error)
        def update(*args, **kwargs):
            raise RuntimeError("the update kernel failed on this rank")

        for b in opt._buffers:
            b.update = update
    start = time.perf_counter()
    try:
        _train(model, opt, range(1, 2))
        error = "no error"
    except Exception as e:  # noqa: BLE001 - the test reads what it was
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "seconds": time.perf_counter() - start}


@pytest.mark.launch  # processes of its own
def test_a_rank_whose_step_raises_leaves_the_other_an_error_naming_the_step(tmp_path):
    """The rank whose update raised exits; the other, waiting for its part of the weight gather,
    got gloo's bare "Connection closed by peer" from step(), naming neither."""
    root = str(tmp_path)
    assert _spawn(one_rank_fails_in_step_case, root) == [0, 0]
    first, other = _results(root)
    assert "the update kernel failed on this rank" in first["error"], first
    assert _names_a_death(other["error"], "step()") and "raised an error of its own" in other["error"], other
    assert other["seconds"] < 30, other


# -- checkpoint calls on rank 0 only ------------------------------------------------------------
def rank0_only_case(rank: int, root: str, call: str, then: str) -> dict:
    model = make_model(seed=5)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, timeout=3)
    path = os.path.join(root, "ckpt")
    _train(model, opt, range(1))
    shardopt.save_checkpoint(path, model, opt)  # every rank: a checkpoint to load
    out: dict = {}
    start = time.perf_counter()
    try:
        if rank == 0:
            if call == "save":
                shardopt.save_checkpoint(path, model, opt)
            elif call == "load":
                shardopt.load_checkpoint(path, model, opt)
            else:
                shardopt.load_checkpoint(path, make_model(seed=6), timeout=3)
        if then == "train" or rank == 0:
            if then == "barrier":
                dist.barrier()
            else:
                _train(model, opt, range(1, 3))
        else:
            dist.barrier()
    except (RuntimeError, TimeoutError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        if then == "barrier":
            dist.barrier()  # the caller goes on to the barrier the others wait in
    out["seconds"] = time.perf_counter() - start
    if then == "barrier":  # then every rank trains on: the message left in flight is never paired silently
        try:
            _train(model, opt, range(3, 4))
        except RuntimeError as e:
            out["after"] = str(e)
    return out


@pytest.mark.launch  # processes of its own
@pytest.mark.parametrize("call,then", [("save", "train"), ("load", "train"), ("save", "barrier"),
                                       ("weights", "barrier")])
def test_a_checkpoint_call_on_rank_0_only_raises_naming_it(tmp_path, call, then):
    root = str(tmp_path)
    codes = _spawn(rank0_only_case, root, call, then, linger=True)
    assert codes == [0, 0], (codes, os.listdir(root))  # no rank killed by a signal, none hung
    got = _results(root)
    name = "save_checkpoint()" if call == "save" else "load_checkpoint()"
    assert "traceback" not in got[0] and "traceback" not in got[1], got
    assert name in got[0].get("error", ""), got[0]
    assert "every rank" in got[0]["error"], got[0]
    assert got[0]["seconds"] < 60, got[0]  # not the group's timeout
    if then == "train":  # the others meet the call with their next backward pass or step
        assert name in got[1].get("error", "") and "RuntimeError" in got[1]["error"], got[1]
        assert "RuntimeError" in got[0]["error"], got[0]
    else:  # the caller gave up after the optimizer's timeout (3 s) and went on to the barrier
        assert "TimeoutError" in got[0]["error"] and "waited 3 s" in got[0]["error"], got[0]
        assert "error" not in got[1] and got[1]["seconds"] < 60, got[1]
        assert name in got[0].get("after", ""), got[0]  # this rank's later calls refuse, naming why
        assert name in got[1].get("after", ""), got[1]  # the others meet that message with their next one


def without_default_store_case(rank: int, root: str) -> dict:
    import shardopt.comm._collectives as collectives

    collectives.default_store = lambda: None  # as on a torch that does not expose it: new_group's group
    pair = dist.new_group([0, 1])  # an optimizer over some ranks of the job (rank 2 only watches)
    if rank == 2:
        return {}
    model = make_model(seed=5)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, process_group=pair)
    _train(model, opt, range(1))
    out = {"own_group": opt._comm.control is not None}
    try:
        if rank == 0:
            shardopt.save_checkpoint(os.path.join(root, "ckpt"), model, opt)
        _train(model, opt, range(1, 3))
    except RuntimeError as e:
        out["error"] = str(e)
    return out


@pytest.mark.launch  # processes of its own
def test_without_the_default_store_the_control_group_still_keeps_the_calls_apart(tmp_path):
    root = str(tmp_path)
    assert _spawn(without_default_store_case, root, world=3, linger=True) == [0, 0, 0]  # rank 2 waits for the pair
    for rank, got in enumerate(_results(root, world=3)[:2]):
        assert got.get("own_group") and "save_checkpoint()" in got.get("error", ""), (rank, got)


# -- state-dict calls on some ranks only --------------------------------------------------------
def _torch_adamw_state(model) -> dict:
    """A plain ``torch.optim.AdamW``'s state dict over a copy of ``model``, after one step."""
    import copy

    ref = copy.deepcopy(model)
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref(batch(0, 0)).backward()
    adamw.step()
    return adamw.state_dict()


def some_ranks_case(rank: int, root: str, call: str, callers: list[int], then: str) -> dict:
    """``call`` on ``callers`` only; the others train on (``then="train"``) or wait in a barrier."""
    model = make_model(seed=5)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, timeout=2)
    _train(model, opt, range(1))
    mine, whole, plain = opt.state_dict(), opt.full_state_dict(), _torch_adamw_state(model)
    calls = {"load_state_dict": lambda: opt.load_state_dict(mine),  # this rank's shard
             "load_state_dict(adamw)": lambda: opt.load_state_dict(whole if rank == 0 else {}),
             "load_state_dict(torch)": lambda: opt.load_state_dict(plain),
             "consolidate_state_dict": opt.consolidate_state_dict, "full_state_dict": opt.full_state_dict,
             "load_full_state_dict": lambda: opt.load_full_state_dict(whole),
             "refresh_master_weights": opt.refresh_master_weights}
    out: dict = {}
    start = time.perf_counter()
    try:
        if rank in callers:
            calls[call]()
        if then == "train":
            _train(model, opt, range(1, 3))
        else:
            dist.barrier()
    except (RuntimeError, TimeoutError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        if then == "barrier":
            dist.barrier()  # the callers go on to the barrier the others wait in
    out["seconds"] = time.perf_counter() - start
    if then == "barrier":  # then every rank trains on
        try:
            _train(model, opt, range(3, 4))
        except RuntimeError as e:
            out["after"] = str(e)
    return out


SOME_RANKS = [("load_state_dict", (0,), "train"), ("load_state_dict(adamw)", (0,), "train"),
              ("load_state_dict(torch)", (0,), "train"), ("load_state_dict", (1, 2), "train"),
              ("load_state_dict", (0,), "barrier"), ("consolidate_state_dict", (0,), "train"),
              ("full_state_dict", (0,), "train"), ("load_full_state_dict", (0,), "train"),
              ("refresh_master_weights", (0,), "train")]


@pytest.mark.launch  # processes of its own
@pytest.mark.parametrize("call,callers,then", SOME_RANKS)
def test_a_state_dict_call_on_some_ranks_only_raises_naming_it(tmp_path, call, callers, then):
    """``load_state_dict`` on rank 0 only (or on ranks 1 and 2 of 3) used to abort rank 0 (gloo:
    "Received data size doesn't match"); against a barrier its TimeoutError named "a backward or
    forward pass". Each every-rank call of the optimizer must raise naming itself."""
    root, world = str(tmp_path), max(WORLD, max(callers) + 1)
    codes = _spawn(some_ranks_case, root, call, list(callers), then, linger=True, world=world, timeout=90)
    assert codes == [0] * world, (codes, os.listdir(root))  # no rank killed by a signal, none hung
    got = _results(root, world)
    name = call.partition("(")[0] + "()"
    for rank, r in enumerate(got):
        assert "traceback" not in r, (rank, r)
        if then == "train":  # the others meet the call with their next backward pass
            assert "RuntimeError" in r.get("error", "") and name in r["error"], (rank, r)
            assert r["seconds"] < 30, (rank, r)
        elif rank in callers:  # gave up after the optimizer's timeout (2 s), naming the call
            assert "TimeoutError" in r.get("error", "") and f"{name} waited 2 s" in r["error"], (rank, r)
            assert "a backward or forward pass" not in r["error"], (rank, r)
        else:
            assert "error" not in r and r["seconds"] < 30, (rank, r)
        if then == "barrier":  # every rank's next optimizer call refuses, naming the call given up on
            assert name in r.get("after", ""), (rank, r)
        if rank in callers:
            assert "every rank" in r["error"], (rank, r)


# -- deadlines: what a rank waits is what it says, and a late rank meets no stale message ---------
def weights_only_deadline_case(rank: int, root: str) -> dict:
    model = make_model(seed=5)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, range(1))
    path = os.path.join(root, "ckpt")
    shardopt.save_checkpoint(path, model, opt)
    out: dict = {}
    start = time.perf_counter()
    try:
        if rank == 0:
            shardopt.load_checkpoint(path, make_model(seed=6), timeout=4)
        else:
            dist.barrier()  # gives up after the group's timeout (2 s)
    except (RuntimeError, TimeoutError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.perf_counter() - start
    return out


@pytest.mark.launch  # processes of its own
def test_a_weights_only_load_waits_the_time_it_names(tmp_path):
    """A weights-only ``load_checkpoint`` on rank 0 only, with a deadline longer than the group's
    timeout: it gave up after the group's 2 s but said it had waited its 4."""
    root = str(tmp_path)
    assert _spawn(weights_only_deadline_case, root, linger=True, group_timeout=2) == [0, 0]
    got = _results(root)[0]
    assert "TimeoutError" in got.get("error", "") and "load_checkpoint() waited 4 s" in got["error"], got
    assert 3.9 <= got["seconds"] < 15, got


def late_rank_case(rank: int, root: str) -> dict:
    model = make_model(seed=5)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, range(1))
    out: dict = {}
    if rank == 1:
        time.sleep(2)  # arrives after rank 0 gave up
    start = time.perf_counter()
    try:
        shardopt.save_checkpoint(os.path.join(root, "ckpt"), model, opt, timeout=0.5 if rank == 0 else 10)
    except (RuntimeError, TimeoutError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.perf_counter() - start
    return out


@pytest.mark.launch  # processes of its own
def test_a_rank_late_to_a_call_another_gave_up_on_raises_naming_it(tmp_path):
    """Rank 0 gives up on ``save_checkpoint`` after 0.5 s; rank 1 arrives 2 s later. Its entry
    message used to pair with the one rank 0 had left in flight: it went on into the save and
    waited there for a rank that had left."""
    root = str(tmp_path)
    assert _spawn(late_rank_case, root, linger=True, timeout=40) == [0, 0]
    first, late = _results(root)
    assert "TimeoutError" in first.get("error", "") and "save_checkpoint() waited 0.5 s" in first["error"], first
    assert "RuntimeError" in late.get("error", "") and "save_checkpoint()" in late["error"], late
    assert "rank 0 gave up waiting 0.5 s for the other ranks in save_checkpoint()" in late["error"], late
    assert late["seconds"] < 5, late  # at once, not after its own 10 s
    assert not [n for n in os.listdir(root) if n.startswith("ckpt")], os.listdir(root)  # nothing was written
