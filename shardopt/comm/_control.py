"""shardopt's own control group: the gloo group over which the ranks' small messages travel.

Owns the group (made once per set of ranks, ``control_group``), what a rank does when a message
did not arrive within its deadline or found the others gone (``ControlGroup.give_up``, the line it
leaves in the default store), and where each rank's process is, so that a survivor names the
ranks that died (``ended_ranks``). The messages themselves (their layout, the call headers, a
call's entry) are ``_messages``; ``_collectives.Comm`` sends them.

[Note: shardopt's own control group]
Every small message by which the ranks agree (the step's all-reduce, each backward pass's round
tag, the entry of a checkpoint call, the usage checks, the construction check and the objects
gathered on error paths) goes over a gloo group of shardopt's own, over the same ranks as the
optimizer's group, made once per set of ranks (``control_group``). The data (bucket reductions,
weight gathers, DCP's tensors) stays on the optimizer's group. So a collective of the user's on
that group (a ``dist.barrier()``, an ``all_reduce`` of the loss for logging) can never pair with
one of shardopt's messages: a rank in ``save_checkpoint`` while the others are in a barrier waits
on a group the barrier does not touch, gives up after its entry deadline and names the call
(``_messages.enter``), instead of mixing buffers of different sizes (gloo aborts the
process) or waiting out the group's timeout. The messages that start each optimizer call all have
one shape (``_messages.StepMessage``), so ranks in different calls always meet and tell each
other which call they are in. The group is gloo whatever the data's backend (NCCL's collectives
cannot be waited with a deadline and resumed); the messages are a few hundred bytes, copied to
the host.

A message waits for each rank's part at most its deadline (a call's entry: the call's; else the
optimizer's ``timeout``; else the group's): gloo gets that deadline as the message's own timeout
(its ``timeout`` option), so gloo alone decides whether it arrived. gloo applies it to each wait
for a rank's part in turn, so ranks that arrive one after another, each within the deadline of
the one before, stretch a message past it (the error then says how long it waited in all, from
when it was issued); a deadline of the whole message would need the message to be ended from
outside gloo while gloo still waits, which would leave it in flight. When it did not arrive, gloo
ends the message in its worker thread and closes the group's connections on this rank: nothing is
left in flight. So a rank that raises can exit (torch's teardown joins the group's worker
threads, and a thread still waiting would keep the process, and the job, alive until the group's
timeout), and a rank that comes later cannot pair its message with the one given up on: its
message fails at once on a closed connection. The rank that gave up marks the group broken (every
later use on that rank raises why) and leaves one line in the default store (``ControlGroup.key``)
saying which call it gave up in and after how long; a rank whose message fails on a closed
connection reads that line, raises naming its own call and the other's, and marks its group broken
too. One window is left, as in any agreement by messages with a deadline: a late rank's message
can complete on its side in the instant the other's deadline passes; the late rank then goes on
into the call alone until its next control message (a checkpoint call's next agreement) fails on
the closed connection. Where no rank gave up, the rank at the other end died; each rank leaves
where its process is in the default store when it makes a control group (boot id, pid namespace,
pid), so that a survivor on the same machine names the ranks whose process has ended
(``Comm.ended_peers``), looked up at once, before the survivors that raise end too.

[Note: a message is an exchange]
A control message is one collective on the control group. A small one (its copies to every rank
at most ``_collectives.EXCHANGE_BYTES``, 1 MiB: every message that opens a call, the round tags,
the model axes' follow-ups, the objects of error paths) is an *exchange*: an all-to-all in which
each rank sends its numbers to every rank, and each rank then combines the N rows it received in
rank order (the sum in fp64, rounded once; the max) — the same rows, the same order, so the same
bits on every rank, as every decision taken from a message needs. gloo's all-reduce is a ring:
2 (N - 1) hops one after the other, each a round trip of the network's latency, whatever the size
(gloo's ``allreduce`` chooses its ring algorithm when none is asked for, and ProcessGroupGloo asks
for none). The exchange is one hop: every rank posts its N - 1 sends and receives at once, and
what grows with N is each rank's N - 1 small sends (a few microseconds each) and N copies of the
message (at 1,024 ranks, 160 KB in and out per message). A larger message (the usage checks'
bitmaps, a parameter per element) is an all-reduce, where bandwidth, not latency, is what counts.
Both have the same failure semantics: gloo ends either at its deadline (its ``timeout`` option)
and closes the group's connections on the rank that gave up, so that a late rank's message fails
at once on a closed connection rather than pairing with it (see [Note: shardopt's own control
group]). Every rank picks the same kind for a message: its size is the same on every rank.
"""
from __future__ import annotations

import atexit
import weakref
import datetime
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch.distributed as dist

from shardopt.comm._pending import says_timed_out
from shardopt.core._compat import default_store, group_timeout

ProcessGroup = Any  # torch.distributed.ProcessGroup; None means the default group


_NOTICE_WAIT = 1.0  # seconds a rank looks for the line of a rank that gave up (written just after it closed)
# why a connection closed when no rank left a line saying it gave up: the rank at its other end ended
_PEER_DIED = ("another rank died (its process ended: killed, or it raised an error of its own; its output says why) "
              "and its connections closed")


class ControlTimeout(TimeoutError):
    """A control message that did not arrive within its deadline (``waited`` seconds); this rank
    gave up on the control group (see [Note: shardopt's own control group])."""

    def __init__(self, message: str, waited: float = 0.0) -> None:
        super().__init__(message)
        self.waited = waited


class ControlGone(RuntimeError):
    """A control message that found the other ranks' connections closed; ``why``: the line a rank
    that gave up left (``noticed``), or else that a peer's process ended (see [Note: shardopt's own
    control group])."""

    def __init__(self, message: str, why: str = "", noticed: bool = False) -> None:
        super().__init__(message)
        self.why = why
        self.noticed = noticed


def _first_line(error: BaseException) -> str:
    """The first line of torch's ``error`` (gloo's are long), or its class's name."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


@dataclass(eq=False)  # one object per group, hashed by identity (held in _MADE_GROUPS)
class ControlGroup:
    """shardopt's gloo group over one set of ranks (see [Note: shardopt's own control group])."""

    group: Any  # a gloo process group (its collectives are called as methods: it may be torch's or ours)
    world: Any  # the default group it was made under
    timeout: datetime.timedelta  # a message's limit when neither its call nor the optimizer sets one: the group's
    store: Any = None  # the default store, where a rank that gave up leaves its line; None: there is none
    key: str = ""  # that line's key, alike on every rank of the group
    broken: str = ""  # once this rank gave up on the group, or found it closed: why; every later use raises it

    def give_up(self, why: str, notice: str = "") -> None:
        """Stop using the group on this rank: every later use raises ``why``. A later call restates
        it (the caller that knows the call, after the comm's own words; nothing else reaches a broken
        group). ``notice``: one line for the other ranks (which rank gave up, in which call, after how
        long), left in the store. Local."""
        self.broken = why
        if notice and self.store is not None:
            try:
                self.store.set(self.key, notice)
            except (RuntimeError, OSError, ValueError):
                pass  # the store's host is gone too: the others give the reason without the line

    def let_go(self) -> None:
        """Drop this rank's references to the group, its default group and its store (at
        interpreter exit, ``_let_go``): every later use raises. Local."""
        self.group = self.world = self.store = None
        self.broken = self.broken or "the interpreter is exiting: shardopt let go of its control group"

    def notice(self, wait: float) -> str:
        """The line a rank that gave up on the group left (``give_up``), looked for during up to
        ``wait`` seconds; "" when there is none. Local."""
        if self.store is None:
            return ""
        until = time.monotonic() + wait
        while True:
            try:
                if self.store.check([self.key]):
                    return self.store.get(self.key).decode(errors="replace")
            except (RuntimeError, OSError, ValueError):
                return ""
            if time.monotonic() >= until:
                return ""
            time.sleep(0.02)


_CONTROL: dict[tuple[int, ...], ControlGroup] = {}  # by the global ranks it spans, under one default group
_MADE: dict[tuple[int, ...], int] = {}  # control groups made for each set of ranks, in this process
_MADE_GROUPS: weakref.WeakSet[ControlGroup] = weakref.WeakSet()  # every one still held (by a comm), for _let_go


@atexit.register
def _let_go() -> None:
    """At interpreter exit, drop every reference shardopt holds to a control group, its default
    group and its store, also those of optimizers the script still holds: a gloo group freed
    among the last objects of interpreter teardown (an optimizer at a script's top level holds
    one through its comm) aborts the process there ("terminate called without an active
    exception") in about half of 3-rank launches, after the work was done. Freed here, while the
    interpreter runs, as torch frees its own groups. A message sent after this raises. Local."""
    for control in [*_CONTROL.values(), *_MADE_GROUPS]:
        control.let_go()
    _CONTROL.clear()
    _MADE_GROUPS.clear()


def control_group(group: ProcessGroup, connect: float | None = None) -> ControlGroup:
    """shardopt's control group over the ranks of ``group`` (None: the default group), made at the
    first call for these ranks: every rank of ``group`` must make that call at the same point (the
    optimizer's construction, or a weights-only ``load_checkpoint``). ``connect``: seconds to wait
    for the other ranks to connect (default: ``group``'s timeout); TimeoutError past that.

    Over every rank of the job it is ``new_group``'s: every rank makes it at the same point, so
    torch names it alike everywhere and tears it down in ``destroy_process_group`` with its own.
    Over a subgroup it is made from the default store under a prefix of shardopt's own, named by
    the ranks and how many were made for them before: ``new_group`` would need every rank of the
    job, and ``new_group(use_local_synchronization=True)`` names a group by how many groups the
    process holds, which differs between ranks that belong to different subgroups (they would wait
    for each other under different names)."""
    world = dist.group.WORLD
    parent = group if group is not None else world
    ranks = tuple(dist.get_process_group_ranks(parent))
    if any(c.world is not world for c in _CONTROL.values()):  # made under a destroyed default group
        _CONTROL.clear()
    if ranks in _CONTROL:
        return _CONTROL[ranks]
    timeout, store = group_timeout(parent), default_store()
    if store is not None:  # where this rank's process is, for the others' message if it dies (ended_ranks)
        leave_line(_PROCESS_KEY.format(dist.get_rank()), _this_process())
    wait = timeout if connect is None else datetime.timedelta(seconds=connect)
    n = _MADE[ranks] = _MADE.get(ranks, -1) + 1  # alike on every rank of the group: they make it at the same point
    name = f"shardopt-control/{'_'.join(map(str, ranks))}/{n}/"
    try:
        if ranks == tuple(range(dist.get_world_size())):  # every rank is here: torch's own group, torch's lifetime
            made = dist.new_group(list(ranks), backend="gloo", timeout=wait)
        elif store is None:  # see _compat.default_store
            made = dist.new_group(list(ranks), backend="gloo", timeout=wait, use_local_synchronization=True)
        else:
            prefix = dist.PrefixStore(name, store)
            made = dist.ProcessGroupGloo(prefix, ranks.index(dist.get_rank()), len(ranks), wait)
    except RuntimeError as e:
        if not says_timed_out(e):
            raise
        why = (f"rank {dist.get_rank()}: the other ranks of the group {list(ranks)} did not join shardopt's control "
               f"group within {wait.total_seconds():g} s: every rank of the group must build the optimizer (or call a "
               "weights-only load_checkpoint) at the same point")
        # The ranks now count the groups made for these ranks differently: a later try would wait under
        # another name than theirs. Every later use on this rank raises instead.
        _CONTROL[ranks] = ControlGroup(None, world, timeout, store=store, key=name + "gave-up",
                                       broken=f"shardopt can no longer agree with the ranks {list(ranks)} on this "
                                              f"rank: {why}. Restart every rank")
        raise TimeoutError(why) from None
    found = _CONTROL[ranks] = ControlGroup(made, world, timeout, store=store, key=name + "gave-up")
    _MADE_GROUPS.add(found)
    return found


_PROCESS_KEY = "shardopt-process/{}"  # by global rank, in the default store: where that rank's process is


def _this_process() -> str:
    """This process as another process on the same machine can look it up: the kernel's boot id,
    the pid namespace and the pid; "" without Linux's ``/proc``. Local."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot} {namespace} {os.getpid()}"


def _here(line: str) -> str:
    """The pid in ``line`` (``_this_process``) where that process runs on this machine, in this pid
    namespace (its ``/proc`` entry is this one's to read); else "". Local."""
    here, there = _this_process().rsplit(" ", 1)[0], line.rsplit(" ", 1)
    return there[1] if here and len(there) == 2 and there[0] == here and there[1].isdigit() else ""


def _has_ended(pid: str) -> bool:
    """Whether the process ``pid`` of this machine is gone or a zombie (ended, not yet reaped by
    its launcher). Local."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[:1]  # the field after the command's name
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return state in (["Z"], ["X"])


def ended_ranks(ranks: Sequence[int], wait: float = 0.0) -> list[int]:
    """Those of the global ``ranks`` whose process is known to have ended, looked for during up to
    ``wait`` seconds (a process that closed its connections may take a moment to end): each rank
    leaves where its process is in the default store when it makes a control group, and a process
    of this machine can be looked up. None where there is no store, it cannot be reached (its host
    was the rank that died), or the ranks run elsewhere. Local."""
    pids = {r: pid for r in ranks if (pid := _here(read_line(_PROCESS_KEY.format(r)) or ""))}
    until = time.monotonic() + wait
    while True:
        ended = [r for r, pid in pids.items() if _has_ended(pid)]
        if ended or not pids or time.monotonic() >= until:
            return ended
        time.sleep(0.05)


def leave_line(key: str, text: str) -> None:
    """Leave ``text`` under ``key`` in the default store, for other ranks' messages; nothing where
    there is no store, or it cannot be reached. Local."""
    store = default_store()
    if store is None:
        return
    try:
        store.set(key, text)
    except (RuntimeError, OSError, ValueError):
        pass


def read_line(key: str) -> str | None:
    """The text a rank left under ``key`` (``leave_line``); None when there is none (or no store).
    Does not wait. Local."""
    store = default_store()
    if store is None:
        return None
    try:
        return store.get(key).decode(errors="replace") if store.check([key]) else None
    except (RuntimeError, OSError, ValueError):
        return None
