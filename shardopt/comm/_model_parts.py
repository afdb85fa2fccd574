"""Which ranks hold which part of the model: one optimizer's view of tensor, pipeline and expert
parallelism, settled at construction.

Owns, for one optimizer: its model axes (``model_parallel_group=`` and the meshes of DTensor
parameters, see _model_axes), the Comm over every rank of the job that checkpoints use, the Comm
of each param group with its own ``"process_group"`` (expert parallelism), the plain stand-in of
each DTensor parameter (see core._dtensor), which axes each parameter is a copy across, and the
checkpoint key prefix of each expert group's parameters. The optimizer asks; nothing here changes
after construction.

[Note: param groups with their own data-parallel group]
Expert parallelism: each expert is held by a few ranks of the optimizer's group (its expert
data-parallel group), the dense parameters by all. A param group with its own ``"process_group"``
is laid out in flat buffers of its own, sharded, reduced and gathered over that group only. Its
gradient is the sum over that group divided by the optimizer's data-parallel size
(``FlatGroup.grad_factor``): the gradient of the mean loss over all the optimizer's ranks, as
for the dense parameters (Megatron's expert-gradient scaling), whether a rank's tokens reached the
expert through an all-to-all or the expert only sees its own ranks'. The clip norm sums every
rank's shards over the optimizer's group, so each expert counts once. Its checkpoint keys carry
the group's place among the groups of that param group (``"pg1-0/experts.0.weight"``, see
checkpoint), so experts that share a name on different ranks stay apart; such a checkpoint loads
at the same expert layout.

[Note: a part is named by its ranks]
A checkpoint keys each part of a model split over ``model_parallel_group=`` by this rank's place
among the ranks that hold one copy of the model: the grid its keyed axes span through it, as
global ranks, sorted (``"mp0/"``, ``"mp1/"``, ...). The key depends on the ranks alone, never on
how the axes are named or in which order they are passed: ``mesh["tp"]`` and
``mesh["tp"].get_group()`` give one key, as do a ``(pp, tp)`` mesh and one group over its ranks.
For one axis the place is the rank in its group (a ProcessGroup's parts keep the keys they always
had); for a row-major ``(pp, tp)`` mesh it is ``pp * tp_size + tp``; the data-parallel positions
of one part share it, since the grid repeats along the data-parallel group. The ranks alone cannot
tell which axis is which, though: beside each part a checkpoint records its axes (name, position,
size; the axis whose ranks lie farthest apart first), and a load refuses a checkpoint of another
number of parts, of as many axes of other sizes, or whose axes of the same names put this rank
elsewhere (``pp`` and ``tp`` swapped over the same ranks).

[Note: ranks that built the optimizer differently]
The data-parallel ranks agree on their settings, the model axes among them, before any group of
the model axes is connected (``connect``): ranks of one data-parallel group that differ in
``model_parallel_group`` raise there, on every one of them. Ranks at different positions of a
model axis meet in no group of shardopt's until that axis's control group connects, so a rank
that passed ``model_parallel_group`` where its peers on the axis did not waits there, at most the
optimizer's ``timeout`` (else the group's), and then raises. To say why, each rank leaves one line
in the default store at construction, the axes its latest optimizer holds (``_BUILT``), and the
rank that gave up reads its peers' lines: a peer whose latest optimizer holds no axis over these
ranks is named (ValueError), else the peers that built none (TimeoutError). The peers that did not
pass it cannot be told: they hold no group with this rank, and go on until the model's own
collectives with the ranks that raised fail (or the launcher ends the job).
"""
from __future__ import annotations

import ast
import itertools
from typing import Any, NoReturn, Sequence

from torch import Tensor
from torch.nn import Parameter

from shardopt.comm._collectives import Comm, global_rank, group_ranks, is_process_group, leave_line, read_line, world_size
from shardopt.comm._model_axes import ModelAxes, ModelAxis, axis_groups
from shardopt.core._dtensor import axis_name, check_placements, is_dtensor, mesh_of, replicated, stand_in

_BUILT = "shardopt-built/{rank}"  # the store key of the model axes a rank's latest optimizer holds


class ModelParts:
    """Built on every rank at the optimizer's construction, in the same order: ``param_groups``
    (torch's), ``names`` (how messages name each parameter, by ``id``), the optimizer's
    data-parallel ``comm``, ``model_parallel_group=`` and the optimizer's ``timeout`` (seconds or
    None). Building it is local; ``connect``, once the data-parallel ranks agreed on the settings
    (the model axes among them), makes the process groups of its own."""

    def __init__(self, param_groups: Sequence[dict[str, Any]], names: dict[int, str], comm: Comm,
                 model_parallel_group: Any, timeout: float | None) -> None:
        self.comm, self.timeout = comm, timeout
        dtensors = [p for g in param_groups for p in g["params"] if is_dtensor(p)]
        for p in dtensors:
            check_placements(p, names[id(p)])
        given = axis_groups(model_parallel_group)
        self.axes = ModelAxes(given + [(axis_name(p), mesh_of(p).get_group()) for p in dtensors], comm)
        self.user_axes = frozenset(self.axes.name_of(g) for _, g in given)  # model_parallel_group's
        self.dtensor_axes = frozenset(self.axes.name_of(mesh_of(p).get_group()) for p in dtensors)
        # Every rank of the job (the default group), for checkpoints: made at connect, where every rank
        # is, when the data-parallel group and the axes cover the default group (see checkpoint._job)
        self.job: Comm | None = None
        self.place, self.places = 0, 1  # (at connect)
        self._own = self._own_groups(param_groups)  # by param group index, its own process group
        self.group_comms: dict[int, Comm] = {}  # by param group index, the Comm of its own group (at connect)
        self.dtensor_of: dict[int, Tensor] = {}  # by id of a stand-in, the DTensor parameter it stands in for
        self._stand_in: dict[int, Tensor] = {}  # by id of a DTensor parameter, its stand-in
        self.key_prefix: dict[int, str] = {}  # by id of an expert group's parameter, its checkpoint key prefix
        leave_line(_BUILT.format(rank=global_rank()), repr(self._axes_held()))

    def _axes_held(self) -> list[tuple[str, tuple[int, ...], bool]]:
        """(name, global ranks, given as model_parallel_group) of each model axis: what this rank
        leaves in the store for the others' messages (see ``connect``). Local."""
        return [(a.name, a.ranks, a.name in self.user_axes) for a in self.axes.axes]

    def connect(self) -> None:
        """Make the control groups of the model axes, of every rank of the job (checkpoints) and of
        each param group's own process group, each waiting at most the optimizer's ``timeout`` for
        its other ranks. An axis whose ranks did not all connect raises on this rank, naming what
        the others built instead (see [Note: ranks that built the optimizer differently]). Every
        rank, at the same point: after the data-parallel ranks agreed on the settings."""
        failed = self.axes.connect(self.timeout, self.comm.stats)
        if failed:
            self._not_connected(failed[0])
        # this rank's place among the ranks that hold one copy of the model on the axes a checkpoint
        # keys by, and how many they are (see [Note: a part is named by its ranks])
        self.place, self.places = self._place()
        if self.axes and self.comm.world_size * self.axes.size == world_size():
            self.job = Comm(None, connect=self.timeout)
            self.job.timeout = self.timeout
        made: dict[tuple[int, ...], Comm] = {}
        for gi, pg in self._own.items():
            ranks = tuple(group_ranks(pg))
            if ranks not in made:
                made[ranks] = Comm(pg, connect=self.timeout)
                made[ranks].timeout = self.timeout
            self.group_comms[gi] = made[ranks]

    def _not_connected(self, axis: ModelAxis) -> NoReturn:
        """Raise for model axis ``axis``, whose other ranks did not connect within the timeout:
        ValueError naming the ranks whose latest optimizer holds no axis over these ranks, else
        TimeoutError naming the ranks that built none (see [Note: ranks that built the optimizer
        differently]). Local."""
        me = global_rank()
        how = "passed model_parallel_group" if axis.name in self.user_axes else "holds DTensor parameters on a mesh"
        waited = f"{self.timeout:g} s" if self.timeout is not None else "the process group's timeout"
        without, silent = [], []
        for r in axis.ranks:
            line = read_line(_BUILT.format(rank=r)) if r != me else ""
            if line is None:
                silent.append(r)
            elif line and all(ranks != axis.ranks for _, ranks, _ in ast.literal_eval(line)):
                without.append(r)
        over = f"(axis {axis.name!r}, ranks {list(axis.ranks)})"
        if without:
            raise ValueError(
                f"rank {me} {how} {over}, rank {without[0]} did not: its latest optimizer was built without a model "
                f"axis over these ranks{f' (so were ranks {without[1:]})' if without[1:] else ''}. Every rank of "
                "model_parallel_group must pass it (the same group, or the same DeviceMesh) to its optimizer, so that "
                f"the clip norm, the skip and checkpoints span the whole model (this rank waited {waited} for it)")
        raise TimeoutError(
            f"rank {me} {how} {over}, and ranks {silent or 'of it'} did not build their optimizer with it within "
            f"{waited}: every rank of the axis must build its optimizer at the same point, with the same "
            "model_parallel_group; where one rank legitimately arrives later, pass a larger timeout=")

    def _own_groups(self, param_groups: Sequence[dict[str, Any]]) -> dict[int, Any]:
        """By index, the ``"process_group"`` of each param group that has its own, checked. Local."""
        out: dict[int, Any] = {}
        mine = set(self.comm.global_ranks)
        for gi, g in enumerate(param_groups):
            pg = g.get("process_group")
            if pg is None:
                continue
            if not is_process_group(pg):
                raise TypeError(f"param group {gi}'s process_group must be a torch.distributed ProcessGroup (the "
                                f"ranks that hold its parameters, e.g. an expert's data-parallel group), got "
                                f"{type(pg).__name__}")
            ranks = tuple(group_ranks(pg))
            if not set(ranks) <= mine:
                raise ValueError(f"param group {gi}'s process_group holds ranks {sorted(set(ranks) - mine)} outside "
                                 f"the optimizer's group {sorted(mine)}: a param group's own group is the part of "
                                 "the optimizer's data-parallel ranks that hold its parameters")
            out[gi] = pg
        return out

    def __bool__(self) -> bool:
        """Whether the ranks hold different parts of the model (model axes or expert groups)."""
        return bool(self.axes) or bool(self._own)

    def settle(self, trainable: Sequence[tuple[Parameter, int]], names: dict[int, str]) -> list[tuple[Parameter, int]]:
        """Once the ranks agreed on ``trainable`` ((parameter, group index) pairs): the pairs the
        flat buffers are built from, each DTensor parameter replaced by its plain stand-in (named
        as it is in ``names``), and each expert group's key prefix. Every rank (one small gather
        when some param group has its own process group)."""
        out = []
        for p, gi in trainable:
            if is_dtensor(p):
                s = stand_in(p)
                self.dtensor_of[id(s)], self._stand_in[id(p)] = p, s
                names[id(s)] = names[id(p)]
                out.append((s, gi))
            else:
                out.append((p, gi))
        self.key_prefix = self._key_prefixes(trainable)
        return out

    def stand_ins(self) -> dict[int, Tensor]:
        """By id of each DTensor parameter, its stand-in (what ``take_over`` holds weakly in its place)."""
        return dict(self._stand_in)

    def _key_prefixes(self, trainable: Sequence[tuple[Tensor, int]]) -> dict[int, str]:
        """By ``id`` of each parameter of a param group with its own process group, its checkpoint
        key prefix ``"pg<group index>-<k>/"``: k numbers that group's distinct sets of ranks over
        the optimizer's ranks (see [Note: param groups with their own data-parallel group]). Every rank."""
        if not self.group_comms:
            return {}
        mine = {gi: tuple(c.global_ranks) for gi, c in self.group_comms.items()}
        every = self.comm.all_gather_objects(mine)
        place = {gi: sorted({e[gi] for e in every if gi in e}).index(ranks) for gi, ranks in mine.items()}
        return {id(p): f"pg{gi}-{place[gi]}/" for p, gi in trainable if gi in place}

    def group_comm(self, gi: int) -> Comm:
        """The Comm param group ``gi``'s parameters are sharded over."""
        return self.group_comms.get(gi, self.comm)

    def counted(self, p: Tensor, group: dict[str, Any]) -> bool:
        """Whether this rank counts ``p`` (a plain parameter or a DTensor's stand-in, of param group
        ``group``) in the gradient's norm: a copy across an axis counts on its rank 0 only."""
        return self.axes.counts(self.replicated_over(p, group))

    def replicated_over(self, p: Tensor, group: dict[str, Any]) -> frozenset[str]:
        """The model axes ``p`` (a plain parameter or a DTensor's stand-in) is a copy across (see
        _model_axes): a DTensor's mesh when its placement is Replicate; for a plain parameter the
        meshes of the DTensor parameters beside it; every axis of ``model_parallel_group`` for a
        param group marked ``"replicated": True``, the axes it names for ``"replicated": [names]``
        (see ``check_replicated``)."""
        dt = self.dtensor_of.get(id(p))
        if dt is not None:
            over = {self.axes.name_of(mesh_of(dt).get_group())} if replicated(dt) else set()
        else:
            over = set(self.dtensor_axes)
        marked = group.get("replicated")
        if marked is True:
            over |= self.user_axes
        elif isinstance(marked, (str, list, tuple)):
            over |= {marked} if isinstance(marked, str) else set(marked)
        return frozenset(over)

    def check_replicated(self, group: dict[str, Any], gi: int) -> None:
        """Raise for param group ``gi``'s ``"replicated"`` key unless it is absent, True, False, or
        names axes of ``model_parallel_group`` (a name or a list of names). Local."""
        marked = group.get("replicated")
        if marked is None or isinstance(marked, bool):
            return
        names = [marked] if isinstance(marked, str) else list(marked) if isinstance(marked, (list, tuple)) else None
        if names is None or not all(isinstance(n, str) for n in names):
            raise TypeError(f'param group {gi} has "replicated": {marked!r}; pass True (a copy on every rank of '
                            "model_parallel_group), False (a part on each), or the names of the axes of "
                            "model_parallel_group it is a copy across")
        unknown = sorted(set(names) - self.user_axes)
        if unknown:
            raise ValueError(f'param group {gi} has "replicated": {marked!r}, but model_parallel_group has no axis '
                             f"named {', '.join(map(repr, unknown))}; its axes are {sorted(self.user_axes)} (a "
                             "DeviceMesh's mesh_dim_names; 'mp' for a process group)")

    def _keyed_axes(self) -> list[ModelAxis]:
        """The axes of ``model_parallel_group`` that no DTensor mesh names (those whose parts a
        checkpoint cannot place in a whole tensor), the one whose ranks lie farthest apart first:
        an order that the ranks alone give, whatever the axes are called or the order they are
        passed in (see [Note: a part is named by its ranks]). Local."""
        keyed = [a for a in self.axes.axes if a.name in self.user_axes and a.name not in self.dtensor_axes]
        return sorted(keyed, key=lambda a: -_stride(a.ranks))

    def _place(self) -> tuple[int, int]:
        """(this rank's place among the global ranks, sorted, that hold one copy of the model on the
        keyed axes; how many they are). Every rank of the job: one small gather per keyed axis when
        there are two or more (one axis's ranks are its group's)."""
        keyed = self._keyed_axes()
        if not keyed:
            return 0, 1
        if len(keyed) == 1:
            held = set(keyed[0].ranks)
        else:  # the grid they span: each axis's ranks, then every rank of the next axis through them
            held = {global_rank()}
            for a in keyed:
                held = set().union(*a.connected().all_gather_objects(sorted(held)))
        return sorted(held).index(global_rank()), len(held)

    def key_part(self) -> str:
        """This rank's checkpoint key prefix on the axes of ``model_parallel_group`` that no DTensor
        mesh names, from its place among the ranks that hold one copy of the model, e.g.
        ``"mp1/"``; "" without such axes (see [Note: a part is named by its ranks])."""
        return f"mp{self.place}/" if self._keyed_axes() else ""

    def named_part(self) -> str:
        """The key prefix checkpoints were written with before parts were named by their ranks:
        this rank's position on each keyed axis by the axis's name (``"pp1.tp0/"``; a
        ProcessGroup's axis is ``"mp"``, so there both are ``"mp1/"``); "" without keyed axes. A
        load finds older checkpoints' parts by it."""
        keyed = self._keyed_axes()
        return ".".join(f"{a.name}{a.rank}" for a in keyed) + "/" if keyed else ""

    def layout(self) -> list[list]:
        """``[name, position, size]`` of each keyed axis, in ``_keyed_axes`` order: what a
        checkpoint records beside this rank's part, and checks at load. Local."""
        return [[a.name, a.rank, a.size] for a in self._keyed_axes()]

    def where(self, p: Tensor) -> str:
        """How a message gathered from every part of the model (``gather_names``) marks ``p`` (a plain
        parameter or a DTensor's stand-in): this rank's position on each model axis, and an expert
        group's checkpoint key prefix, e.g. ``"pp0/"``, ``"tp1/pg1-0/"``; "" where every rank
        holds the same parameters. Local."""
        at = ".".join(f"{a.name}{a.rank}" for a in self.axes.axes)
        original = self.dtensor_of.get(id(p), p)
        return (at + "/" if at else "") + self.key_prefix.get(id(original), "")

    def gather_names(self, names: list[str]) -> list[str]:
        """Every rank's ``names`` (marked by ``where``), over the optimizer's data-parallel group and
        then over each model axis in turn, so over every rank of the job (they form a grid, see
        _model_axes): each name once, where it first occurs in rank order, the same list on every
        rank. Every rank of the job (a few small collectives per group)."""
        out = _first_occurrences(self.comm.all_gather_objects(names))
        for a in self.axes.axes:
            out = _first_occurrences(a.connected().all_gather_objects(out))
        return out

    def writes_copies(self) -> bool:
        """Whether this rank writes the tensors every rank of the DTensor meshes holds a copy of
        (Replicate placements, plain parameters and buffers beside DTensors): rank 0 of each."""
        return self.axes.counts(self.dtensor_axes)


def _stride(ranks: Sequence[int]) -> int:
    """How far apart the ranks of an axis lie: the smallest gap between two of them (0 for one rank)."""
    ordered = sorted(ranks)
    return min((b - a for a, b in itertools.pairwise(ordered)), default=0)


def _first_occurrences(lists: Sequence[Sequence[str]]) -> list[str]:
    """The names of ``lists`` in order, each once."""
    return list(dict.fromkeys(n for names in lists for n in names))
