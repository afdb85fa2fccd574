"""Memory accounting of the reduction path: gradient and communication-buffer bytes held on this
rank, and their high-water marks (``memory_report()``'s ``grads_peak``, ``buffers`` and ``held_peak``).

Kept apart from the reduction itself: the reducer reports what happened (a ``.grad`` produced or
taken, a buffer allocated or in flight). Each event updates a few integers (the ``.grad`` bytes kept
under ``no_sync`` are a running total) and one sum over the buffers held at that moment (a few
staging buffers at most); the marks are read when ``memory_report()`` asks. Local to this rank.
"""
from __future__ import annotations

from typing import Callable, Sequence

from shardopt.core._records import ParamRecord


class HeldBytes:
    """One reducer's bytes: its gradient storage, the ``.grad`` tensors autograd holds until they
    are taken (one just produced, and those kept across ``no_sync`` passes) and its buffers."""

    def __init__(self, grad_bytes: int, buffer_bytes: Callable[[bool], int]) -> None:
        self.grad_bytes = grad_bytes  # the flat gradient (stage 1) or the gradient shard (stage 2), bytes
        self._buffer_bytes = buffer_bytes  # staging, fp32 sums and (True) the Comm's receive buffers now, bytes
        self._loose_total = 0  # .grad kept across no_sync backward passes (ParamRecord.kept_bytes), bytes
        self._pending = 0  # the .grad autograd just produced, until taken, bytes
        self.grad_peak = 0  # high-water mark of grad_bytes + loose + pending, bytes
        self.buffer_peak = 0  # high-water mark of buffer_bytes(True), bytes
        self.on_change: Callable[[], None] = lambda: None  # told when the bytes held may have grown

    def produced(self, r: ParamRecord, nbytes: int, keep: bool) -> None:
        """Autograd produced a ``.grad`` of ``nbytes`` (0: it is the storage itself) for parameter
        ``r``; held until taken, or across ``no_sync`` passes when ``keep``."""
        if keep and nbytes:
            self._loose_total += r.keep_bytes(nbytes)
        self._pending = 0 if r.kept_bytes else nbytes
        self.grad_peak = max(self.grad_peak, self.grad_bytes + self._loose_total + self._pending)
        self.on_change()

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

    def buffers_grew(self) -> None:
        """A buffer was allocated or a collective issued."""
        self.buffer_peak = max(self.buffer_peak, self._buffer_bytes(True))
        self.on_change()

    def now(self, comm: bool = True) -> int:
        """Bytes held now; without ``comm``, leaving out the Comm's receive buffers (shared by the
        reducers of one optimizer)."""
        return self.grad_bytes + self._loose_total + self._pending + self._buffer_bytes(comm)

    def reset(self) -> None:
        """Restart the high-water marks from what is held now."""
        self.buffer_peak = self._buffer_bytes(True)
        self.grad_peak = self.grad_bytes + self._loose_total


class HeldTotal:
    """The most bytes held at one moment over the reducers of one optimizer, whose Comm is shared."""

    def __init__(self, parts: Sequence[HeldBytes], comm_live_bytes: Callable[[], int]) -> None:
        self.parts, self._comm = list(parts), comm_live_bytes
        for p in self.parts:
            p.on_change = self.note
        self.peak = 0  # bytes

    def now(self) -> int:
        return sum(p.now(comm=False) for p in self.parts) + self._comm()

    def note(self) -> None:
        self.peak = max(self.peak, self.now())

    def reset(self) -> None:
        self.peak = self.now()
