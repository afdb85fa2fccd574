"""The only module that calls ``torch.distributed``.

Every collective here is issued asynchronously and returns a :class:`Pending` that the caller
waits on explicitly; a handle is waited exactly once. Backend differences stay here:

[Note: all-gather on gloo]
gloo's native ``all_gather_into_tensor`` is 1.6-2.6x slower than one asynchronous broadcast per
rank into that rank's slice of the output, and cannot take uneven pieces. Broadcasting each
rank's piece in place also needs no staging: the owner's piece already sits in the output.
NCCL takes an in-place ``all_gather_into_tensor`` when pieces are equal, else the same
per-rank broadcasts.
"""
from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from shardopt._layout import Range

ProcessGroup = Any  # torch.distributed.ProcessGroup; None means the default group


@dataclass
class Pending:
    """Handles of collectives in flight, plus tensors that must stay alive until they finish."""

    works: list = field(default_factory=list)
    keep_alive: list = field(default_factory=list)
    done: bool = False

    def wait(self) -> None:
        assert not self.done, "a collective handle was waited twice"
        for w in self.works:
            w.wait()
        self.done = True
        self.works.clear()
        self.keep_alive.clear()


class Comm:
    """A process group with its rank and size, and the collectives shardopt needs."""

    def __init__(self, process_group: ProcessGroup = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "shardopt needs torch.distributed initialised: launch with torchrun and call "
                "torch.distributed.init_process_group() (gloo on CPU, nccl on GPU) before "
                "building the optimizer"
            )
        self.group = process_group
        self.rank: int = dist.get_rank(process_group)
        self.world_size: int = dist.get_world_size(process_group)
        self.backend: str = str(dist.get_backend(process_group))
        self._global = [dist.get_global_rank(process_group, r) if process_group is not None else r
                        for r in range(self.world_size)]

    # -- small collectives ---------------------------------------------------------------
    def all_reduce_sum(self, t: Tensor) -> Pending:
        """In-place SUM of ``t`` over the group. Call on every rank."""
        return Pending([dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)])

    def all_reduce_max(self, t: Tensor) -> Pending:
        """In-place MAX of ``t`` over the group. Call on every rank."""
        return Pending([dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)])

    def broadcast(self, t: Tensor, src: int = 0) -> Pending:
        """Broadcast ``t`` in place from group rank ``src``. Call on every rank."""
        return Pending([dist.broadcast(t, src=self._global[src], group=self.group, async_op=True)])

    def all_gather_objects(self, obj: object) -> list:
        """Every rank's picklable ``obj``, in rank order (blocking; small objects, rare paths).

        Unlike ``dist.all_gather_object`` this needs no NumPy."""
        data = pickle.dumps(obj)
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8, device=device)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        everything = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everything, mine, group=self.group)
        return [pickle.loads(bytes(t[: int(n)].cpu().tolist())) for t, n in zip(everything, sizes)]

    def same_everywhere(self, description: Sequence[object], device: torch.device) -> bool:
        """True on every rank when ``description`` is equal on all ranks: one small all-gather."""
        digest = hashlib.sha256(repr(list(description)).encode()).digest()
        mine = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=self.group)
        return all(bool((g == mine).all()) for g in gathered)

    # -- bucket collectives --------------------------------------------------------------
    def all_reduce_avg(self, bucket: Tensor) -> Pending:
        """Average ``bucket`` over ranks, in place. Call on every rank, same order."""
        return Pending([dist.all_reduce(bucket, op=dist.ReduceOp.AVG, group=self.group, async_op=True)])

    def reduce_scatter_avg(self, out: Tensor, bucket: Tensor, pieces: Sequence[Range]) -> Pending:
        """Average ``bucket`` over ranks; this rank's piece lands in ``out``.

        ``pieces[r]`` is rank r's range relative to the start of ``bucket`` (uneven and empty
        pieces allowed; together they tile the bucket). ``out`` has this rank's piece size.
        """
        inputs = [bucket[p.as_slice()] for p in pieces]
        work = dist.reduce_scatter(out, inputs, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        return Pending([work], keep_alive=[bucket, out])

    def all_gather_inplace(self, flat: Tensor, pieces: Sequence[Range]) -> Pending:
        """Fill ``flat`` with every rank's piece, in place; ``pieces[r]`` is rank r's range of
        ``flat``, already holding that rank's data on rank r. Call on every rank."""
        sizes = {p.size for p in pieces}
        contiguous = all(pieces[r].end == pieces[r + 1].start for r in range(len(pieces) - 1))
        if self.backend == "nccl" and len(sizes) == 1 and contiguous:
            whole = flat[pieces[0].start:pieces[-1].end]
            mine = flat[pieces[self.rank].as_slice()]
            return Pending([dist.all_gather_into_tensor(whole, mine, group=self.group, async_op=True)])
        works = [
            dist.broadcast(flat[p.as_slice()], src=self._global[r], group=self.group, async_op=True)
            for r, p in enumerate(pieces)
            if p.size > 0
        ]
        return Pending(works, keep_alive=[flat])
