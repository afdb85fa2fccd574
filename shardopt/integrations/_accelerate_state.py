"""How an Accelerator prepared with shardopt saves and loads its state: the one concern of
``shardopt.integrations.accelerate`` that touches files.

The ShardedAdamW goes into ``<state dir>/shardopt`` as a sharded checkpoint (loadable at another
number of processes), hidden from Accelerate's own saving, which would write rank 0's shard only;
the model's weights are views of one flat buffer, so they are saved from copies and loaded
through a stand-in (safetensors refuses tensors that share storage). ``SavedState`` is a mixin of
the accelerate binding: it reads the binding's ``accelerator``, ``model``, ``opt``, ``wrapped``
and ``original`` (the accelerator's own methods).
"""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import Tensor

from shardopt.checkpoint import load_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from shardopt.optimizer import ShardedAdamW

CHECKPOINT_DIR = "shardopt"  # the sharded optimizer checkpoint's folder inside a saved state


def _unshared(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every tensor copied out of the flat buffer it is a view of: safetensors refuses
    tensors that share storage. Tied weights become two equal tensors, as safetensors wants them."""
    return {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in state.items()}


class _LoadInto(torch.nn.Module):
    """Stands in for a model while Accelerate loads its weights file: safetensors' ``load_model``
    refuses a model whose tensors share one storage (they are views of the flat buffer), so it is
    shown no tensors of its own and its ``load_state_dict`` goes to the real model."""

    target: torch.nn.Module

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.__dict__["target"] = model  # not a submodule: state_dict() stays empty

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]  # any of torch's forms
        return {}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.target.load_state_dict(state_dict, strict=strict)


class SavedState:
    """The binding's ``get_state_dict``, ``save_state`` and ``load_state``, and the hooks Accelerate
    calls before it saves or loads."""

    # The binding's (accelerate._Binding):
    accelerator: Any  # accelerate's Accelerator, which has no type information
    model: torch.nn.Module | None
    opt: ShardedAdamW | None
    wrapped: object  # its ShardedAcceleratedOptimizer (accelerate.py, which imports this module)
    original: dict[str, Callable[..., Any]]

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """``Accelerator.get_state_dict``; for the ShardedAdamW's model, copies of the weights (they
        are views of one flat buffer, and safetensors, or Accelerate's clean-up of shared tensors
        before it in ``save_model``, would keep one tensor of them). Overlapped weight gathers are
        waited for by ``state_dict()`` itself (see _gather_wait). Any rank."""
        state = self.original["get_state_dict"](model, unwrap=unwrap)
        if self.model is not None and self.accelerator.unwrap_model(model) is self.model:
            state = _unshared(state)
        return state

    @contextlib.contextmanager
    def _without_mine(self, loading: bool = False) -> Iterator[None]:
        """Accelerate would save the optimizer's ``state_dict()`` from rank 0 only (one shard of it):
        it is hidden from Accelerate's own saving and loading; when loading, so is the model's
        shared storage (``_LoadInto``)."""
        acc, wrapped = self.accelerator, self.wrapped
        at = acc._optimizers.index(wrapped) if wrapped in acc._optimizers else None
        models = list(acc._models)
        if at is not None:
            acc._optimizers.remove(wrapped)
        if loading:
            acc._models[:] = [_LoadInto(m) if acc.unwrap_model(m) is self.model else m for m in models]
        try:
            yield
        finally:
            acc._models[:] = models
            if at is not None:
                acc._optimizers.insert(at, wrapped)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """``Accelerator.save_state``; the optimizer goes into ``<output_dir>/shardopt`` as a sharded
        checkpoint. Every rank."""
        with self._without_mine():
            return self.original["save_state"](output_dir, safe_serialization=safe_serialization, **kwargs)

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        """``Accelerator.load_state``, at any number of processes. Every rank."""
        with self._without_mine(loading=True):
            return self.original["load_state"](input_dir, **kwargs)

    def _before_save(self, models: list, weights: list, output_dir: str) -> None:
        if self.opt is None:  # weights: get_state_dict above copied them out of the flat buffer
            return
        model = self._check_model()
        save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR), model, self.opt)

    def _check_model(self) -> torch.nn.Module:
        if self.model is None:
            raise ValueError("the model this ShardedAdamW trains was not prepared by this accelerator: prepare it "
                             "through shardopt.integrations.accelerate.prepare (with the optimizer, or before it)")
        return self.model

    def _before_load(self, models: list, input_dir: str) -> None:  # ``models`` holds the _LoadInto
        if self.opt is None:
            return
        model = self._check_model()
        path = os.path.join(input_dir, CHECKPOINT_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{input_dir} holds no shardopt optimizer checkpoint ({CHECKPOINT_DIR}/); it was "
                                    "not saved by an accelerator prepared with shardopt.integrations.accelerate")
        load_checkpoint(path, model, self.opt)
