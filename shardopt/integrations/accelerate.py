"""ShardedAdamW inside Hugging Face Accelerate.

``prepare(accelerator, model, optimizer, *others)`` stands in for ``accelerator.prepare``; after
it, the standard Accelerate loop works unchanged: ``accelerator.backward(loss)``,
``accelerator.clip_grad_norm_``, ``accelerator.accumulate(model)``, ``accelerator.save_state()``
and ``load_state()``. It owns how one ``Accelerator`` is taught about shardopt:

- the model is placed and autocast-wrapped by Accelerate but not wrapped in DDP (the optimizer
  reduces the gradients itself, one bucket at a time during backward);
- the optimizer is wrapped in ``ShardedAcceleratedOptimizer``, Accelerate's own wrapper (which
  steps and zeroes only when gradients are synchronised) that also exposes ShardedAdamW's methods;
- ``backward``, ``clip_grad_norm_`` and ``no_sync`` of that accelerator instance are routed to
  the optimizer (loss scaling, the true global norm, local fp32 accumulation), and its
  ``save_state``/``load_state`` write and read the optimizer as a sharded checkpoint in a
  ``shardopt`` folder inside the state folder, loadable at another number of processes.

See docs/design.md [Note: teaching an Accelerator] for why the instance is patched.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable, Iterator

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import Tensor

from shardopt.checkpoint import load_checkpoint, save_checkpoint
from shardopt.integrations._convert import from_torch_adamw
from shardopt.loss_scale import LossScaler
from shardopt.optimizer import ShardedAdamW

CHECKPOINT_DIR = "shardopt"  # the sharded optimizer checkpoint's folder inside a saved state
_PATCHED = ("prepare", "backward", "clip_grad_norm_", "no_sync", "save_state", "load_state")
_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.XLA)

__all__ = ["CHECKPOINT_DIR", "ShardedAcceleratedOptimizer", "install", "prepare"]


class ShardedAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper around a ShardedAdamW: ``step``/``zero_grad`` do nothing
    while gradients are being accumulated, as for any optimizer, and ShardedAdamW's own methods
    (``clip_grad_norm_``, ``no_sync``, ``backward``, ``memory_report``, ...) stay reachable."""

    def __init__(self, optimizer: ShardedAdamW) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)  # state already lives with its shard

    def __getattr__(self, name: str) -> Any:  # only for names the wrapper itself lacks
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped for inf/NaN gradients (on every rank alike)."""
        return bool(self.optimizer.step_was_skipped)


def _params(opt: ShardedAdamW) -> set[int]:
    return {id(p) for g in opt.param_groups for p in g["params"]}


def _unwrapped(opt: Any) -> Any:
    while isinstance(opt, AcceleratedOptimizer):
        opt = opt.optimizer
    return opt


def _unshared(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every tensor copied out of the flat buffer it is a view of: safetensors refuses
    tensors that share storage. Tied weights become two equal tensors, as safetensors wants them."""
    return {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in state.items()}


class _LoadInto(torch.nn.Module):
    """Stands in for a model while Accelerate loads its weights file: safetensors' ``load_model``
    refuses a model whose tensors share one storage (they are views of the flat buffer), so it is
    shown no tensors of its own and its ``load_state_dict`` goes to the real model."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.__dict__["target"] = model  # not a submodule: state_dict() stays empty

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.target.load_state_dict(state_dict, strict=strict)


class _Binding:
    """What one Accelerator knows about shardopt: the ShardedAdamW it prepared and the model that
    optimizer trains, and the accelerator's own methods that it stands in front of."""

    def __init__(self, accelerator: Accelerator, shardopt_kwargs: dict[str, Any] | None) -> None:
        self.accelerator = accelerator
        self.shardopt_kwargs = shardopt_kwargs  # for a torch.optim.AdamW that prepare() converts
        self.original = {name: getattr(accelerator, name) for name in _PATCHED}
        self.model: torch.nn.Module | None = None
        self.opt: ShardedAdamW | None = None
        self.wrapped: ShardedAcceleratedOptimizer | None = None
        accelerator.register_save_state_pre_hook(self._before_save)
        accelerator.register_load_state_pre_hook(self._before_load)
        for name in _PATCHED:
            setattr(accelerator, name, getattr(self, name))

    # -- prepare -------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """``Accelerator.prepare``, except that a ShardedAdamW (or, through ``shardopt.integrations.
        accelerate.prepare``, a plain AdamW) and the model it trains are prepared without DDP."""
        acc = self.accelerator
        convert = self.shardopt_kwargs is not None
        mine = [i for i, a in enumerate(args) if isinstance(_unwrapped(a), ShardedAdamW)
                or convert and type(a) is torch.optim.AdamW]
        if not mine:
            return self.original["prepare"](*args, device_placement=device_placement)
        if len(mine) > 1 or self.opt is not None and _unwrapped(args[mine[0]]) is not self.opt:
            raise ValueError("one Accelerator trains one ShardedAdamW; put all param groups into one optimizer")
        if acc.distributed_type in _UNSUPPORTED:
            raise ValueError(f"ShardedAdamW replaces DDP and shards the optimizer itself; it does not run under "
                             f"Accelerate's {acc.distributed_type.value} (launch without a DeepSpeed/FSDP/Megatron "
                             "config, e.g. `accelerate launch --multi_gpu` or plain torchrun)")
        placement = list(device_placement) if device_placement is not None else [None] * len(args)
        out = list(args)
        given = args[mine[0]]
        base = _unwrapped(given)
        ids = _params(base)
        for i, a in enumerate(args):
            if isinstance(a, torch.nn.Module):
                trainable = [p for p in a.parameters() if p.requires_grad]
                covered = [id(p) in ids for p in trainable]
                if any(covered):
                    if not all(covered):
                        raise ValueError(f"the optimizer covers {sum(covered)} of the model's {len(trainable)} "
                                         "trainable parameters; give ShardedAdamW all of them (freeze the rest)")
                    out[i] = acc.prepare_model(a, device_placement=placement[i], evaluation_mode=True)  # no DDP
                    self.model = acc.unwrap_model(out[i])
        for m in acc._models:
            if isinstance(m, torch.nn.parallel.DistributedDataParallel) and any(id(p) in ids for p in m.parameters()):
                raise ValueError("this model was prepared (wrapped in DDP) before its ShardedAdamW: prepare them in "
                                 "one call, accelerator.prepare(model, optimizer, ...), so that DDP is not used")
        opt = base if isinstance(base, ShardedAdamW) else from_torch_adamw(base, **self.shardopt_kwargs)
        self._check_devices(opt)
        for a in args:  # a scheduler built on the AdamW now drives the ShardedAdamW that replaced it
            if isinstance(a, torch.optim.lr_scheduler.LRScheduler) and a.optimizer is base and opt is not base:
                a.optimizer = opt
        self._take_over_fp16(opt)
        if self.wrapped is None or self.opt is not opt:
            self.opt, self.wrapped = opt, ShardedAcceleratedOptimizer(opt)
            self.wrapped._is_accelerate_prepared = True
        if self.wrapped not in acc._optimizers:
            acc._optimizers.append(self.wrapped)
        out[mine[0]] = self.wrapped
        rest = [i for i, a in enumerate(args) if out[i] is a and i != mine[0]]
        if rest:
            done = self.original["prepare"](*[args[i] for i in rest],
                                            device_placement=None if device_placement is None else
                                            [placement[i] for i in rest])
            for i, d in zip(rest, done if len(rest) > 1 else (done,)):
                out[i] = d
        return out[0] if len(out) == 1 else tuple(out)

    def _check_devices(self, opt: ShardedAdamW) -> None:
        moved = opt.parameters_moved()
        if moved:
            raise ValueError(f"the model was moved after its ShardedAdamW was built ({moved[0]}); build the "
                             "optimizer after moving the model (model.to(accelerator.device)), or pass a "
                             "torch.optim.AdamW to shardopt.integrations.accelerate.prepare, which converts it after "
                             "placing the model")

    def _take_over_fp16(self, opt: ShardedAdamW) -> None:
        """fp16 autocast scales the loss with torch's GradScaler, which cannot see sharded gradients:
        the optimizer's own dynamic scaler does it instead (``backward`` below)."""
        acc = self.accelerator
        if acc.scaler is None:
            return
        if type(opt._scaler) is LossScaler:  # no scaling at all
            raise ValueError("mixed_precision='fp16' needs loss scaling, and shardopt does it itself: build the "
                             "optimizer with ShardedAdamW(..., loss_scale='dynamic') (or pass loss_scale='dynamic' "
                             "to shardopt.integrations.accelerate.prepare)")
        acc.scaler = None  # autocast stays; the GradScaler goes

    # -- the training loop ------------------------------------------------------------------
    def backward(self, loss: Tensor, **kwargs: Any) -> None:
        """``Accelerator.backward``: the loss divided by the accumulation steps, through the
        optimizer (which scales it when a loss scale is active). Every rank."""
        if self.opt is None:
            return self.original["backward"](loss, **kwargs)
        kwargs.pop("learning_rate", None)
        self.opt.backward(loss / self.accelerator.gradient_accumulation_steps, **kwargs)

    def clip_grad_norm_(self, parameters: Iterable[Tensor] | Tensor, max_norm: float,
                        norm_type: float = 2.0) -> Tensor:
        """``Accelerator.clip_grad_norm_``: for the ShardedAdamW's parameters, the global norm over
        all ranks and shards (returned, before clipping). Every rank."""
        params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        if self.opt is None:
            return self.original["clip_grad_norm_"](params, max_norm, norm_type)
        ids = _params(self.opt)
        given = {id(p) for p in params if p.requires_grad}
        if not given & ids:
            return self.original["clip_grad_norm_"](params, max_norm, norm_type)
        if given != ids:
            raise ValueError(f"clip_grad_norm_ got {len(given)} trainable parameters, {len(given & ids)} of them the "
                             f"ShardedAdamW's {len(ids)}: it clips the global norm of all of the optimizer's "
                             "parameters at once; pass model.parameters()")
        return self.opt.clip_grad_norm_(max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """``Accelerator.no_sync``: for the ShardedAdamW's model, gradients accumulate locally (in
        fp32) and are reduced at the next backward outside it."""
        if self.opt is not None and model is not None and self.model is not None and \
                self.accelerator.unwrap_model(model) is self.model:
            with self.opt.no_sync():
                yield
        else:
            with self.original["no_sync"](model):
                yield

    # -- saved state -------------------------------------------------------------------------
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
        if self.opt is None:
            return
        for i, m in enumerate(models):
            if i < len(weights) and self.accelerator.unwrap_model(m) is self.model:
                weights[i] = _unshared(weights[i])
        save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR), self.model, self.opt)

    def _before_load(self, models: list, input_dir: str) -> None:  # ``models`` holds the _LoadInto
        if self.opt is None:
            return
        path = os.path.join(input_dir, CHECKPOINT_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{input_dir} holds no shardopt optimizer checkpoint ({CHECKPOINT_DIR}/); it was "
                                    "not saved by an accelerator prepared with shardopt.integrations.accelerate")
        load_checkpoint(path, self.model, self.opt)


def install(accelerator: Accelerator, shardopt_kwargs: dict[str, Any] | None = None) -> Accelerator:
    """Teach ``accelerator`` about ShardedAdamW (idempotent): its ``prepare`` then prepares a
    ShardedAdamW and its model without DDP, and its ``backward``, ``clip_grad_norm_``, ``no_sync``,
    ``save_state`` and ``load_state`` route through the optimizer. With ``shardopt_kwargs`` (a
    dict, possibly empty), ``prepare`` also converts a plain ``torch.optim.AdamW`` into a
    ShardedAdamW with those arguments (``stage``, ``master_weights``, ...). Every rank."""
    binding = getattr(accelerator, "_shardopt", None)
    if binding is None:
        accelerator._shardopt = _Binding(accelerator, shardopt_kwargs)
    elif shardopt_kwargs is not None:
        binding.shardopt_kwargs = shardopt_kwargs
    return accelerator


def prepare(accelerator: Accelerator, *objects: Any, device_placement: list[bool] | None = None,
            **shardopt_kwargs: Any) -> Any:
    """``accelerator.prepare(*objects)`` for training with ShardedAdamW: pass the model, a
    ``shardopt.ShardedAdamW`` (or a ``torch.optim.AdamW``, converted with ``shardopt_kwargs`` such as
    ``stage=2``, ``master_weights="fp32"``), and the dataloaders and schedulers; returns them
    prepared, in order. Every rank."""
    install(accelerator, shardopt_kwargs)
    return accelerator.prepare(*objects, device_placement=device_placement)
