"""A param group's hyperparameters through a checkpoint or a state dict: written as JSON into the
manifest, and restored over the group's current values, tensors kept tensors.

[Note: tensor hyperparameters]
torch.optim takes ``lr`` as a one-element tensor (and an LR scheduler then keeps ``initial_lr`` as
one), and computes a tensor-lr step in the tensor's dtype: the same value as a Python float gives
other bits (see kernels.reference [Note: a tensor learning rate]). So a resume is exact only if the
tensor comes back a tensor, of its dtype. The manifest is JSON: a one-element tensor is written as
its number (``Tensor.item()``: exact, a double holds every fp32, bf16 or fp16 value), and its dtype
and shape under the group's ``"tensor_hyperparameters"``. Restoring (``restored``), a value the
group holds as a tensor now is written into that tensor in place, in its dtype, as an LR scheduler
writes it: whoever holds it (the scheduler reads it through the group) sees the loaded value, and
a checkpoint written before the dtype was recorded resumes exactly too. Where the group holds a
number, the saved kind wins, as in ``torch.optim.Optimizer.load_state_dict``: a tensor recorded
(or found in a state dict) comes back as a tensor of its own, never one that aliases the dict's.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

TENSORS = "tensor_hyperparameters"  # a manifest group's key: {name: {"dtype", "shape"}} of its tensor values


def jsonable(v: Any, where: str) -> Any:
    """``v`` as JSON holds it: numbers, strings, lists and dicts; a one-element tensor as its number
    (``tensor_kinds`` records what it was). Raises TypeError naming ``where`` for anything else. Local."""
    if isinstance(v, (tuple, list)):
        return [jsonable(x, where) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x, f"{where}[{k!r}]") for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, Tensor) and v.numel() == 1:
        return v.item()
    raise TypeError(f"{where} is a {type(v).__name__}; checkpoints keep numbers, strings, lists and dicts here")


def tensor_kinds(group: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The dtype and shape of each one-element tensor among ``group``'s values, by key: what the
    manifest records beside their numbers (see [Note: tensor hyperparameters]). Local."""
    return {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
            for k, v in group.items() if isinstance(v, Tensor) and v.numel() == 1}


def _number(v: Any) -> bool:
    if isinstance(v, Tensor):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def restored(current: Any, saved: Any, kind: dict[str, Any] | None = None) -> Any:
    """The value a param group's hyperparameter takes when ``saved`` (a number, a list from JSON, a
    tensor from a state dict) is restored over its ``current`` one; ``kind``: the dtype and shape
    the manifest recorded for it (``tensor_kinds``), if any. A tensor ``current`` is written in
    place and returned (see [Note: tensor hyperparameters]). Local."""
    if isinstance(current, Tensor) and current.numel() == 1 and _number(saved):
        with torch.no_grad():
            current.fill_(saved.item() if isinstance(saved, Tensor) else saved)
        return current
    if isinstance(saved, Tensor):
        return saved.detach().clone()
    if kind is not None and _number(saved):
        return torch.tensor(saved, dtype=getattr(torch, kind["dtype"])).reshape(kind["shape"])
    if isinstance(saved, list) and isinstance(current, tuple):
        return tuple(saved)
    return saved


def restore_group(group: dict[str, Any], saved: dict[str, Any], *, keys: Any = None,
                  tuples: tuple[str, ...] = ("betas",)) -> None:
    """Restore the hyperparameters of ``saved`` (a manifest's or a state dict's param group) into
    ``group`` (a live param group), each through ``restored``; ``keys``: only those (a container),
    default every key but ``"params"``; ``tuples``: keys restored as tuples where ``saved`` holds a
    list (JSON has no tuples). Local."""
    kinds = saved.get(TENSORS) or {}
    for k, v in saved.items():
        if k in ("params", TENSORS) or (keys is not None and k not in keys):
            continue
        value = restored(group.get(k), v, kinds.get(k))
        group[k] = tuple(value) if k in tuples and isinstance(value, list) else value
