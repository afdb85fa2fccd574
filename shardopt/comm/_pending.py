"""Handles of collectives in flight (``Pending``) and the counters they add to.

A collective is issued asynchronously and its handle waited on explicitly, exactly once; one
handle may hold several collectives issued together (a bucket's reduction on the rank-order path:
two all-to-alls). What runs once its data has arrived (``then``, a named step of whoever issued
it) may start more (a follow-up). Shared by the comm and its bucket paths (``_collectives``,
``_bucket_paths``).
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Callable, NoReturn, Protocol, cast

from shardopt.core._records import Gather


class Waiter(Protocol):
    """What a handle asks of the comm that issued it (``_collectives.Comm``)."""

    timeout: float | None  # seconds before a waiting rank raises TimeoutError; None: the group's own
    host_waits: bool  # its data collectives are waited on the host (gloo); else on the device's stream (NCCL)

    def timed_out(self, waited: float, limit: str = ...) -> str: ...

    def control_failed(self, error: Exception, waited: float) -> NoReturn: ...

    def collective_failed(self, error: Exception, what: str, source: str = "") -> NoReturn: ...


@dataclass
class CommStats:
    """Communication on this rank since the last reset."""

    reduce_bytes: int = 0  # gradient bytes fed into reductions (all-reduce or reduce-scatter input)
    gather_bytes: int = 0  # parameter bytes assembled by all-gathers (output size)
    cross_bytes: int = 0  # hybrid sharding: bytes fed into the cross-replica all-reduces of gradient pieces
    collectives: int = 0  # collective calls issued (a gloo all-gather counts one per sending rank)
    wait_seconds: float = 0.0  # time spent blocked in wait() on those collectives
    control_messages: int = 0  # of the collectives, shardopt's own small all-reduces on its control group
    control_seconds: float = 0.0  # of wait_seconds, the time blocked on those messages

    def reset(self) -> None:
        """Zero the counters in place (handles in flight keep adding their wait time here)."""
        self.reduce_bytes = self.gather_bytes = self.cross_bytes = self.collectives = self.control_messages = 0
        self.wait_seconds = self.control_seconds = 0.0


@dataclass
class Pending(Gather):
    """Handles of collectives in flight, plus tensors that must stay alive until they finish."""

    works: list = field(default_factory=list)
    keep_alive: list = field(default_factory=list)
    stats: CommStats | None = None
    then: Callable[[], Pending | None] | None = None  # local work once the data has arrived; may start more
    done: bool = False
    comm: Waiter | None = None  # for its deadline and the name of the call waiting (see Comm.timeout)
    overlap: bool = False  # a follow-up that its issuer may wait on later (see wait_landed)
    deadline: float | None = None  # seconds to wait before giving up; None: the comm's timeout
    control: bool = False  # a message of the control group: gloo's own timeout is ``deadline`` (Comm.control_failed)
    what: str = "a collective of the optimizer's group"  # what the message of a failure names (Comm.collective_failed)
    issued: float = field(default_factory=time.monotonic)  # when it was issued: gloo's own wait starts there

    @property
    def collectives(self) -> int:
        """The collectives of this handle not yet waited: what it counts against a limit of
        collectives in flight (``_rounds.MAX_INFLIGHT``). A question."""
        return len(self.works)

    def arrived(self) -> bool:
        """True once every collective of this handle has finished (it still needs ``wait``); never blocks."""
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        """Block until these collectives and every follow-up they started have finished."""
        follow = self.wait_landed()
        while follow is not None:
            follow = follow.wait_landed()

    def wait_landed(self) -> Pending | None:
        """Block until these collectives finished and run ``then``; return the follow-up it started
        when that one may be waited on later (``overlap``), else wait for it too and return None."""
        if self.done:
            raise AssertionError("a collective handle was waited twice")
        start = time.perf_counter()
        timeout = self.deadline if self.deadline is not None else self.comm.timeout if self.comm is not None else None
        if not self.control and self.comm is not None and not self.comm.host_waits:
            timeout = None  # a device's data wait is the stream's, never the host's (see [Note: deadlines of data waits])
        # A control message's own gloo timeout is ``deadline``: gloo decides, this wait is a backstop.
        wait = None if timeout is None else timeout + (_GRACE if self.control else 0.0)
        limit = {} if wait is None else {"timeout": datetime.timedelta(seconds=wait)}
        for w in self.works:
            try:
                w.wait(**limit)
            except RuntimeError as e:
                if self.control:  # a control message has its comm and its deadline
                    # how long it waited in all: ranks that arrive one after another, each within gloo's
                    # timeout of a part of the message, stretch it past the deadline (see _control
                    # [Note: shardopt's own control group])
                    waited = max(cast(float, timeout), round(time.monotonic() - self.issued, 1))
                    cast(Waiter, self.comm).control_failed(e, waited)  # raises
                if timeout is not None and says_timed_out(e):  # a timeout: the comm's
                    raise TimeoutError(cast(Waiter, self.comm).timed_out(timeout)) from None
                if self.comm is None:
                    raise
                # A peer's connection closed (it died, or raised and exited) or the group's own timeout
                # passed: name the call in progress, not only gloo's words (see Comm.collective_failed).
                self.comm.collective_failed(e, self.what)
        if self.stats is not None:
            self.stats.wait_seconds += time.perf_counter() - start
            if self.control:
                self.stats.control_seconds += time.perf_counter() - start
        self.done = True
        self.works.clear()
        follow_up = self.then() if self.then is not None else None
        self.keep_alive.clear()
        if follow_up is not None and not follow_up.overlap:
            follow_up.wait()
            return None
        return follow_up


# [Note: deadlines of data waits]
# A data collective (a bucket's reduction, a weight gather) is waited with the optimizer's
# ``timeout`` only where the wait blocks the host anyway: gloo, whose collectives run on the CPU.
# On NCCL, ``Work.wait()`` without a timeout makes the current stream wait for the collective and
# returns at once, so backward passes and forwards go on issuing work while the collective runs;
# with a timeout it blocks the CPU thread until the collective has finished
# (``ProcessGroupNCCL.cpp``: "In case of blockingWait or a timeout value is specified by the user,
# we block the CPU thread"), which would turn the overlap off whenever ``timeout=`` is set. So on
# a device the data waits pass none, and the deadline is kept at the step's one sync instead: the
# step's message is copied to the host only once the device's stream reached it, polled up to the
# message's deadline (``Comm.control_all_reduce``); a collective that never completes (a peer in
# another call or gone) holds the stream there, and the rank raises naming the call, as a gloo
# wait would. The process group's own timeout and NCCL's watchdog stay the backstop for a rank
# that never reaches a step.

_GRACE = 2.0  # seconds a control message is waited for beyond its own gloo timeout, which ends it first


def says_timed_out(e: Exception) -> bool:
    """Whether torch's error says a wait ran out of time (gloo's and NCCL's wordings)."""
    return "imeout" in str(e) or "imed out" in str(e)

