"""A pool of real gloo ranks for tests: spawned once, then many cases run inside it.

``DistPool(world_size).run(fn, *args)`` calls the module-level function ``fn`` on every rank at
once and returns the per-rank results. A rank that raises has its traceback re-raised here with
its rank number; ranks that do not answer within the timeout (a hang) fail the test, and the pool
is torn down so the next test starts a fresh one.
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


def _worker(rank: int, world_size: int, store_path: str, inq: Any, outq: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
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
        self.broken = True
        for q in self._inqs:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        self._dir.cleanup()


class PoolCache:
    """Per-module cache of pools by world size; a broken pool is replaced on next use."""

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
