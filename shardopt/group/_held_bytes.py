"""Memory accounting of the reduction path: gradient and communication-buffer bytes held on this
rank, and their high-water marks (``memory_report()``'s ``grads_peak``, ``buffers`` and ``held_peak``).

Kept apart from the reduction itself: the flat group reports what happened (a ``.grad`` produced or
taken, a buffer allocated or in flight). Each event updates a few integers (the ``.grad`` bytes kept
under ``no_sync`` are a running total) and one sum over the buffers held at that moment (a few
staging buffers at most); the marks are read when ``memory_report()`` asks. Local to this rank.

[Note: a gradient taken at once]
In the usual case a hook's gradient is taken as soon as it is produced, into a buffer that exists
already (``FlatGroup.take_fresh``): for that instant the bytes held are what was held before
plus that gradient, and nothing else changes. Such a hook only notes the gradient's size
(``spike``); the totals are summed at the next event that changes what is held (a buffer
allocated or freed, a collective issued or landed: ``buffers_changed``, or a slow hook's
``produced``), which first folds the largest such gradient into the high-water mark, as the sum
*before* the event plus that gradient. Exact as long as every change of the held bytes inside a
backward pass is followed by such an event before the next hook, which the scheduler
(``_rounds``) does after each landing and each launch.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from shardopt.core._records import ParamRecord


class _Buffers(Protocol):
    """What holds the buffers counted (a flat group)."""

    def buffer_bytes(self) -> int:
        """Its staging, fp32 sums and what its own reductions in flight hold now, bytes."""


class HeldBytes:
    """One flat group's bytes: its gradient storage, the ``.grad`` tensors autograd holds until they
    are taken (one just produced, and those kept across ``no_sync`` passes) and its buffers."""

    def __init__(self, grad_bytes: int, owner: _Buffers, total: HeldTotal) -> None:
        self.grad_bytes = grad_bytes  # the flat gradient (stage 1) or the gradient shard (stage 2), bytes
        # staging, fp32 sums and what this flat group's own reductions in flight hold now (receive buffers), bytes
        self._owner = owner
        self._loose_total = 0  # .grad kept across no_sync backward passes (ParamRecord.kept_bytes), bytes
        self._pending = 0  # the .grad autograd just produced, until taken, bytes
        self.grad_peak = 0  # high-water mark of grad_bytes + loose + pending, bytes
        self.buffer_peak = 0  # high-water mark of buffer_bytes(), bytes
        self.spiked = 0  # the largest .grad taken at once since the last event, bytes (see [Note: a gradient taken at once])
        self._total = total  # the optimizer's: told when the bytes held may have changed
        total.parts.append(self)

    def produced(self, r: ParamRecord, nbytes: int, keep: bool) -> None:
        """Autograd produced a ``.grad`` of ``nbytes`` (0: it is the storage itself) for parameter
        ``r``; held until taken, or across ``no_sync`` passes when ``keep``."""
        if keep and nbytes:
            self._loose_total += r.keep_bytes(nbytes)
        self._pending = 0 if r.kept_bytes else nbytes
        self.grad_peak = max(self.grad_peak, self.grad_bytes + self._loose_total + self._pending)
        self._total.note()

    @property
    def pending(self) -> int:
        """The ``.grad`` autograd produced last and the flat group did not take yet, bytes."""
        return self._pending

    def spike(self, nbytes: int) -> None:
        """A ``.grad`` of ``nbytes`` was produced and taken at once, with nothing else held
        changing (see [Note: a gradient taken at once])."""
        held = self.grad_bytes + self._loose_total + nbytes
        if held > self.grad_peak:
            self.grad_peak = held
        if nbytes > self.spiked:
            self.spiked = nbytes

    def unkeep(self, r: ParamRecord) -> None:
        """Parameter ``r``'s kept ``.grad`` is being taken."""
        self._loose_total += r.keep_bytes(0)

    def taken(self) -> None:
        """The ``.grad`` produced last is gone (moved into a buffer or a sum)."""
        self._pending = 0

    def forget(self, records: Sequence[ParamRecord]) -> None:
        """Gradients zeroed: no ``.grad`` of ``records`` is kept any more."""
        if self._loose_total:  # else no record keeps any
            for r in records:
                r.keep_bytes(0)
            self._loose_total = 0

    def buffers_changed(self) -> None:
        """A buffer was allocated or freed, or a collective issued or landed."""
        self.buffer_peak = max(self.buffer_peak, self._owner.buffer_bytes())
        self._total.note()

    def now(self, pending: bool = True) -> int:
        """Bytes held now; without ``pending``, leaving out the ``.grad`` produced last."""
        return self.grad_bytes + self._loose_total + (self._pending if pending else 0) + self._owner.buffer_bytes()

    def reset(self) -> None:
        """Restart the high-water marks from what is held now."""
        self.buffer_peak = self._owner.buffer_bytes()
        self.grad_peak = self.grad_bytes + self._loose_total
        self.spiked = 0


class HeldTotal:
    """The most bytes held at one moment over the flat groups of one optimizer. Each part counts its
    own buffers only (the receive buffers of its own reductions, see comm._bucket_paths.InFlight),
    so the sum over the parts counts each buffer once, also where they share a Comm."""

    def __init__(self) -> None:
        self.parts: list[HeldBytes] = []  # one per flat group, each added as it is built
        self._peak = 0  # bytes, without the gradients taken at once since the last event
        self._before = 0  # bytes held at the last event, without any .grad just produced

    def now(self, pending: bool = True) -> int:
        """Bytes held now; without ``pending``, the ``.grad`` each flat group produced last."""
        return sum(p.now(pending=pending) for p in self.parts)

    def _fold(self) -> None:
        """Fold the gradients taken at once since the last event into the mark (see [Note: a
        gradient taken at once])."""
        spiked = max(p.spiked for p in self.parts)
        if spiked:
            self._peak = max(self._peak, self._before + spiked)
            for p in self.parts:
                p.spiked = 0

    def note(self) -> None:
        """What is held may have changed: fold, then take the mark from the sums."""
        self._fold()
        self._before = self.now(pending=False)
        self._peak = max(self._peak, self._before + sum(p.pending for p in self.parts))

    @property
    def peak(self) -> int:
        """The most bytes held at one moment since the last ``reset``."""
        self._fold()
        return self._peak

    def reset(self) -> None:
        for p in self.parts:
            p.spiked = 0
        self._before = self.now(pending=False)
        self._peak = self._before + sum(p.pending for p in self.parts)
