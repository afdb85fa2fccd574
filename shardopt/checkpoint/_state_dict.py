"""The state-dict half of ``ShardedAdamW``: ``torch.optim``'s contract (the four hook kinds run as
torch runs them) over shardopt's two formats, this rank's shard (``_rank_state``) and
``torch.optim.AdamW``'s whole state (``checkpoint._adamw``, through ``shardopt.checkpoint``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardopt.checkpoint._rank_state import STATE_FORMAT, check_rank_state_dict, load_rank_state_dict, rank_state_dict

if TYPE_CHECKING:
    import torch

    from shardopt.checkpoint._torch_state import ParamStateView
    from shardopt.core._config import ShardConfig
    from shardopt.step._internals import Internals

    # For the type checker, the mixin is what it is mixed into: a torch.optim.Optimizer, whose
    # state-dict hooks it runs as torch runs them. At run time ShardedAdamW's bases give it that.
    _Mixed = torch.optim.Optimizer
else:
    _Mixed = object


class OptimizerStateDict(_Mixed):
    """Mixed into ``ShardedAdamW``: its state-dict methods, over ``internals`` (see ``step._internals``)."""

    if TYPE_CHECKING:  # set by ShardedAdamW (a layer up), declared here for the type checker
        config: ShardConfig
        state: ParamStateView  # type: ignore[assignment]
        skipped_steps: int
        internals: Internals
        # consolidate_state_dict's whole state on the rank it gathered onto, until the next step
        # (which drops it) or load; None elsewhere. An instance attribute (set at construction),
        # never a class one: a LightningOptimizer wrapper reads the optimizer's through __getattr__.
        _consolidated: dict[str, Any] | None

        def finish_param_gather(self) -> None: ...

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole state onto rank ``to`` (as ``ZeroRedundancyOptimizer`` does): until the
        next ``step``, ``state_dict()`` on that rank returns it in ``torch.optim.AdamW``'s format, plus
        a ``"shardopt"`` entry with the fp32 master weights of 16-bit parameters and the loss scaler.
        ``load_state_dict`` takes it back at any world size. Every rank; gathered one parameter at a
        time, held on the CPU of rank ``to`` only."""
        from shardopt.checkpoint import full_state_dict

        comm = self.internals.comm
        if not 0 <= to < comm.world_size:
            raise ValueError(f"consolidate_state_dict(to={to}): no such rank in a world of {comm.world_size}")
        consolidated = full_state_dict(self, to=to, extras=True, call="consolidate_state_dict")
        self._consolidated = consolidated if comm.rank == to else None

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (master weights, moments, step, groups, scaler),
        loadable by ``load_state_dict`` on the same rank at the same world size and layout; on the
        rank that ``consolidate_state_dict`` gathered onto, the whole state instead (until the next
        ``step``). Local: frameworks call it on one rank only.

        Unlike torch's getter, it first takes in weights written from outside the optimizer on this
        rank since the last step (``p.copy_(...)``, ``p.data = ...``, a loaded model state dict): the
        master weights are the state a resume trains from, so a state dict saved after such a write
        must hold the written weights, not the ones before it (a resume would otherwise silently
        drop the write). It does what the next ``step`` would do first, without communication: the
        parameter is re-bound to its place in the flat buffer and this rank's part of the master
        follows it; the next step then finds nothing more to take in (and, as every step does,
        still makes every rank agree on rank 0's values)."""
        for pre in self._optimizer_state_dict_pre_hooks.values():  # torch.optim's hooks, as torch runs them
            pre(self)
        sd = dict(self._consolidated) if self._consolidated is not None else rank_state_dict(self)
        for post in self._optimizer_state_dict_post_hooks.values():
            out = post(self, sd)
            sd = sd if out is None else out
        return sd

    def full_state_dict(self) -> dict[str, Any]:
        """This optimizer's state in ``torch.optim.AdamW``'s format on rank 0 (``{}`` on other
        ranks), gathered one parameter at a time. Every rank."""
        from shardopt.checkpoint import full_state_dict  # checkpoint builds on the optimizer

        return full_state_dict(self)

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``torch.optim.AdamW``-format state dict (rank 0's is used; others may pass ``{}``)
        at any world size; the master weights are taken from the model's current weights. Every rank."""
        from shardopt.checkpoint import load_full_state_dict

        load_full_state_dict(self, state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore either a ``state_dict`` taken on this rank at the same world size, or a whole
        state in ``torch.optim.AdamW``'s format (a plain AdamW's, ``full_state_dict``'s or
        ``consolidate_state_dict``'s) at any world size, where rank 0's copy is used; write the
        restored master weights into the model. Every rank, all with the same kind of dict."""
        sd = state_dict.copy() if isinstance(state_dict, dict) else state_dict
        for pre in self._optimizer_load_state_dict_pre_hooks.values():  # torch.optim's hooks, as torch runs them
            out = pre(self, sd)
            sd = sd if out is None else out
        self._load_state_dict(sd)
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)

    def _load_state_dict(self, sd: Any) -> None:
        """``load_state_dict`` between torch's hooks. Like every call that every rank must make, it
        starts with the entry message (``checkpoint._adamw.settle``): a call on some ranks only
        raises on every rank that made it, naming it, instead of meeting another call's messages
        with messages of other sizes. Every rank."""
        from shardopt.checkpoint._adamw import load_settled, settle
        from shardopt.checkpoint._files import agree

        comm = self.internals.comm
        with comm.during("load_state_dict()"):
            settle(self, "load_state_dict")
            kind = ("rank" if isinstance(sd, dict) and sd.get("format") == STATE_FORMAT else
                    "adamw" if isinstance(sd, dict) and (("state" in sd and "param_groups" in sd)
                                                        or (not sd and comm.rank != 0)) else "other")
            kinds = agree(comm, None, kind)
            if len(set(kinds)) > 1 or kind == "other":
                raise ValueError(f"load_state_dict got {kinds[comm.rank]!r} here and {kinds} on ranks "
                                 "0..N-1 ('rank' = a shardopt rank state dict, 'adamw' = torch.optim.AdamW's "
                                 "format, 'other' = neither): every rank must load the same kind of state dict; to "
                                 "change the world size load an 'adamw' one or use shardopt.load_checkpoint")
            self._consolidated = None
            if kind == "adamw":
                load_settled(self, sd)
                return
            try:
                check_rank_state_dict(self, sd)
                error = None
            except (ValueError, KeyError, TypeError) as e:
                error = ValueError(str(e))
            agree(comm, error)  # a rank given another rank's shard makes every rank raise
            load_rank_state_dict(self, sd)
