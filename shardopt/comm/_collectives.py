"""The optimizer's collectives: with ``_bucket_paths.py`` and ``_control.py``, the only modules that call ``torch.distributed``.

Every collective here is issued asynchronously and returns a :class:`Pending` that the caller
waits on explicitly; a handle is waited exactly once. Backend differences stay here.

Every small message by which the ranks agree travels on shardopt's own control group
(``_control`` [Note: shardopt's own control group]); the data stays on the optimizer's group.

How a bucket is reduced and gathered is the comm's bucket path (``Comm.path``), a strategy of
``comm/_bucket_paths.py`` (see its [Note: the bucket paths]).

[Note: hybrid sharding]
With a 2-D ``DeviceMesh`` (replicate x shard) the state is sharded over the ``shard`` dimension
and replicated over ``replicate``. A bucket's gradients are reduce-scattered inside the shard
group, and each rank's averaged piece is then all-reduced across the replicate group (the ranks
holding the same piece in the other replicas); the weights are all-gathered inside the shard
group. On the native path both are averages (``ReduceOp.AVG``; the shard groups are of equal size,
so the mean of their means is the mean) in the reduction's dtype; on the rank-order path the
cross-replica all-reduce sums the fp32 partial sums of the shard groups, and the average is
rounded to the gradient dtype once, after it (see comm._bucket_paths [Note: the bucket paths]). The cross-replica all-reduce of a bucket is issued
when its reduce-scatter lands and waited on later (``Pending.overlap``), so it overlaps the rest
of backward. Every small collective (gradient statistics, usage checks, the rounds' tags and
the bucket order) still spans every rank of the mesh, so every decision is the same everywhere.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import pickle
import time
from typing import Any, Callable, Iterator, NoReturn, Sequence, cast

import torch
import torch.distributed as dist
from torch import Tensor

from shardopt.comm._bucket_paths import InFlight, NativePath, bucket_path, equal_pieces
from shardopt.comm._pending import CommStats as CommStats  # the handles, importable from here too
from shardopt.comm._pending import Pending as Pending
from shardopt.comm._control import _NOTICE_WAIT, _PEER_DIED, ControlGroup, _first_line, control_group, ended_ranks
from shardopt.comm._control import ControlGone as ControlGone  # importable from here too
from shardopt.comm._control import ControlTimeout as ControlTimeout
from shardopt.comm._control import leave_line as leave_line
from shardopt.comm._control import read_line as read_line
from shardopt.comm._replicas import ManagedReplicas, MeshReplicas
from shardopt.comm._pending import says_timed_out
from shardopt.core._compat import mesh_flattener
from shardopt.core._layout import Range

ProcessGroup = Any  # torch.distributed.ProcessGroup; None means the default group
_HOST_BACKENDS = ("gloo", "mpi")  # backends whose collectives run on the host: their waits block it anyway


def group_ranks(group: ProcessGroup) -> list[int]:
    """The global ranks of ``group`` (None: the default group), in group-rank order. Local."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def world_size() -> int:
    """Ranks in the default group. Local."""
    return dist.get_world_size()


def global_rank() -> int:
    """This process's rank in the default group. Local."""
    return dist.get_rank()


def is_process_group(x: object) -> bool:
    return isinstance(x, dist.ProcessGroup)


def mesh_groups(mesh: Any) -> tuple[ProcessGroup, ProcessGroup, ProcessGroup]:
    """(every rank of ``mesh``, its shard group, its replicate group or None) for this rank. A 1-D
    mesh shards over all its ranks; a 2-D mesh is (replicate, shard), as FSDP2's HSDP."""
    if mesh.ndim == 1:
        return mesh.get_group(), mesh.get_group(), None
    if mesh.ndim != 2:
        raise ValueError(f"device_mesh must be 1-D (shard) or 2-D (replicate, shard), got a {mesh.ndim}-D mesh "
                         f"{tuple(mesh.shape)}; pass the data-parallel sub-mesh, e.g. mesh['replicate', 'shard']")
    whole = None if mesh.size() == dist.get_world_size() else _flat_group(mesh)  # a larger mesh's data-parallel part
    return whole, mesh.get_group(1), (mesh.get_group(0) if mesh.shape[0] > 1 else None)


def _flat_group(mesh: Any) -> ProcessGroup:
    """One group of every rank of ``mesh``: ``DeviceMesh._flatten()`` (see _compat), or else each
    rank's sub-mesh shared over the world and a group made for each distinct one, alike everywhere."""
    flatten = mesh_flattener(mesh)
    if flatten is not None:
        return flatten().get_group()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor(sorted(mesh.mesh.flatten().tolist()), dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)  # the world's sub-meshes, every one the same size
    groups = {ranks: dist.new_group(list(ranks)) for ranks in sorted({tuple(t.tolist()) for t in every})}
    return groups[tuple(mine.tolist())]


EXCHANGE_BYTES = 1 << 20  # a message whose copies to every rank total at most this many bytes is an exchange


def _combined(rows: Tensor, op: str) -> Tensor:
    """Every rank's row of an exchange (see _control [Note: a message is an exchange]) combined:
    the largest, or the sum, floating point summed in fp64 in one fixed order (the same rows give
    the same bits on every rank) and rounded once to the rows' dtype. Local."""
    if op == "max":
        return rows.amax(0)
    if rows.is_floating_point():
        return rows.double().sum(0).to(rows.dtype)
    return rows.sum(0)


def _reached(device: torch.device, deadline: float) -> bool:
    """Whether the work queued so far on ``device``'s current stream (the data collectives waited
    on it, see _pending [Note: deadlines of data waits]) finished within ``deadline`` seconds,
    polled without blocking the host in the device's own wait. Local."""
    event = torch.Event(device=device)
    event.record()
    until, pause = time.monotonic() + deadline, 2e-5
    while not event.query():
        if time.monotonic() >= until:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
    return True


class Comm:
    """A process group with its rank and size, and the collectives shardopt needs."""

    def __init__(self, process_group: ProcessGroup = None, device_mesh: Any = None, *,
                 connect: float | None = None, replicas: Any = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "shardopt needs torch.distributed initialised: launch with torchrun and call "
                "torch.distributed.init_process_group() (gloo on CPU, nccl on GPU) before "
                "building the optimizer"
            )
        shard_group, replicate_group = process_group, None
        if device_mesh is not None:
            if process_group is not None:
                raise ValueError("pass process_group= or device_mesh=, not both")
            process_group, shard_group, replicate_group = mesh_groups(device_mesh)
        self.group = process_group  # every rank: small collectives, decisions, checkpoints
        self.rank: int = dist.get_rank(process_group)
        self.world_size: int = dist.get_world_size(process_group)
        # The state is sharded over shard_group and replicated over replicate_group (see [Note: hybrid sharding]).
        self.shard_group = shard_group
        self.shard_rank: int = dist.get_rank(shard_group)
        self.shard_size: int = dist.get_world_size(shard_group)
        self.replicate_group = replicate_group
        self.replica: int = dist.get_rank(replicate_group) if replicate_group is not None else 0
        self.replicas: int = self.world_size // self.shard_size
        # how pieces cross the replicas: the mesh's replicate group, or torchft's Manager (see _replicas)
        self.cross: MeshReplicas | ManagedReplicas = MeshReplicas(replicate_group, self.replicas)
        if replicas is not None:
            if device_mesh is not None:
                raise ValueError("replicas= (torchft's Manager) is the replicate dimension itself: pass the replica "
                                 "group's own ranks as process_group= (or none: the default group), not device_mesh=")
            self.cross = ManagedReplicas(replicas)
        self.managed = self.cross.managed  # the replicas are torchft's quorum (see _replicas [Note: replicas through torchft])
        self.hybrid = replicate_group is not None or self.managed  # pieces are all-reduced across replicas too
        if self.replicas * self.shard_size != self.world_size or self.replica < 0 or self.shard_rank < 0:
            raise ValueError(f"device_mesh: a shard group of {self.shard_size} ranks does not tile the "
                             f"{self.world_size} data-parallel ranks")
        self.backend: str = str(dist.get_backend(process_group))
        # gloo (and MPI) collectives are waited on the host; a device backend's on its stream (see
        # _pending [Note: deadlines of data waits])
        self.host_waits = self.backend in _HOST_BACKENDS
        self.path: NativePath = bucket_path(self.backend)(self)  # how buckets are reduced and gathered
        self.stats = CommStats()
        self.timeout: float | None = None  # seconds before a waiting rank raises TimeoutError; None: the group's own
        self.where = "a backward or forward pass"  # the optimizer call in progress, for that message
        self._global = [dist.get_global_rank(process_group, r) if process_group is not None else r
                        for r in range(self.world_size)]
        self.control = control_group(process_group, connect) if self.world_size > 1 else None
        # the default group's rank of each rank of the shard group, in shard-rank order
        self.shard_global = [dist.get_global_rank(shard_group, r) if shard_group is not None else r
                             for r in range(self.shard_size)]

    @property
    def global_ranks(self) -> list[int]:
        """The default group's rank of each rank of the group, in group-rank order."""
        return list(self._global)

    # -- small collectives: on the control group ----------------------------------------
    def _control(self) -> ProcessGroup:
        control = cast(ControlGroup, self.control)  # callers return early without one (a single rank)
        if control.broken:
            raise RuntimeError(control.broken)
        return control.group

    def control_all_reduce(self, t: Tensor, op: str = "sum", *, deadline: float | None = None) -> Pending:
        """In-place SUM (or ``"max"``) of ``t`` over the group, through the control group (see
        [Note: shardopt's own control group]): a tensor on an accelerator travels through a host copy
        and is written back when waited. It waits at most ``deadline`` seconds (None: the comm's
        ``timeout``, else the group's), which is also gloo's own timeout on it; then this rank gives
        up on the control group and the wait raises ``ControlTimeout``, or ``ControlGone`` when the
        other ranks had given up (``control_failed``). Call on every rank."""
        if self.control is None:
            return Pending(stats=self.stats, comm=self)
        if deadline is None:
            deadline = self.timeout if self.timeout is not None else self.control.timeout.total_seconds()
        if t.device.type != "cpu" and not _reached(t.device, deadline):
            limit = "the optimizer's timeout=" if self.timeout is not None else "the process group's timeout"
            raise TimeoutError(self.timed_out(deadline, limit))  # see _pending [Note: deadlines of data waits]
        # a contiguous host copy, unless t is one: the all-reduce writes its memory as one block
        host = t if t.device.type == "cpu" and t.is_contiguous() else t.to("cpu").contiguous()
        rows = self._exchanged(host)
        work, sent = self._send_control(host, rows, op, deadline)

        def land() -> None:  # every rank's rows combined in rank order, the reduced host copy written back into t
            if rows is not None:
                host.copy_(_combined(rows, op).view_as(host))
            if host is not t:
                t.copy_(host)

        return Pending(self.count([work]), keep_alive=[host, rows, sent], stats=self.stats, then=land, comm=self,
                       deadline=deadline, control=True)

    def _exchanged(self, host: Tensor) -> Tensor | None:
        """The table that receives every rank's copy of ``host`` (one row per rank, in rank order)
        when ``host`` travels as an exchange, else None (an all-reduce; see _control [Note: a
        message is an exchange]). Alike on every rank: the messages have one size everywhere. Local."""
        if host.numel() * host.element_size() * self.world_size > EXCHANGE_BYTES:
            return None
        return torch.empty((self.world_size, host.numel()), dtype=host.dtype)

    def _send_control(self, host: Tensor, rows: Tensor | None, op: str, deadline: float) -> tuple[Any, Tensor]:
        """Issue one control message of ``host`` (a CPU tensor): an exchange of it into ``rows``
        (``_exchanged``), or an all-reduce (SUM or ``"max"``) in place; gloo's own timeout on it is
        ``deadline`` seconds. Returns its work and the tensor it sends (kept alive until it
        landed); raises as ``control_failed`` when the group refuses it. Every rank."""
        group = self._control()  # raises why, once this rank gave up on it
        try:
            if rows is not None:
                each = dist.AllToAllOptions()
                each.timeout = datetime.timedelta(seconds=deadline)
                sent = host.reshape(1, -1).expand(self.world_size, -1).contiguous()
                work = group.alltoall_base(rows, sent, [], [], each)
            else:
                sent = host
                opts = dist.AllreduceOptions()
                opts.reduceOp = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM  # type: ignore[assignment]  # torch's stub types the members as RedOpType
                opts.timeout = datetime.timedelta(seconds=deadline)
                work = group.allreduce([host], opts)
        except RuntimeError as e:  # gloo reports in wait(); an error here would mean the same
            self.control_failed(e, deadline)
        self.stats.control_messages += 1
        return work, sent

    def timed_out(self, waited: float, limit: str = "the optimizer's timeout=") -> str:
        """Why a collective this rank waited ``waited`` seconds for (``limit``: whose timeout that
        was) did not complete, naming the call in progress. Local."""
        return (f"rank {self.rank} of {self.world_size}: {self.where} waited {waited:g} s ({limit}) for the other "
                "ranks' part of a collective. Another rank is in another call, skipped this one (a step() or a "
                "backward that raised on one rank only), or died: every rank must call backward, clip_grad_norm_ "
                "and step in the same order")

    def control_failed(self, error: Exception, waited: float) -> NoReturn:
        """Give up on the control group on this rank, for a control message that did not complete
        (torch's ``error``), and raise why (see [Note: shardopt's own control group]): ``ControlTimeout``
        when it waited ``waited`` seconds in vain (the other ranks are told through the store),
        ``ControlGone`` when the other ranks' connections were closed. Callers that know the call
        (``_messages.enter``) restate either. Local."""
        if says_timed_out(error):
            limit = "the optimizer's timeout=" if self.timeout is not None else "the process group's timeout"
            text = self.timed_out(waited, limit)
            self.give_up(f"shardopt can no longer agree with the other ranks on this rank: {text}",
                         notice=f"rank {self.rank} gave up waiting {waited:g} s for the other ranks in {self.where}")
            raise ControlTimeout(text, waited) from None
        ended = self.ended_peers(0)  # before the others, raising as this rank does, end too
        notice = cast(ControlGroup, self.control).notice(_NOTICE_WAIT)
        # No line in the store: no rank gave up on this one, so the rank whose connection closed ended
        why = notice or _PEER_DIED + (ended or self.ended_peers(_NOTICE_WAIT / 2))
        text = (f"rank {self.rank} of {self.world_size}: {self.where} cannot reach the other ranks: {why}. This rank "
                f"can no longer agree with them: restart every rank and resume from the last complete checkpoint "
                f"(gloo: {_first_line(error)})")
        self.give_up(text)
        raise ControlGone(text, why, noticed=bool(notice)) from None

    def collective_failed(self, error: Exception, what: str, source: str = "") -> NoReturn:
        """A collective over this comm's group, or the default store (``what``: which, e.g. DCP's
        exchange of a checkpoint's plans, a weight gather), failed with torch's ``error``
        (``source``: whose words those are; default the group's backend): stop using the control
        group on this rank (the ranks can no longer agree) and raise naming the call in progress:
        TimeoutError when the wait ran out of time, else RuntimeError saying that another rank died
        (its connection closed), with torch's words. Local."""
        source = source or self.backend
        if says_timed_out(error):
            text = (f"rank {self.rank} of {self.world_size}: {self.where} waited for the other ranks in {what} until "
                    f"the process group's timeout: another rank is stuck in other work or died{self.ended_peers(0)}. "
                    "This rank can no longer agree with them: restart every rank and resume from the last complete "
                    f"checkpoint ({source}: {_first_line(error)})")
            self.give_up(f"shardopt can no longer agree with the other ranks on this rank: {text}")
            raise TimeoutError(text) from None
        text = (f"rank {self.rank} of {self.world_size}: {self.where} lost the other ranks in {what}: {_PEER_DIED}"
                f"{self.ended_peers(_NOTICE_WAIT)}. This rank can no longer agree with them: restart every rank and "
                f"resume from the last complete checkpoint ({source}: {_first_line(error)})")
        self.give_up(f"shardopt can no longer agree with the other ranks on this rank: {text}")
        raise RuntimeError(text) from None

    def ended_peers(self, wait: float) -> str:
        """``"; the process of rank 2 has ended"`` for the other ranks of the group whose process is known
        to have ended (``ended_ranks``: on this machine), looked for during up to ``wait`` seconds
        (a process that closed its connections may take a moment to end); "" where none is known.
        Ranks are the group's, with the default group's where they differ. Local."""
        me = self._global[self.rank]
        ended = ended_ranks([g for g in self._global if g != me], wait)
        if not ended:
            return ""
        whole = self._global == list(range(world_size()))
        names = [f"{self._global.index(g)}" if whole else f"{self._global.index(g)} (global rank {g})" for g in ended]
        if len(names) == 1:
            return f"; the process of rank {names[0]} has ended"
        return f"; the processes of ranks {', '.join(names)} have ended"

    def _control_gather(self, t: Tensor) -> list[Tensor]:
        """Every rank's ``t`` (a CPU tensor of the same shape everywhere), on the control group
        (rare, small messages): the rows of one exchange, or else each rank's row of a summed
        table, zeros elsewhere."""
        rows = self._exchanged(t)
        if rows is not None:
            deadline = self.timeout if self.timeout is not None else cast(ControlGroup, self.control).timeout.total_seconds()
            work, sent = self._send_control(t, rows, "sum", deadline)
            Pending(self.count([work]), keep_alive=[t, rows, sent], stats=self.stats, comm=self, deadline=deadline,
                    control=True).wait()
            return [row.view_as(t) for row in rows]
        table = torch.zeros((self.world_size, *t.shape), dtype=t.dtype)
        table[self.rank] = t
        self.control_all_reduce(table).wait()
        return list(table)

    def gave_up(self) -> bool:
        """Whether this rank stopped using the control group (``give_up``): its messages can no
        longer agree with the other ranks, and every later use raises why. Local."""
        return self.control is not None and bool(self.control.broken)

    def give_up(self, why: str, notice: str = "") -> None:
        """This rank stops using the control group (a message of it was given up on or found the
        other ranks gone): every later use of the control group on this rank raises ``why`` (a
        later call restates it); ``notice``, one line for the other ranks, is left in the store
        (``ControlGroup.give_up``). Local."""
        if self.control is not None:
            self.control.give_up(why, notice)

    def all_reduce_sum(self, t: Tensor) -> Pending:
        """In-place SUM of ``t`` over the group (a small message: the control group). Call on every rank."""
        return self.control_all_reduce(t, "sum")

    def all_reduce_max(self, t: Tensor) -> Pending:
        """In-place MAX of ``t`` over the group (a small message: the control group). Call on every rank."""
        return self.control_all_reduce(t, "max")

    def all_gather_objects(self, obj: object) -> list:
        """Every rank's picklable ``obj``, in rank order (blocking; small objects, rare paths; the
        control group). Unlike ``dist.all_gather_object`` this needs no NumPy."""
        if self.control is None:
            return [pickle.loads(pickle.dumps(obj))]
        data = pickle.dumps(obj)
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = self._control_gather(size)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        everything = self._control_gather(mine)
        return [pickle.loads(bytes(t[: int(n)].tolist())) for t, n in zip(everything, sizes)]

    def same_everywhere(self, description: Sequence[object]) -> bool:
        """True on every rank when ``description`` is equal on all ranks: one small all-gather on the
        control group."""
        if self.control is None:
            return True
        digest = hashlib.sha256(repr(list(description)).encode()).digest()
        mine = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64)
        gathered = self._control_gather(mine)
        return all(bool((g == mine).all()) for g in gathered)

    def broadcast(self, t: Tensor, src: int = 0) -> Pending:
        """Broadcast ``t`` in place from group rank ``src``. Call on every rank."""
        work = dist.broadcast(t, src=self._global[src], group=self.group, async_op=True)
        return Pending(self.count([work]), stats=self.stats, comm=self)

    @property
    def data_group(self) -> Any:
        """The optimizer's group as a process-group object (the default group's for None): what
        torch's own code that takes a group, such as the Join context manager, is handed."""
        return self.group if self.group is not None else dist.group.WORLD

    @contextlib.contextmanager
    def during(self, call: str) -> Iterator[None]:
        """Name ``call`` (e.g. ``"step()"``) in the timeout message of collectives waited for inside."""
        previous, self.where = self.where, call
        try:
            yield
        finally:
            self.where = previous

    # -- bucket collectives --------------------------------------------------------------
    def count(self, works: list, *, reduced: int = 0, gathered: int = 0, crossed: int = 0) -> list:
        """``works`` (collectives just issued) and the bytes they reduce, gather or send across the
        replicas, added to ``stats``; returns ``works``. Local."""
        self.stats.collectives += len(works)
        self.stats.reduce_bytes += reduced
        self.stats.gather_bytes += gathered
        self.stats.cross_bytes += crossed
        return works

    def sent_bytes(self, stats: CommStats, stage: int) -> tuple[int, int]:
        """(bytes this rank sent inside its shard group, bytes it sent across replicas) for the
        collectives counted in ``stats``, as ring algorithms move them: a reduce-scatter or an
        all-gather over S ranks sends (S-1)/S of its size, an all-reduce over R ranks 2 (R-1)/R."""
        s, r = self.shard_size, self.cross.last_size()
        passes = 2 if stage == 1 and not self.hybrid and self.path.whole_all_reduce else 1  # all-reduce
        inside = (passes * stats.reduce_bytes + stats.gather_bytes) * (s - 1) // s
        return inside, 2 * stats.cross_bytes * (r - 1) // r

    def cross_replicas(self, t: Tensor, avg: bool, then: Callable[[], Pending | None] | None = None) -> Pending:
        """All-reduce this rank's piece ``t`` across the replicate group (SUM, or AVG), in place;
        a follow-up its issuer may wait on later (see [Note: hybrid sharding]), whose landing runs
        ``then`` (the reduction's next step, which may return one more collective to wait). An empty
        piece (empty on every rank of the replicate group alike) issues nothing, but still returns a
        follow-up that runs ``then`` when waited, so that every rank's queue of collectives has the
        same shape (the stage-1 all-gather that ``then`` issues must be issued at the same point on
        every rank of a shard group)."""
        if not t.numel():
            return Pending(stats=self.stats, comm=self, then=then, overlap=True)
        work = self.cross.all_reduce(t, avg)
        return Pending(self.count([work], crossed=t.nbytes), keep_alive=[t], stats=self.stats, then=then, comm=self,
                       overlap=True, what="a cross-replica gradient reduction")

    def reduce_scatter(self, out: Tensor, bucket: Tensor, pieces: Sequence[Range], held: InFlight) -> Pending:
        """Average ``bucket`` over ranks; this rank's piece lands in ``out`` once the one handle
        returned is waited (its collectives issued here, on every rank in the same order; with
        hybrid sharding its landing returns the cross-replica follow-up, and the average spans the
        replicas once that lands too, see [Note: hybrid sharding]). ``held`` counts what the
        reduction holds beside the bucket until it lands (receive buffers, cast copies), bytes: the
        caller's own. ``pieces[r]`` is shard rank r's range relative to the start of ``bucket``:
        equal, in rank order, tiling it (``build_layout``'s buckets). How, is the comm's bucket path
        (see comm._bucket_paths [Note: the bucket paths])."""
        if not equal_pieces(pieces) or pieces[0].start != 0 or pieces[-1].end != bucket.numel():
            raise AssertionError(f"a bucket's reduction takes equal pieces that tile it, got {list(pieces)} of a "
                                 f"{bucket.numel()}-element bucket")
        # without autograd: under create_graph=True a staged gradient requires grad, and the collective writes in place
        out, bucket = out.detach(), bucket.detach()
        return self.path.reduce_scatter(out, bucket, pieces, held)

    def all_reduce(self, bucket: Tensor, pieces: Sequence[Range], sum_dtype: torch.dtype | None,
                   held: InFlight) -> Pending:
        """Average ``bucket`` over ranks, in place, as one handle (its collectives issued here, on
        every rank in the same order): the native path's one all-reduce (``ReduceOp.AVG``), or a
        reduce-scatter (summed in ``sum_dtype``, default the bucket's; see :meth:`reduce_scatter`)
        whose landing, once the average is complete, gathers the averaged pieces (the rank-order
        path, ``sum_dtype`` other than the bucket's, hybrid). ``held``: as for :meth:`reduce_scatter`."""
        return self.path.all_reduce(bucket.detach(), pieces, sum_dtype, held)  # detached: see reduce_scatter

    def gather_tensor_parallel(self, piece: Tensor, like: Tensor) -> Tensor:
        """The whole tensor of which ``piece`` is this rank's part, split as DTensor ``like`` is
        across its own mesh (tensor parallelism, not this comm's group): DTensor's all-gather
        (``full_tensor``), blocking. A failure raises as :meth:`collective_failed`, naming the call in
        progress. Every rank of ``like``'s mesh, in the same order."""
        from torch.distributed.tensor import DTensor

        split = DTensor.from_local(piece, like.device_mesh, like.placements,  # type: ignore[attr-defined]
                                   run_check=False, shape=like.shape, stride=like.stride())
        try:
            return split.full_tensor()
        except RuntimeError as e:
            self.collective_failed(e, "the gather of a tensor-parallel matrix's update across its mesh (Muon)")

    def all_gather_inplace(self, flat: Tensor, pieces: Sequence[Range]) -> Pending:
        """Fill ``flat`` with every rank's piece, in place; ``pieces[r]`` is rank r's range of
        ``flat``, already holding that rank's data on rank r; r counts the ranks of this rank's shard
        group. Equal pieces (a bucket's) on the native path: one in-place ``all_gather_into_tensor``;
        else one broadcast per rank that holds part of them (see comm._bucket_paths [Note: the bucket paths]).
        Call on every rank."""
        return self.path.gather(flat, pieces)
