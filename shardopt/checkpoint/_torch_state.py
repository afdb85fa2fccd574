"""``opt.state``: torch.optim's per-parameter state, read from this rank's shard, written back to it.

[Note: opt.state of a sharded optimizer]
torch.optim keeps ``opt.state[p]`` (a dict of tensors per parameter), and code around optimizers
reads it: logging of moments, frameworks that move the state to a device, torch's own tests. A
rank of ShardedAdamW holds only its shard, so ``opt.state`` is a mapping computed from the shard,
never a second copy:

* A parameter has an entry once it was stepped (its step count, the optimizer's steps minus the
  steps it was left out of, is above 0), as torch creates the entry at its first step.
* AdamW: ``"step"`` (a 0-d fp32 tensor, as torch's), and where this rank holds a piece of the
  parameter, ``"exp_avg"`` and ``"exp_avg_sq"`` (and ``"max_exp_avg_sq"`` with ``amsgrad``) over
  that piece only: 1-D fp32 tensors of ``inspect()``'s ``local`` size, the elements of the
  flattened parameter in its ``param_range``. With ``moments="fp32"`` they are views of the
  shard; with ``"bf16"`` or ``"8bit"`` decoded copies.
* Muon: ``"momentum_buffer"`` (torch.optim.Muon keeps no step) on the rank that owns the matrix,
  in the matrix's shape; other ranks hold no piece of it.
* A parameter is found by the model's parameter object (a DTensor parameter's too, not its
  stand-in, see core._dtensor). Parameters the optimizer does not train (frozen at construction)
  have no entry; assigning an entry for another tensor works as for a dict.

Whole tensors come from ``opt.full_state_dict()`` (every rank calls it; rank 0 gets them).

[Note: writes into opt.state]
torch's state is the tensors in ``opt.state[p]``: whatever code writes into them, in place or by
assigning a key, is the optimizer's state at the next step, and the step updates those very
tensors in place. Here every such write reaches the shard, and the tensors handed out stay the
state's, as torch's do:

* ``opt.state[p]`` is a ``StateEntry``, a dict (the same object again while something holds it)
  whose assignments are taken at once: ``["step"] = n`` sets the parameter's step count (its
  ``ParamRecord.lag`` behind the optimizer's, so the bias correction is torch's for that count);
  a state tensor of the piece's shape, or of the whole parameter's (this rank's piece is taken),
  is copied into the shard (rounded as a loaded checkpoint is). ``del opt.state[p]``,
  ``opt.state[p] = {}`` and ``opt.state[p].clear()`` restart the parameter as torch's next step
  would: moments zero, step count 0. Deleting one key, or a key torch's state does not have,
  raises.
* In-place writes into the tensors that are no views of the shard (the ``"step"`` tensor, decoded
  16-bit or 8-bit moments, tensors assigned into an entry) are found by their version counters
  and written back before anything reads the state: at the next ``step``, at every
  ``opt.state`` access, at ``state_dict`` and at every call that settles the ranks (checkpoints,
  ``load_state_dict``). A ``"step"`` written to a value that is not a whole number cannot be a
  step count: the next ``step`` raises on every rank.
* After each step the handed-out tensors still held are refreshed in place (torch's step updates
  its tensors in place); a load replaces the state, so what was handed out before is let go (as
  torch's ``load_state_dict`` leaves the old tensors behind).

What was handed out is held by the view until the next write-back, and after that only while
something else still holds it (released, then looked up through a weak reference: a tensor is
alive exactly while some Python name or some view of it holds it), so logging every moment holds
no decoded copy beyond one access, and a write into a tensor the user kept is never lost.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch
from torch import Tensor

from shardopt.core._compat import version
from shardopt.core._dtensor import is_dtensor, local_of

if TYPE_CHECKING:
    from shardopt.core._layout import Range
    from shardopt.core._records import ParamRecord
    from shardopt.group._flat_group import FlatGroup


def _no_delete(name: str, key: Any) -> str:
    return (f"deleting {key!r} from opt.state[p] of parameter {name}: its state keeps every key it has; assign a "
            "new value, or restart the parameter's state with del opt.state[p]")


class StateEntry(dict):
    """``opt.state[p]`` of a trained parameter: a dict of its state on this rank whose writes reach
    the shard (see [Note: writes into opt.state]). Copied or pickled, a plain dict."""

    __slots__ = ("__weakref__", "_found", "_view")

    def __init__(self, view: ParamStateView, found: tuple[FlatGroup, ParamRecord], values: dict[str, Any]) -> None:
        super().__init__(values)
        self._view, self._found = view, found

    def __setitem__(self, key: Any, value: Any) -> None:
        self._view.assign(self._found, self, key, value)

    def __delitem__(self, key: Any) -> None:
        raise TypeError(_no_delete(self._found[1].name, key))

    def pop(self, key: Any, *default: Any) -> Any:
        raise TypeError(_no_delete(self._found[1].name, key))

    def popitem(self) -> tuple[Any, Any]:
        raise TypeError(_no_delete(self._found[1].name, "an item"))

    def clear(self) -> None:
        self._view.restart(*self._found, keep=self)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def __ior__(self, other: Any) -> StateEntry:  # type: ignore[misc]
        self.update(other)
        return self

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return dict.get(self, key, default)

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self),)


@dataclass(eq=False)
class _Handed:
    """What ``opt.state[p]`` handed out for one trained parameter: its entry, and the tensors in
    it that are no views of the shard, each with the version counter it had when its values were
    last the optimizer's (see [Note: writes into opt.state])."""

    found: tuple[FlatGroup, ParamRecord]
    entry: StateEntry | None = None
    tensors: dict[str, Tensor] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)

    def watch(self, key: str, t: Tensor) -> None:
        """Watch ``t``, whose values are the optimizer's now, as the tensor of ``key``."""
        self.tensors[key], self.versions[key] = t, version(t)


class ParamStateView(MutableMapping):
    """``opt.state`` of one optimizer on this rank (see [Note: opt.state of a sharded optimizer]).

    ``buffers``: the optimizer's sharded buffers (group._flat_group.FlatGroup: their
    records, rule and moments are read, and written through ``Moments.write_piece`` and
    ``ParamRecord.resume``); ``order``: the trained parameters in param-group order; ``steps``:
    the optimizer's steps taken so far. Local; no communication."""

    def __init__(self, buffers: Sequence[FlatGroup], order: Sequence[Tensor], steps: Callable[[], int]) -> None:
        self._buffers, self._steps = list(buffers), steps
        # by the model's parameter (a DTensor parameter's, not its stand-in: see core._dtensor)
        self._found = {id(r.leaf): (b, r) for b in self._buffers for r in b.records}
        self._order = [p for p in order if id(p) in self._found]
        self._other: dict[Any, Any] = {}  # entries for tensors this optimizer does not train
        self._handed: dict[int, _Handed] = {}  # by id of the record: what opt.state[p] handed out
        self._problems: list[str] = []  # found writing back, reported by the next take_writes()
        self._param_ranges: dict[int, dict[int, Range]] = {}  # by id of a buffer: its pieces' param ranges

    def _record(self, p: object) -> tuple[FlatGroup, ParamRecord] | None:
        found = self._found.get(id(p))
        return found if found is not None and found[1].leaf is p else None

    @staticmethod
    def _param_steps(r: ParamRecord, steps: int) -> int:
        return steps - r.lag

    def has_entry(self, b: FlatGroup, r: ParamRecord, steps: int) -> bool:
        """Whether parameter ``r`` (of buffer ``b``) has state here after ``steps`` optimizer steps:
        it took a step, and (Muon) this rank owns it. A question, without reading the state."""
        return self._param_steps(r, steps) > 0 and (b.rule != "muon" or r.local is not None)

    def entry(self, b: FlatGroup, r: ParamRecord, steps: int) -> dict[str, Tensor]:
        """Parameter ``r``'s (of buffer ``b``) state as torch keeps it, after ``steps`` optimizer
        steps, in new tensors (views of the shard where ``b.moments.live``); empty before its
        first step. A question."""
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

    # -- writes into the state (see [Note: writes into opt.state]) ------------------------------
    @staticmethod
    def _keys(b: FlatGroup, r: ParamRecord, here: bool = True) -> set[str]:
        """The keys parameter ``r``'s entry has once it was stepped; ``here`` False: also those of
        the ranks that hold a piece of it (a whole-parameter value written there is cut to none)."""
        moments = set(b.moments.state_keys) if r.local is not None or not here else set()
        return moments if b.rule == "muon" else moments | {"step"}

    def _piece_of(self, b: FlatGroup, r: ParamRecord, key: str, value: Any, shape: tuple[int, ...]) -> Tensor | None:
        """``value`` written as state tensor ``key`` of ``r``, as this rank's 1-D piece: a tensor of
        the piece's ``shape`` as it is, one of the whole parameter's shape cut to the piece (None
        where this rank holds no piece). Raises ValueError for any other value."""
        if is_dtensor(value):
            value = local_of(value)  # a DTensor parameter's state, as torch.optim keeps it: its local piece
        if not isinstance(value, Tensor) or not value.is_floating_point():
            raise ValueError(f"opt.state[p][{key!r}] = {type(value).__name__} for parameter {r.name}: a state tensor "
                             "is a floating-point tensor")
        if r.local is not None and tuple(value.shape) == shape:
            return value.detach().reshape(-1)
        if tuple(value.shape) == r.span.shape:
            if r.local is None:
                return None
            ranges = self._param_ranges.get(id(b))
            if ranges is None:
                ranges = {piece.param: piece.param_range for piece in b.layout.shard_pieces(b.comm.shard_rank)}
                self._param_ranges[id(b)] = ranges
            return value.detach().reshape(-1)[ranges[r.index].as_slice()]
        here = f"its piece on this rank has shape {shape}" if r.local is not None else "this rank holds no piece of it"
        raise ValueError(f"opt.state[p][{key!r}] = a tensor of shape {tuple(value.shape)} for parameter {r.name} "
                         f"of shape {r.span.shape}: {here}; assign a tensor of the parameter's shape (this rank's "
                         "piece is taken) or of the piece's")

    def _step_count(self, r: ParamRecord, value: Any) -> int:
        """``value`` written as ``"step"``: the step count it sets. Raises ValueError for a value
        that is none."""
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and math.isfinite(value) and float(value) == int(value):
            return int(value)
        raise ValueError(f"opt.state[p]['step'] of parameter {r.name} was set to {value!r}: shardopt counts "
                         "each parameter's steps in whole steps; set it to a whole number (a tensor or a number)")

    def _write(self, found: tuple[FlatGroup, ParamRecord], key: str, value: Any, shape: tuple[int, ...]) -> None:
        """Make ``value`` the state of ``key``: a step count, or a piece copied into the shard.
        Raises ValueError where it cannot be. Local."""
        b, r = found
        if key == "step":
            r.resume(self._steps() - self._step_count(r, value))
            return
        piece = self._piece_of(b, r, key, value, shape)
        if piece is not None and r.local is not None:
            b.moments.write_piece(r.local, key, piece)

    @staticmethod
    def _shape(b: FlatGroup, r: ParamRecord, key: str) -> tuple[int, ...]:
        """The shape of state tensor ``key`` in ``r``'s entry (see ``entry``)."""
        if key == "step":
            return ()
        local = cast("Range", r.local)
        whole = b.rule == "muon" and local.size == r.span.numel
        return r.span.shape if whole else (local.size,)

    def _fill(self, h: _Handed, fresh: dict[str, Tensor]) -> None:
        """Give ``h``'s entry the keys of ``fresh`` (its state as it reads now) that it lacks."""
        b = h.found[0]
        if h.entry is None:
            return
        for key, value in fresh.items():
            if key not in h.entry:
                dict.__setitem__(h.entry, key, value)
                if key == "step" or not b.moments.live:
                    h.watch(key, value)

    def assign(self, found: tuple[FlatGroup, ParamRecord], entry: StateEntry, key: Any, value: Any) -> None:
        """``entry[key] = value`` (``entry``: ``opt.state[p]`` of ``found``): taken into the shard
        at once; the entry then holds ``value`` where it is a tensor of the entry's own shape and
        dtype (watched for writes in place, as torch's state tensor), else the state as it reads
        now. Raises ValueError for a key or value the state cannot take. Local."""
        b, r = found
        keys = self._keys(b, r, here=False)
        if key not in keys:
            raise ValueError(f"opt.state[p][{key!r}] for parameter {r.name}: its state has the keys {sorted(keys)} "
                             "(where a rank holds a piece of it) (shardopt keeps no other per-parameter state; keep your own values "
                             "under another key of opt.state, e.g. opt.state['my_key'])")
        h = self._handed.get(id(r))
        if h is None or h.entry is not entry:
            raise TypeError(f"opt.state[p][{key!r}] = ... into a dict that is no longer opt.state[p] of parameter "
                            f"{r.name} (del opt.state[p], or a load, replaced the state); write into opt.state[p]")
        if value is dict.get(entry, key):
            return  # the tensor it holds, handed back (a framework moving the state to where it is): nothing new
        shape = self._shape(b, r, key) if key == "step" or r.local is not None else r.span.shape
        self._write(found, key, value, shape)
        h.tensors.pop(key, None)  # torch: the tensor it held before is no longer the state
        h.versions.pop(key, None)
        fresh = self.entry(b, r, self._steps())
        if isinstance(value, Tensor) and not is_dtensor(value) and key in fresh and \
                tuple(value.shape) == tuple(fresh[key].shape) and value.dtype == torch.float32:
            dict.__setitem__(entry, key, value)  # the state's tensor from now on, as in torch
            h.watch(key, value)
        elif key in fresh:
            dict.__setitem__(entry, key, fresh[key])
            if key == "step" or not b.moments.live:
                h.watch(key, fresh[key])
        else:
            dict.pop(entry, key, None)  # no state here (no piece on this rank, or no step taken)
        self._fill(h, fresh)

    def restart(self, b: FlatGroup, r: ParamRecord, *, keep: StateEntry | None = None) -> None:
        """Restart parameter ``r``'s state as torch's next step would after ``del opt.state[p]``:
        its moments zero, its step count 0. What was handed out for it is no longer its state,
        except ``keep`` (``opt.state[p].clear()``: torch's next step fills that very dict), emptied. Local."""
        if r.local is not None:
            for key in b.moments.state_keys:
                b.moments.write_piece(r.local, key, torch.zeros(r.local.size))
        r.resume(self._steps())
        self._handed.pop(id(r), None)
        if keep is not None:
            dict.clear(keep)
            self._handed[id(r)] = _Handed((b, r), keep)

    def _write_back(self) -> None:
        """Take the in-place writes into what was handed out, then let go of what nothing else
        holds (see [Note: writes into opt.state]). Local."""
        for h in list(self._handed.values()):
            for key in list(h.tensors):
                if version(h.tensors[key]) != h.versions[key]:
                    try:
                        self._write(h.found, key, h.tensors[key], tuple(h.tensors[key].shape))
                    except ValueError as e:  # written in place, found here: raised by the next step on every rank
                        self._problems.append(str(e))
                    h.versions[key] = version(h.tensors[key])
            self._let_go(h)

    def _let_go(self, h: _Handed) -> None:
        # Drop the view's own references, then take back what is still alive: what something else
        # holds (a name, a dict, a view of a tensor). No other reference is held here meanwhile.
        entry_ref = weakref.ref(h.entry) if h.entry is not None else None
        refs = {k: weakref.ref(t) for k, t in h.tensors.items()}
        h.entry, h.tensors = None, {}
        h.entry = entry_ref() if entry_ref is not None else None
        for k, ref in refs.items():
            alive = ref()
            if alive is not None:
                h.tensors[k] = alive
        alive = None
        h.versions = {k: h.versions[k] for k in h.tensors}
        if h.entry is None and not h.tensors:
            del self._handed[id(h.found[1])]

    def take_writes(self) -> list[str]:
        """Take every write into what ``opt.state`` handed out since the last time; returns the
        problems found since then (each once), for the caller to raise on every rank. Local."""
        self._write_back()
        problems, self._problems = self._problems, []
        return problems

    def refresh(self) -> None:
        """After a step: the handed-out tensors still held hold the new state, in place, as torch's
        step leaves its state tensors; an entry handed out before the parameter's first step gets
        its keys. Local."""
        steps = self._steps()
        for h in self._handed.values():
            fresh = self.entry(*h.found, steps)
            for key, t in h.tensors.items():
                if key in fresh:
                    with torch.no_grad():
                        t.copy_(fresh[key].reshape(t.shape))
                    h.versions[key] = version(t)
            self._fill(h, fresh)

    def forget(self) -> None:
        """A load replaced the state: what was handed out before is no longer it. Local."""
        self._handed, self._problems = {}, []

    # -- the mapping -----------------------------------------------------------------------
    def __getitem__(self, p: Any) -> Any:
        found = self._record(p)
        if found is None:
            return self._other.setdefault(p, {})  # torch's defaultdict(dict)
        self._write_back()
        b, r = found
        h = self._handed.setdefault(id(r), _Handed(found))
        if h.entry is None:
            values: dict[str, Any] = dict(self.entry(b, r, self._steps()))
            for key, value in values.items():
                if key in h.tensors:
                    values[key] = h.tensors[key]  # the same tensor again, as torch's
                elif key == "step" or not b.moments.live:
                    h.watch(key, value)
            h.entry = StateEntry(self, found, values)
        return h.entry

    def __setitem__(self, p: Any, value: Any) -> None:
        found = self._record(p)
        if found is None:
            self._other[p] = value
            return
        b, r = found
        if not isinstance(value, Mapping):
            raise TypeError(f"opt.state[p] = {type(value).__name__} for parameter {r.name}: a parameter's state is a "
                            "dict of its state tensors")
        entry = self[p]
        if value is entry:
            return
        if not value:
            self.restart(b, r)
            return
        keys = self._keys(b, r)
        if set(value) not in (keys, self._keys(b, r, here=False)):  # also a whole state, as every rank may give
            raise ValueError(f"opt.state[p] = a dict with the keys {sorted(value)} for parameter {r.name}: its state "
                             f"on this rank has the keys {sorted(keys)}; give all of them (or {{}} to restart it)")
        for k, v in value.items():
            if dict.get(entry, k) is not v:  # a framework handing back what it holds, moved nowhere: nothing to do
                entry[k] = v

    def get(self, p: Any, default: Any = None) -> Any:
        """``opt.state.get(p)``: as a dict's (torch's defaultdict's) get, it adds no entry."""
        found = self._record(p)
        if found is None:
            return self._other.get(p, default)
        self._write_back()
        if not self.has_entry(*found, self._steps()):
            return default
        return self[p]

    def __delitem__(self, p: Any) -> None:
        found = self._record(p)
        if found is not None:
            self.restart(*found)
            return
        del self._other[p]

    def __iter__(self) -> Iterator[Any]:
        self._write_back()
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
        self._write_back()
        return self.has_entry(*found, self._steps())

    def __repr__(self) -> str:
        return f"ParamStateView({len(self)} parameters with state on this rank)"
