"""How a rank's averaged piece of a bucket crosses the replicas: a strategy each (see
``_collectives`` [Note: hybrid sharding] and [Note: replicas through torchft]).

``MeshReplicas``: the replicate group of a 2-D ``DeviceMesh``, fixed for the job. ``ManagedReplicas``:
torchft's ``Manager``, whose replicas are the replica groups in this step's quorum; a failed peer
is a recorded error of the manager (its step is then not committed), never a hang or a raise here.
"""
from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from shardopt.comm._digest import digest_code, digests_agree

# [Note: replicas through torchft]
# With ``replicas=manager`` each replica group is a job of its own (its own process group, its own
# TCPStore) and shards over all its ranks; rank k's averaged piece of a bucket is then averaged
# over rank k of every replica group in the step's quorum by ``Manager.allreduce``, on torchft's
# reconfigurable cross-replica group. Three things follow, each kept here or where named:
# - The number of replicas is the quorum's (``Manager.num_participants``), read when a piece
#   lands, after the quorum formed; a group that heals this step contributes zeros.
# - The pieces are then the same on every participating group, so every decision taken from them
#   inside a group (inf/NaN skip, the clip's norm, the fp16 loss scale) is the same in every group
#   without a message between groups; whether the step is applied at all is torchft's vote
#   (``should_commit``), taken by its ``OptimizerWrapper`` before ``step``.
# - Collectives across groups must be issued in the same order in every group, so the buckets are
#   launched in a fixed order (reverse layout order, group._rounds), not one guessed from each
#   group's first forward; and every parameter takes every step (a zero gradient where no rank of
#   a group had one), because which parameters had gradients is not exchanged between groups.


def check_replicas_arguments(overlap_param_gather: bool, model_parallel_group: Any) -> None:
    """Refuse what ``replicas=`` (torchft's Manager) does not support, before any communication. Local."""
    if overlap_param_gather:
        raise ValueError("replicas= (torchft) with overlap_param_gather=True: a replica group that heals reads a live "
                         "group's weights from another thread between two steps, so each step must finish its "
                         "gathers; leave overlap_param_gather off")
    if model_parallel_group is not None:
        raise ValueError("replicas= (torchft) beside model_parallel_group= (tensor, pipeline or expert parallelism) "
                         "is not supported: a replica group would have to heal every model axis together; use "
                         "replicas= with data parallelism inside each replica group")


class MeshReplicas:
    """The replicate group of a 2-D mesh: one all-reduce per piece (AVG or SUM), every replica."""

    managed = False

    def __init__(self, group: Any, size: int) -> None:
        self.group, self._size = group, size

    def size(self) -> int:
        """Replicas the pieces are averaged over: the mesh's replicate dimension."""
        return self._size

    def last_size(self) -> int:
        """The same, for reports (it never changes). Local."""
        return self._size

    def all_reduce(self, t: Tensor, avg: bool) -> Any:
        """``t`` summed (or averaged) over the replicas, in place; the work handle. Every replica."""
        op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
        return dist.all_reduce(t, op=op, group=self.group, async_op=True)


class _ManagedWork:
    """A torchft work handle as shardopt's handles wait on it: ``wait`` swallows a failed peer
    (the manager records it), and the deadline is the manager's own (its ``timeout``); ``then``
    runs once it was waited (an average's division)."""

    def __init__(self, work: Any, then: Any = None) -> None:
        self._work, self._then = work, then

    def wait(self, timeout: Any = None) -> bool:
        ok = bool(self._work.wait())
        if self._then is not None:
            self._then()
        return ok

    def is_completed(self) -> bool:
        inner = getattr(self._work, "_work", None)  # torchft's _ManagedWork wraps the process group's
        return bool(inner.is_completed()) if inner is not None else True


class ManagedReplicas:
    """The replica groups of torchft's ``Manager`` in this step's quorum (see [Note: replicas
    through torchft])."""

    managed = True

    def __init__(self, manager: Any) -> None:
        missing = [name for name in ("allreduce", "num_participants", "register_state_dict_fn", "should_commit")
                   if not callable(getattr(manager, name, None))]
        if missing or isinstance(manager, type):
            raise TypeError(f"replicas= takes a torchft.Manager (pip install torchft; one per replica group), got "
                            f"{manager!r:.80}, which is {'a class, not an instance' if isinstance(manager, type) else 'no Manager: it has no ' + ', '.join(missing)}; "
                            "for a fixed replicate dimension pass device_mesh= (a 2-D mesh: replicate x shard) instead")
        self.manager = manager
        self.registered = False  # shardopt.fault_tolerance.register gave the manager this optimizer's state
        self._last = 1
        self._contributors: int | None = None  # groups whose pieces go into this round's sums (agree)

    def size(self) -> int:
        """Replica groups whose pieces go into this round's sums: counted by the round's ``agree``
        (a group that heals this step adds zeros, also at torchft's first step with init_sync),
        else the quorum's size (waits for the quorum)."""
        n = self._contributors if self._contributors is not None else int(self.manager.num_participants())
        self._last = max(1, n)
        return self._last

    def last_size(self) -> int:
        """The quorum's size when a piece last landed, without waiting (reports). Local."""
        return self._last

    def agree(self, steps: int, hyper: object, layout: object, device: torch.device) -> None:
        """Check that every replica group in the quorum holds a state of ``steps`` steps of the same
        ``layout`` (shard count, buffer sizes) and will step with the hyperparameters ``hyper`` (one
        small all-reduce across groups; see [Note: replicas through torchft]), and count the groups
        whose pieces go into the round's sums; raise RuntimeError, after recording it with the
        manager (no group commits this step), where they differ. A group that heals this step sends
        zeros and is not counted. ``device``: the buckets' (the cross-group process group carries
        their pieces). Every rank of every group, once per round, before its bucket collectives."""
        if not self.registered:
            raise RuntimeError(
                "this optimizer was built with replicas= (torchft) but its state was never registered with the "
                "manager, so a replica group that comes back could not heal from this one (torchft would stall "
                "every group): call shardopt.fault_tolerance.register(manager, optimizer) on every rank of every "
                "group, after building the optimizer and before training")
        digest = digest_code(zlib.crc32(repr((int(steps), hyper, layout)).encode()), False)
        code = torch.tensor([*digest, 1.0], dtype=torch.float64, device=device)  # the last: 1 per contributing group
        self._contributors = None
        _ManagedWork(self.manager.allreduce(code, reduce_op=dist.ReduceOp.SUM)).wait()
        if self.manager.errored() is not None:
            return  # a peer failed: the sums mean nothing, and this step is committed nowhere anyway
        summed = code.tolist()
        contributors = round(summed[-1])
        if contributors >= 1 and digests_agree(summed[:-1], contributors, False):
            self._contributors = contributors
            return
        why = (
            f"the {contributors} replica groups in torchft's quorum do not hold the same training state: their "
            f"steps taken ({int(steps)} here), their hyperparameters (learning rates, weight decay, betas), or "
            "their shard count or model differ, so averaging their gradients would update different states. Step "
            "an lr scheduler only on a committed step (in a step post hook: "
            "optimizer.register_step_post_hook(lambda *_: scheduler.step())), change hyperparameters alike in "
            "every group, run every group with the same model and number of ranks, and let no group train in a "
            "quorum of its own (give the Lighthouse a join_timeout_ms longer than a step); this step is committed "
            "in no group")
        self.manager.report_error(RuntimeError(why))
        raise RuntimeError(why)

    def all_reduce(self, t: Tensor, avg: bool) -> Any:
        """``t`` summed (or averaged over the groups that contributed, ``size``) by
        ``Manager.allreduce``, in place; a failure is the manager's recorded error, and its step is
        then not committed. Every rank."""
        work = self.manager.allreduce(t, reduce_op=dist.ReduceOp.SUM)
        return _ManagedWork(work, (lambda: t.div_(self.size())) if avg else None)
