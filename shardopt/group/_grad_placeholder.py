"""What ``p.grad`` holds in stage 2 once a gradient has been reduced: a placeholder without values.

(It also stands in, in either stage, for a 16-bit gradient that is being summed in fp32 under
``no_sync``, so that zeroing between micro-batches is seen.)

[Note: the stage-2 gradient placeholder]
In stage 2 each rank keeps only its shard of the averaged gradient, so ``p.grad`` cannot hold
the gradient. Leaving it ``None`` would make two ordinary things silently wrong: code that clips
or inspects ``p.grad`` (``torch.nn.utils.clip_grad_norm_``) would find no gradient and do nothing,
and ``model.zero_grad()`` would have nothing to clear, so the optimizer could not tell whether
the next backward should start from zero or add to the gradient it holds (torch adds unless the
gradient was zeroed). So after each reduction ``p.grad`` is a :class:`GradPlaceholder`: a tensor
with the parameter's shape, dtype and device but no storage.

* ``model.zero_grad()`` (``p.grad = None``) or ``p.grad.zero_()`` is seen by the flat group at the
  start of the next backward (or at ``step``), which then zeroes that parameter's part of the
  gradient shard: zeroing works exactly as in torch, through the model or the optimizer.
* Anything else that reads the values (a norm, a clip, arithmetic) raises a ``RuntimeError``
  that says what to call instead, on every rank that does it, rather than computing with a
  gradient that is not there.
* When autograd accumulates a new gradient into a placeholder (no zeroing since the last step),
  the placeholder keeps it as ``pending`` until the flat group's post-accumulate hook adds it to the
  shard. In the usual loop (zeroing every step) autograd finds ``p.grad is None`` and stores the
  gradient as a plain tensor: the placeholder costs no hook and no work per parameter.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from shardopt.core._compat import disabled_torch_function, make_wrapper_subclass
from shardopt.core._records import Placeholder

_aten = torch.ops.aten
_ZEROING = {_aten.zero_.default, _aten._foreach_zero_.default}

MESSAGE = ("this parameter is trained by a shardopt optimizer with stage=2, which keeps only this rank's shard of the averaged "
           "gradient, so p.grad holds no values (it was read by {op}). To clip by norm, call "
           "opt.clip_grad_norm_(max_norm) (the global norm over all ranks and shards) instead of "
           "torch.nn.utils.clip_grad_norm_. Clipping by value (torch.nn.utils.clip_grad_value_), a plain torch.optim "
           "optimizer over this parameter and torch.amp.GradScaler.unscale_ need every element of p.grad: use stage=1, "
           "which keeps the full averaged gradient in p.grad (for fp16, the optimizer scales the loss itself through "
           "opt.backward(loss): no GradScaler is needed). p.grad = None and p.grad.zero_() work as usual")
ACCUMULATING = ("this parameter's 16-bit gradient is being summed in fp32 by the optimizer under opt.no_sync(), so "
                "p.grad holds no values until the backward of the last micro-batch, outside no_sync (it was read by "
                "{op}); read gradients after that backward, or pass accumulate_dtype=None to sum them in p.grad in "
                "16 bits; p.grad = None and p.grad.zero_() work as usual")

LEFT = ("the shardopt optimizer that held this parameter's gradient no longer trains it (closed, superseded or "
        "collected), and p.grad holds no values (it was read by {op}): the gradient is kept as that optimizer's shard "
        "until a new ShardedAdamW is built over the parameter on every rank, which puts it in p.grad as a whole "
        "tensor and steps on it; p.grad = None and p.grad.zero_() work as usual")


class GradPlaceholder(Placeholder):
    """A storage-less stand-in for a stage-2 parameter's gradient (see the module docstring)."""

    zeroed: bool  # p.grad.zero_() was called on it since the flat group last looked
    pending: Tensor | None  # gradient autograd added to it since the flat group last took one
    accumulating: bool  # it stands for a 16-bit gradient summed in fp32 under no_sync (else: stage-2 shards)
    # Once its optimizer stopped training the parameter: (what holds the values, the parameter's index
    # in its buffer, whether it had a gradient on this rank); see _left_grads. None while it trains.
    left: tuple[Any, int, bool] | None

    @staticmethod
    def __new__(cls: type[GradPlaceholder], like: Tensor, *, dtype: torch.dtype | None = None,
                device: torch.device | None = None) -> GradPlaceholder:
        t = make_wrapper_subclass(cls, like.shape, dtype=dtype or like.dtype, device=device or like.device,
                                  requires_grad=False)
        t.zeroed = t.accumulating = False
        t.pending = t.left = None
        return t

    def leave(self, left: Any, index: int, used: bool) -> None:
        """Its optimizer no longer trains the parameter: ``left`` (a ``_left_grads.LeftGrads``) holds
        the values it stands for, at parameter ``index`` of that buffer; ``used``: the parameter had a
        gradient on this rank (see _left_grads [Note: gradients left to the next optimizer])."""
        self.left = (left, index, used)

    __torch_function__ = disabled_torch_function  # only __torch_dispatch__ below

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:  # type: ignore[override]  # torch's stub leaves out func
        if func in _ZEROING:
            targets = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            for t in targets:
                if not isinstance(t, GradPlaceholder):
                    t.zero_()
                else:
                    t.zeroed, t.pending = True, None
            return None if func is _aten._foreach_zero_.default else args[0]
        if func is _aten.add_.Tensor and isinstance(args[0], GradPlaceholder):
            # Autograd accumulating a new gradient into p.grad (p.grad += new; with create_graph it
            # adds out of place, which is refused below): held until the flat group's hook moves it
            # into the shard, which already holds the rest of the gradient.
            ph, new = args[0], args[1]
            alpha = (kwargs or {}).get("alpha", 1)
            new = new if alpha == 1 else new * alpha
            ph.pending = new if ph.pending is None else ph.pending + new
            return ph
        if func is _aten._to_copy.default:  # module.to(...) converts .grad along with the parameter
            kw = kwargs or {}
            converted = GradPlaceholder(args[0], dtype=kw.get("dtype"), device=kw.get("device"))
            converted.left = args[0].left  # the values it stands for, once its optimizer let it go
            return converted
        if func in (_aten.detach.default, _aten.alias.default):
            return args[0]
        if func is _aten.add.Tensor and isinstance(args[0], GradPlaceholder):
            raise RuntimeError("autograd added a new gradient out of place to the gradient the optimizer (stage=2) "
                               "holds in shards (a backward with create_graph=True, or compiled autograd), which "
                               "it cannot do: call opt.zero_grad() (or model.zero_grad()) before that backward")
        flat = [x for a in args for x in (a if isinstance(a, (list, tuple)) else [a])]
        accumulating = any(isinstance(a, GradPlaceholder) and a.accumulating for a in flat)
        left = any(isinstance(a, GradPlaceholder) and a.left is not None for a in flat)
        raise RuntimeError((LEFT if left else ACCUMULATING if accumulating else MESSAGE).format(op=func))

    def __repr__(self) -> str:  # type: ignore[override]
        return f"GradPlaceholder(shape={tuple(self.shape)}, dtype={self.dtype}: held as shards by a shardopt optimizer, stage 2)"


def pending_of(grad: Tensor | None) -> Tensor | None:
    """The gradient autograd accumulated into ``p.grad`` last: a placeholder's ``pending`` part,
    else ``grad`` itself. A question (``take_pending`` takes it). With ``is_placeholder``, the one
    place that tells a placeholder by its type: after ``module.to(...)`` ``p.grad`` may be a
    converted placeholder that no record placed."""
    return grad.pending if isinstance(grad, GradPlaceholder) else grad


def take_pending(grad: Tensor | None) -> Tensor | None:
    """``pending_of(grad)``, taken out of the placeholder."""
    if isinstance(grad, GradPlaceholder):
        pending, grad.pending = grad.pending, None
        return pending
    return grad


def is_placeholder(grad: Tensor | None) -> bool:
    """``grad`` is a placeholder (its parameter's own or a converted one)."""
    return isinstance(grad, GradPlaceholder)
