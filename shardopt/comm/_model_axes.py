"""The ranks beyond the data-parallel group that hold the rest of the same model.

Beside tensor, pipeline and expert parallelism one optimizer's data-parallel group holds only
part of the model: the other tensor-parallel shards, the other pipeline stages sit on other
ranks. The clip norm, the inf/NaN skip (with the fp16 loss scale) and the every-rank call
agreement are decisions about the whole model, so they must span those ranks too. This module
owns the *model axes*: each a process group of ranks that hold other parts of the model (one
rank per part, with the same data-parallel position), from ``model_parallel_group=`` and from the
meshes of DTensor parameters.

[Note: the whole model's agreement]
The step's message is first all-reduced over the data-parallel group, as without model axes
(``_step_agreement``), and every check of it runs there. Then a *follow-up* of the reduced inf/NaN
count, the norm's sum (or max) and which call the ranks are in is all-reduced over each model axis
in turn, on a control group of the axis's own (see _collectives [Note: shardopt's own control
group]). The axes and the data-parallel group form a grid (each pair meets in this rank only,
checked at construction), so the sum over the data-parallel group and then over each axis is the
sum over every rank of the job, each rank counted once. A parameter replicated across an axis (a
Replicate placement, a plain parameter beside DTensors, ``"replicated": True``) counts in the
norm on that axis's rank 0 only, so it is counted once; the inf/NaN count counts every copy (more
copies of an inf are still an inf). It also sums the backward passes by how they were started,
so that every stage takes the loss scale the last stage's ``opt.backward(loss)`` applied (see
step._usage_checks [Note: the loss scale a gradient carries]). Every rank then reads the same
totals: one skip, one clip coefficient, one loss scale for the whole model. The follow-up also
counts the ranks in each call:
ranks of one model in different calls (one in ``clip_grad_norm_``, the other in ``step``) raise
on every rank; one that is in no call of the optimizer at all (still in its backward pass) leaves
the others waiting, up to the optimizer's ``timeout`` (or the group's).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from shardopt.comm._collectives import Comm, CommStats, ProcessGroup, global_rank, group_ranks, is_process_group


@dataclass
class ModelAxis:
    """One group of ranks that hold other parts of the model: ``name`` for messages and
    checkpoints, its ``group``, its global ``ranks``, this rank's place in it; ``comm`` (its
    control group, see _collectives) once the optimizer's ranks agreed on the axes (``connect``)."""

    name: str
    group: ProcessGroup
    ranks: tuple[int, ...]
    comm: Comm | None = None

    @property
    def rank(self) -> int:
        return self.ranks.index(global_rank())

    @property
    def size(self) -> int:
        return len(self.ranks)

    def connected(self) -> Comm:
        """Its comm; raises when asked before ``ModelAxes.connect``."""
        if self.comm is None:
            raise AssertionError(f"model axis {self.name!r} used before its ranks connected")
        return self.comm


def axis_groups(model_parallel_group: Any) -> list[tuple[str, ProcessGroup]]:
    """(name, process group) of each axis of ``model_parallel_group``: a ProcessGroup is one axis
    ("mp"), a DeviceMesh one per dimension (named by its ``mesh_dim_names``, else "mp0", ...).
    Local."""
    if model_parallel_group is None:
        return []
    if hasattr(model_parallel_group, "get_group") and hasattr(model_parallel_group, "ndim"):
        names = getattr(model_parallel_group, "mesh_dim_names", None) or \
            tuple(f"mp{d}" for d in range(model_parallel_group.ndim))
        return [(str(names[d]), model_parallel_group.get_group(d)) for d in range(model_parallel_group.ndim)]
    if not is_process_group(model_parallel_group):
        raise TypeError(f"model_parallel_group must be a torch.distributed ProcessGroup or a DeviceMesh (the ranks "
                        f"that hold the other pipeline stages or tensor-parallel shards), got "
                        f"{type(model_parallel_group).__name__}")
    return [("mp", model_parallel_group)]


class ModelAxes:
    """Every model axis of one optimizer, in the order they are reduced over, and the agreement
    over them (see [Note: the whole model's agreement]). Built from the groups alone (no
    communication); ``connect`` makes each axis's control group."""

    def __init__(self, groups: Sequence[tuple[str, ProcessGroup]], data: Comm) -> None:
        self.axes: list[ModelAxis] = []
        seen: dict[tuple[int, ...], str] = {}
        for name, group in groups:  # a mesh named twice (model_parallel_group and DTensor parameters) is one axis
            ranks = tuple(group_ranks(group))
            if ranks in seen:
                continue
            while name in seen.values():
                name += "'"
            seen[ranks] = name
            self.axes.append(ModelAxis(name, group, ranks))
        self._check_grid(data)

    def connect(self, timeout: float | None, stats: CommStats | None = None) -> list[ModelAxis]:
        """Make each axis's control group, waiting at most ``timeout`` seconds (None: the group's
        own timeout) for its other ranks to connect; its messages then wait as long, counted in
        ``stats`` (the optimizer's, so that its counters show every message of a step). Returns the
        axes whose ranks did not all connect, from the first (this rank cannot agree with them: the
        caller raises). Every rank of every axis, at the same point (after the optimizer's own
        ranks agreed)."""
        for i, a in enumerate(self.axes):
            try:
                a.comm = Comm(a.group, connect=timeout)
            except TimeoutError:
                return self.axes[i:]
            a.comm.timeout = timeout
            if stats is not None:
                a.comm.stats = stats
        return []

    def name_of(self, group: ProcessGroup) -> str:
        """The name of the axis over the ranks of ``group``. Local."""
        ranks = tuple(group_ranks(group))
        return next(a.name for a in self.axes if a.ranks == ranks)

    def _check_grid(self, data: Comm) -> None:
        """Each axis meets the data-parallel group and every other axis in this rank only. Local."""
        me = global_rank()
        sets = [("the optimizer's data-parallel group", set(group_ranks(data.data_group)))]
        sets += [(f"model axis {a.name!r}", set(a.ranks)) for a in self.axes]
        for i, (na, a) in enumerate(sets):
            for nb, b in sets[i + 1:]:
                if a & b != {me}:
                    raise ValueError(f"rank {me}: {nb} (ranks {sorted(b)}) and {na} (ranks {sorted(a)}) share ranks "
                                     f"{sorted(a & b - {me})} besides this one; model_parallel_group (and the meshes "
                                     "of DTensor parameters) must hold the ranks with the other parts of the model, "
                                     "one per part and none of this rank's data-parallel group: e.g. for a "
                                     "(dp, tp) DeviceMesh pass device_mesh=mesh['dp'] and model_parallel_group="
                                     "mesh['tp']")

    def __bool__(self) -> bool:
        return bool(self.axes)

    @property
    def size(self) -> int:
        """Ranks that hold one part each of the model with this data-parallel position."""
        return math.prod(a.size for a in self.axes)

    def counts(self, replicated_over: frozenset[str]) -> bool:
        """Whether this rank counts, in the norm, parameters replicated across the axes named
        ``replicated_over``: only each such axis's rank 0 does. Local."""
        return all(a.rank == 0 for a in self.axes if a.name in replicated_over)

    def reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        """``t`` (a small CPU tensor) summed (or maxed) over every rank of the job: over each axis
        in turn, on its control group. Every rank of the job."""
        for a in self.axes:
            a.connected().control_all_reduce(t, op).wait()

    @contextlib.contextmanager
    def during(self, where: str) -> Iterator[None]:
        """Name ``where`` in the timeout message of the follow-ups waited for inside (``Comm.during``)."""
        with contextlib.ExitStack() as stack:
            for a in self.axes:
                stack.enter_context(a.connected().during(where))
            yield

    def describe(self) -> str:
        """e.g. ``"tp 2 x pp 2 (this rank: tp 1, pp 0)"``. Local."""
        return " x ".join(f"{a.name} {a.size}" for a in self.axes) + \
            " (this rank: " + ", ".join(f"{a.name} {a.rank}" for a in self.axes) + ")"
