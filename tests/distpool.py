"""A pool of real gloo ranks for tests: spawned once, then many cases run inside it.

``DistPool(world_size).run(fn, *args)`` calls the module-level function ``fn`` on every rank at
once and returns the per-rank results. A rank that raises has its traceback re-raised here with
its rank number; ranks that do not answer within the timeout (a hang) fail the test, and the pool
is torn down so the next test starts a fresh one.

[Note: pools shared by the modules] Spawning ranks is the slow part (about 3 s for two ranks and
6 s for four on two cores, each importing torch), so one pool per world size serves every module
of a session (``SharedPools``). Between modules each rank is put back as a fresh one would be
(``fresh_rank``): the environment as the rank started with it, torch's default random generator
reseeded, dynamo's compiled code dropped (the disk caches make recompiling cheap), garbage collected; a pool whose ranks cannot be (shardopt's control group broken on some
rank by a test of timeouts, a rank that failed) is torn down and the module gets a new one.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable


class RankError(AssertionError):
    pass


_START_ENV: dict[str, str] = {}  # a rank's environment when it started (see fresh_rank)
_START_SEED: list[int] = []  # torch's default seed when it started


def fresh_rank() -> bool:
    """On every rank, between two modules (see [Note: pools shared by the modules]): put this rank
    back as it started. False when it cannot be (shardopt's control group is broken here)."""
    import gc

    import torch

    for key in set(os.environ) - set(_START_ENV):
        del os.environ[key]
    os.environ.update(_START_ENV)
    gc.collect()
    torch._dynamo.reset()  # compiled kernels count towards dynamo's recompile limit per function
    torch.manual_seed(_START_SEED[0])
    torch.set_grad_enabled(True)
    try:
        from shardopt.comm import _collectives
    except ImportError:
        return True
    return not any(c.broken for c in _collectives._CONTROL.values())


def _worker(rank: int, world_size: int, store_path: str, inq: Any, outq: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    _START_ENV.update(os.environ)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _START_SEED.append(torch.initial_seed())
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=90))
    while True:
        item = inq.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            outq.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything, including DCP's BaseException
            outq.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


_FIRST_RANKS: dict[int, Any] = {}  # by size: a group of the pool's first ranks (see in_first_ranks)


def in_first_ranks(world: int, fn: Callable[..., Any], *args: Any) -> Any:
    """On every rank of a pool: ``fn(group, *args)`` on its first ``world`` ranks, in a process
    group of theirs made once (``new_group`` is collective: every rank calls this, in the same
    order); None on the others. So one pool serves several world sizes."""
    import torch.distributed as dist

    if world not in _FIRST_RANKS:
        _FIRST_RANKS[world] = dist.new_group(list(range(world)))
    return fn(_FIRST_RANKS[world], *args) if dist.get_rank() < world else None


class DistPool:
    """``world_size`` spawned processes joined in one gloo process group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory()
        store = os.path.join(self._dir.name, "store")
        self._inqs = [ctx.Queue() for _ in range(world_size)]
        self._outq = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, store, self._inqs[r], self._outq), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 180.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; returns the results in rank order."""
        assert not self.broken, "pool is broken; make a new one"
        for q in self._inqs:
            q.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(failures) < self.world_size:
            remaining = deadline - time.monotonic()
            if failures:
                remaining = min(remaining, 5.0)  # peers of a failed rank may be stuck in a collective
            try:
                rank, ok, payload = self._outq.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                break
            (results if ok else failures)[rank] = payload
        missing = sorted(set(range(self.world_size)) - set(results) - set(failures))
        if failures or missing:
            self.close()
            msg = [f"--- rank {r} raised:\n{tb}" for r, tb in sorted(failures.items())]
            if missing:
                msg.append(f"--- ranks {missing} did not finish within {timeout:.0f}s (hang or crash)")
            raise RankError(f"{fn.__name__} failed\n" + "\n".join(msg))
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the ranks: they hold nothing worth a clean shutdown (tearing the gloo group down took
        1-2 s per pool, and a rank stuck in a collective never would), so they are killed."""
        self.broken = True
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join()
        self._dir.cleanup()


class PoolCache:
    """Pools by world size; a broken pool is replaced on next use."""

    def __init__(self) -> None:
        self._pools: dict[int, DistPool] = {}

    def __call__(self, world_size: int) -> DistPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = DistPool(world_size)
        return pool

    def close(self) -> None:
        for p in self._pools.values():
            if not p.broken:
                p.close()
        self._pools.clear()


class ModulePools:
    """One module's view of the session's pools (see [Note: pools shared by the modules]): the
    first use of a world size in the module puts that pool's ranks back as fresh ones, or replaces
    the pool when they cannot be."""

    def __init__(self, shared: PoolCache) -> None:
        self._shared = shared
        self._ready: set[int] = set()

    def __call__(self, world_size: int) -> DistPool:
        pool = self._shared(world_size)
        if world_size not in self._ready:
            self._ready.add(world_size)
            try:
                healthy = all(pool.run(fresh_rank, timeout=60))
            except RankError:
                healthy = False
            if not healthy:
                pool.close()
                pool = self._shared(world_size)
        return pool
