"""``opt.state``: torch.optim's per-parameter state, read from this rank's shard.

[Note: opt.state of a sharded optimizer]
torch.optim keeps ``opt.state[p]`` (a dict of tensors per parameter), and code around optimizers
reads it: logging of moments, frameworks that move the state to a device, torch's own tests. A
rank of ShardedAdamW holds only its shard, so ``opt.state`` is a mapping computed from the shard
at each access, never a second copy:

* A parameter has an entry once it was stepped (its step count, the optimizer's steps minus the
  steps it was left out of, is above 0), as torch creates the entry at its first step.
* AdamW: ``"step"`` (a 0-d fp32 tensor, as torch's), and where this rank holds a piece of the
  parameter, ``"exp_avg"`` and ``"exp_avg_sq"`` (and ``"max_exp_avg_sq"`` with ``amsgrad``) over
  that piece only: 1-D fp32 tensors of ``inspect()``'s ``local`` size, the elements of the
  flattened parameter in its ``param_range``. With ``moments="fp32"`` they are views of the
  shard (an in-place write changes the optimizer's state); with ``"bf16"`` or ``"8bit"``
  decoded copies.
* Muon: ``"momentum_buffer"`` (torch.optim.Muon keeps no step) on the rank that owns the matrix,
  in the matrix's shape; other ranks hold no piece of it.
* Parameters the optimizer does not train (frozen at construction) have no entry; assigning an
  entry for another tensor works as for a dict.

Whole tensors come from ``opt.full_state_dict()`` (every rank calls it; rank 0 gets them).
Assigning ``opt.state[p] = ...`` for a trained parameter raises unless it hands back the tensors
the entry holds (what a framework moving the state to its own device does): the state lives in
the shard, and a write there must go through the tensors in place or a state dict.
"""
from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch
from torch import Tensor

if TYPE_CHECKING:
    from shardopt.core._layout import Range
    from shardopt.core._records import ParamRecord
    from shardopt.update._sharded_buffer import ShardedBuffer


class ParamStateView(MutableMapping):
    """``opt.state`` of one optimizer on this rank (see [Note: opt.state of a sharded optimizer]).

    ``buffers``: the optimizer's sharded buffers (update._sharded_buffer.ShardedBuffer: their
    records, rule and moments are read); ``order``: the trained parameters in param-group order;
    ``steps``: the optimizer's steps taken so far. Local; no communication."""

    def __init__(self, buffers: Sequence[ShardedBuffer], order: Sequence[Tensor], steps: Callable[[], int]) -> None:
        self._buffers, self._steps = list(buffers), steps
        self._found = {id(r.leaf): (b, r) for b in self._buffers for r in b.records}
        self._order = [p for p in order if id(p) in self._found]
        self._other: dict[Any, Any] = {}  # entries for tensors this optimizer does not train

    def _record(self, p: object) -> tuple[ShardedBuffer, ParamRecord] | None:
        found = self._found.get(id(p))
        return found if found is not None and found[1].param is p else None

    @staticmethod
    def _param_steps(r: ParamRecord, steps: int) -> int:
        return steps - r.lag

    def has_entry(self, b: ShardedBuffer, r: ParamRecord, steps: int) -> bool:
        """Whether parameter ``r`` (of buffer ``b``) has state here after ``steps`` optimizer steps:
        it took a step, and (Muon) this rank owns it. A question, without reading the state."""
        return self._param_steps(r, steps) > 0 and (b.rule != "muon" or r.local is not None)

    def entry(self, b: ShardedBuffer, r: ParamRecord, steps: int) -> dict[str, Tensor]:
        """Parameter ``r``'s (of buffer ``b``) state as torch keeps it, after ``steps`` optimizer
        steps; empty before its first step. A question."""
        if not self.has_entry(b, r, steps):
            return {}
        if b.rule == "muon":
            local = cast("Range", r.local)  # has_entry: this rank owns the matrix
            piece = b.moments.state_piece(local)
            return {k: v.view(r.span.shape) if local.size == v.numel() == r.span.numel else v
                    for k, v in piece.items()}
        out: dict[str, Tensor] = {"step": torch.tensor(float(self._param_steps(r, steps)), dtype=torch.float32)}
        if r.local is not None:
            out.update(b.moments.state_piece(r.local))
        return out

    def other_entries(self) -> dict[Any, Any]:
        """The entries stored under keys that are not tensors (``opt.state["my_key"]``), which
        travel with the state dict as torch's do; without decoding any parameter's piece. A query."""
        return {k: v for k, v in self._other.items() if not isinstance(k, Tensor)}

    def __getitem__(self, p: Any) -> Any:
        found = self._record(p)
        if found is None:
            return self._other.setdefault(p, {})  # torch's defaultdict(dict)
        return self.entry(*found, self._steps())

    def __setitem__(self, p: Any, value: Any) -> None:
        found = self._record(p)
        if found is None:
            self._other[p] = value
            return
        held = self.entry(*found, self._steps())
        same = isinstance(value, dict) and set(value) == set(held) and all(
            k == "step" or (isinstance(v, Tensor) and v.data_ptr() == held[k].data_ptr() and v.shape == held[k].shape)
            for k, v in value.items())
        if not same:
            raise TypeError(f"opt.state[p] = ... for parameter {found[1].name}: shardopt keeps each parameter's "
                            "state in this rank's shard, and opt.state[p] is read from it; write into the tensors of "
                            "opt.state[p] in place (moments='fp32'), or load a state dict (opt.load_state_dict, "
                            "shardopt.load_checkpoint)")

    def __delitem__(self, p: Any) -> None:
        if self._record(p) is not None:
            raise TypeError("del opt.state[p]: shardopt keeps each parameter's state in this rank's shard; "
                            "it cannot forget one parameter's state (build a new optimizer to start afresh)")
        del self._other[p]

    def __iter__(self) -> Iterator[Any]:
        steps = self._steps()
        for p in self._order:
            if self.has_entry(*self._found[id(p)], steps):
                yield p
        yield from self._other

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, p: object) -> bool:
        found = self._record(p)
        if found is None:
            return p in self._other
        return self.has_entry(*found, self._steps())

    def __repr__(self) -> str:
        return f"ParamStateView({len(self)} parameters with state on this rank)"
