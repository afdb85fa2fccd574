"""Which ShardedAdamW trains a parameter.

[Note: one optimizer per parameter] A ShardedAdamW hooks every parameter it trains (its flat group
takes each gradient as autograd produces it, stage 2 leaving a placeholder in ``p.grad``). A
second optimizer built over the same parameters, as frameworks do on every ``fit`` or after a
learning-rate finder, must not find the first one still taking the gradients: building it takes
the parameters over, and the first is released (hooks removed, its last gathers waited for) and
refuses further steps. The registry holds weak references only, and nothing is stored on the
parameters themselves, so models still pickle and deep-copy.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Iterable, NoReturn

from torch import Tensor
from torch.utils.hooks import RemovableHandle

# id(parameter) -> (weak parameter, weak optimizer); keyed by id because tensors compare elementwise.
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref, bool]] = {}  # (weak parameter or its anchor, weak optimizer, anchored)

# weak owner -> the handles of the hooks that work for it (see [Note: hooks of a freed optimizer]).
# Grouped by owner, so that the check at every step() looks at a few owners, not at every hook.
_HOOKS: dict[weakref.ref, list[RemovableHandle]] = {}


# [Note: hooks of a freed optimizer]
# Every hook a ShardedAdamW installs (gradient hooks on the parameters, module and global forward
# pre-hooks, state-dict pre-hooks) holds its state weakly and does nothing once the optimizer is
# freed. Its handle is kept here, strongly (a RemovableHandle holds its hooks dict weakly, so a
# handle kept only by the freed optimizer would go with it), under a weak reference to the object
# the hook works for. The garbage collector never removes them: a collection may run while
# torch.compile traces a module call, whose guards read the hook dicts (a hook removed there breaks
# the compilation). They are removed at the next safe point instead: the next optimizer's
# construction and every step(), both outside compiled code.
def owned_hook(handle: RemovableHandle, ref: weakref.ref) -> RemovableHandle:
    """Keep ``handle``, of a hook that works for the object behind ``ref``, to remove the hook once
    that object is gone; returns ``handle``. Local."""
    _HOOKS.setdefault(ref, []).append(handle)
    return handle


def remove_freed_hooks() -> None:
    """Remove every hook whose owner is gone (see [Note: hooks of a freed optimizer]). Local; call
    outside compiled code."""
    for ref in [r for r in _HOOKS if r() is None]:
        for handle in _HOOKS.pop(ref):
            handle.remove()


def take_over(opt: Lifetime, params: Iterable[Tensor], anchors: dict[int, Tensor] | None = None) -> None:
    """Make ``opt`` the optimizer of ``params``, releasing any other ShardedAdamW that trained
    one of them. ``anchors``: by ``id`` of a parameter, what to hold a weak reference to in its
    place (a DTensor parameter's stand-in: torch cannot swap a tensor that has weak references,
    see core._dtensor). Local (every rank builds its optimizers the same way)."""
    previous: dict[int, Lifetime] = {}
    anchors = anchors or {}
    for key in [k for k, (p, o, _) in _OWNERS.items() if p() is None or o() is None]:
        del _OWNERS[key]  # parameters or optimizers gone
    for p in params:
        entry = _OWNERS.get(id(p))
        old = entry[1]() if entry is not None and (entry[2] or entry[0]() is p) else None
        if old is not None and old is not opt:
            previous[id(old)] = old
        anchor = anchors.get(id(p))
        _OWNERS[id(p)] = (weakref.ref(p if anchor is None else anchor), weakref.ref(opt), anchor is not None)
    for old in previous.values():
        old._release(f"superseded: a newer {type(opt).__name__} was built over the same parameters and trains "
                     "them now")


_NO_COPY = ("{how} a {cls} is not supported: its state is sharded over the ranks of a process group and "
            "the model's parameters are views of its flat buffers, so a copy could not train. Copy the model and build "
            "a new {cls} over the copy on every rank, then new_opt.load_state_dict(opt.state_dict()); to save "
            "the optimizer use opt.state_dict() or shardopt.save_checkpoint")


class Lifetime:
    """The end of a ShardedAdamW's life: ``close``, being superseded (``take_over``), being
    collected, and copies refused. A mixin over the optimizer's own attributes."""

    _closed: str | None  # why it no longer trains, once released (set by the optimizer)
    if TYPE_CHECKING:
        def finish_param_gather(self) -> None: ...

    def close(self) -> None:
        """Stop training: wait for the last weight gathers, remove every hook this optimizer put on
        the parameters and modules; ``step`` and ``backward`` then raise. Building another
        ShardedAdamW over the same parameters does this to the old one. Local."""
        self._release("closed")

    def _release(self, why: str) -> None:
        if self.__dict__.get("_closed") is not None:
            return
        self.finish_param_gather()
        self._remove_hooks()
        self._closed = why

    def _remove_hooks(self) -> None:
        # self.__dict__, not attribute lookup: a wrapper that imitates this class (LightningOptimizer)
        # must not remove the hooks of the optimizer it wraps when it is collected.
        rounds = self.__dict__.get("_rounds")
        if rounds is not None:
            rounds.release()
        for name in ("_gather_hook", "_ddp_watch"):
            hook = self.__dict__.get(name)
            if hook is not None:
                hook.remove()
                self.__dict__[name] = None

    def __deepcopy__(self, memo: dict) -> NoReturn:
        raise TypeError(_NO_COPY.format(how="deep-copying (copy.deepcopy)", cls=type(self).__name__))

    def __getstate__(self) -> NoReturn:  # copy.copy, pickle, torch.save of the optimizer object
        raise TypeError(_NO_COPY.format(how="copying or pickling", cls=type(self).__name__))

    def _check_open(self) -> None:
        if self._closed is not None:
            then = "train with the newer one" if self._closed.startswith("superseded") else \
                f"build a new {type(self).__name__} over the parameters to train them again"
            raise RuntimeError(f"this optimizer ({type(self).__name__}) no longer trains, it is {self._closed}; {then}")

    def __del__(self) -> None:
        # Dropped with weight gathers in flight (a local of a function that returned right after
        # step()): wait for them, or gloo aborts the process at exit with collectives still running.
        with contextlib.suppress(Exception):
            gathers = self.__dict__.get("_gathers")
            if gathers is not None:
                gathers.wait_quietly()
        # Its hooks stay until the next safe point (see [Note: hooks of a freed optimizer]).
