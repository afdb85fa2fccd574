"""Fault tolerance across replica groups with torchft: what a replica group that comes back takes
from a live one.

torchft (``pip install torchft``, an optional extra) keeps a job training when a replica group
dies: the groups alive form a quorum each step, a step is applied only where every participant
voted to commit, and a group that comes back copies the state from a live peer. shardopt shards
inside each replica group and averages across groups through the ``Manager``
(``ShardedAdamW(..., replicas=manager)``, see ``shardopt.comm._replicas`` [Note: replicas through
torchft]); :func:`register` gives the manager the functions that move one rank's state::

    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), min_replica_size=1, load_state_dict=None,
                              state_dict=None, replica_id=f"group{g}", ...)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, replicas=manager)
    shardopt.fault_tolerance.register(manager, opt, scheduler=sched, model=model)
    opt = torchft.optim.OptimizerWrapper(manager, opt)  # quorum in zero_grad, commit vote before step

Rank k of a group that heals takes rank k's shard of the optimizer state (master weights,
moments, counters, loss scale, param groups) and the weights of its flat buffers, plus the
scheduler's state, the model's buffers and the random state, from rank k of a live group; they
are loaded in place. See docs/fault-tolerance.md.
"""
from __future__ import annotations

from typing import Any

import torch

from shardopt.checkpoint._rank_state import heal_state_dict, load_heal_state_dict
from shardopt.optimizer import ShardedAdamW

KEY = "shardopt"  # the manager's name for the state registered here


def register(manager: Any, optimizer: ShardedAdamW, *, scheduler: Any = None, model: torch.nn.Module | None = None,
             key: str = KEY) -> None:
    """Register with torchft's ``manager`` the functions that send this rank's state to a replica
    group that heals and load it there (``Manager.register_state_dict_fn(key, ...)``).

    ``optimizer``: built with ``replicas=manager``. ``scheduler``: an lr scheduler whose
    ``state_dict`` goes along (its position); ``model``: its buffers go along (its parameters
    are the optimizer's weights, already sent). The random state (CPU, and the current CUDA
    device's when CUDA is initialised) goes along as it was at the end of the last step.

    The sending function runs on torchft's quorum thread: it makes no collective and copies the
    state into host memory under the optimizer's state lock (held by ``step``), so what it sends
    is the state between two steps. The loading function runs in ``should_commit`` on every rank of
    the healing group, before its vote; it makes no collective either and raises ``ValueError``,
    before changing anything, when the live group has another shard count or layout. Every rank
    of every replica group, once, after building the optimizer."""
    if not isinstance(optimizer, ShardedAdamW):
        raise TypeError(f"register takes a shardopt ShardedAdamW or ShardedMuon, got {type(optimizer).__name__}; "
                        "register it before wrapping it in torchft.optim.OptimizerWrapper")
    comm = optimizer.internals.comm
    if not comm.managed or comm.cross.manager is not manager:  # type: ignore[union-attr]
        raise ValueError("the optimizer was not built with replicas=manager for this manager: build it with "
                         "ShardedAdamW(..., replicas=manager), so that it averages over torchft's quorum")
    replicas = comm.cross
    if replicas.registered:  # type: ignore[union-attr]
        raise ValueError(f"register was already called for this optimizer (under key {key!r}): call it once per "
                         "optimizer, on every rank of every replica group")
    rng: dict[str, Any] = {}

    def keep_rng(*_: Any) -> None:  # after every step that ran (a committed one)
        rng.update(_rng_state())


    def state_dict() -> dict[str, Any]:
        out: dict[str, Any] = {"optimizer": heal_state_dict(optimizer), "rng": dict(rng)}
        if scheduler is not None:
            out["scheduler"] = scheduler.state_dict()
        if model is not None:
            out["buffers"] = {n: b.detach().to("cpu", copy=True) for n, b in model.named_buffers()}
        return out

    def load_state_dict(sd: dict[str, Any]) -> None:
        sent = sd["optimizer"]
        healed_to = int(manager.current_step())  # the quorum's step, which this group heals to
        if isinstance(sent, dict) and int(sent.get("step", -1)) + int(sent.get("skipped_steps", 0)) != healed_to:
            raise RuntimeError(
                f"the live replica group's rank sent the optimizer state of step "
                f"{int(sent.get('step', -1)) + int(sent.get('skipped_steps', 0))} while the quorum is at step "
                f"{healed_to}: that group healed on some of its ranks only (it will raise and restart itself), so "
                "this state is refused before anything changes; let this group restart, it heals again from a live "
                "group. (Each committed step is one optimizer.step(): step the optimizer through "
                "torchft.optim.OptimizerWrapper only; after shardopt.load_checkpoint, restore torchft's step too: "
                "manager.load_state_dict(...), saved beside it from manager.state_dict().)")
        load_heal_state_dict(optimizer, sent)  # checked first: raises before anything changes
        if scheduler is not None and "scheduler" in sd:
            scheduler.load_state_dict(sd["scheduler"])
        if model is not None and "buffers" in sd:
            mine = dict(model.named_buffers())
            with torch.no_grad():
                for n, t in sd["buffers"].items():
                    if n in mine:
                        mine[n].copy_(t)
        _set_rng_state(sd.get("rng", {}))
        rng.update(sd.get("rng", {}))

    manager.register_state_dict_fn(key, load_state_dict, state_dict)  # raises (torchft's) for a key taken
    optimizer.register_step_post_hook(keep_rng)
    keep_rng()
    replicas.registered = True  # type: ignore[union-attr]  # the rounds check it (comm._replicas)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    if "cpu" in state:
        torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])
