"""ShardedAdamW inside Hugging Face Accelerate.

``prepare(accelerator, model, optimizer, *others)`` stands in for ``accelerator.prepare``; after
it, the standard Accelerate loop works unchanged: ``accelerator.backward(loss)``,
``accelerator.clip_grad_norm_``, ``accelerator.accumulate(model)``, ``accelerator.save_state()``
and ``load_state()``. It owns how one ``Accelerator`` is taught about shardopt:

- the model is placed and autocast-wrapped by Accelerate but not wrapped in DDP (the optimizer
  reduces the gradients itself, one bucket at a time during backward);
- the optimizer is wrapped in ``ShardedAcceleratedOptimizer``, Accelerate's own wrapper (which
  steps and zeroes only when gradients are synchronised) that also exposes ShardedAdamW's methods;
  a ``torch.optim.Muon`` with a ``torch.optim.AdamW`` for the other parameters becomes one
  ShardedMuon, whose wrapper is returned in both places (one ``step`` per round covers both);
- ``backward``, ``clip_grad_norm_`` and ``no_sync`` of that accelerator instance are routed to
  the optimizer (loss scaling, the true global norm, local fp32 accumulation), and its
  ``save_state``/``load_state`` write and read the optimizer as a sharded checkpoint in a
  ``shardopt`` folder inside the state folder, loadable at another number of processes.

See docs/design.md [Note: teaching an Accelerator] for why the instance is patched.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, cast

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import Tensor

from shardopt.integrations._accelerate_state import CHECKPOINT_DIR, SavedState
from shardopt.integrations._convert import from_torch, is_torch_pair_member, replacements, retarget_scheduler
from shardopt.step._loss_scale import LossScaler
from shardopt.optimizer import ShardedAdamW

# free_memory also covers clear(), which Accelerate defines as self.free_memory().
_PATCHED = ("prepare", "backward", "clip_grad_norm_", "no_sync", "get_state_dict", "save_state", "load_state",
            "free_memory")
_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.XLA)

__all__ = ["CHECKPOINT_DIR", "ShardedAcceleratedOptimizer", "install", "prepare"]


class ShardedAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper around a ShardedAdamW: ``step``/``zero_grad`` do nothing
    while gradients are being accumulated, as for any optimizer, and ShardedAdamW's own methods
    (``clip_grad_norm_``, ``no_sync``, ``backward``, ``memory_report``, ...) stay reachable.

    ``members`` > 1: the optimizer stands for that many torch optimizers (a Muon + AdamW pair), the
    wrapper is handed out in each one's place, and only the first ``step`` after a round of gradient
    reductions (a backward outside ``no_sync``) steps: the other members' steps find it taken."""

    def __init__(self, optimizer: ShardedAdamW, members: int = 1) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)  # state already lives with its shard
        self.members = members
        self.stepped_at = -1  # the optimizer's completed reduction rounds when a member last stepped it

    def step(self, closure: Any = None) -> Any:
        if self.members > 1:
            rounds = self.optimizer.inspect().total_rounds
            if rounds == self.stepped_at:  # another member of the pair took this round's step
                return None
            if self.gradient_state.sync_gradients:
                self.stepped_at = rounds
        return super().step(closure)

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


def _covers(ids: set[int], model: torch.nn.Module) -> bool:
    """Whether the optimizer with parameter ids ``ids`` trains ``model``: all of its trainable
    parameters (raises if only some)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    covered = [id(p) in ids for p in trainable]
    if any(covered) and not all(covered):
        raise ValueError(f"the optimizer covers {sum(covered)} of the model's {len(trainable)} trainable parameters; "
                         "give ShardedAdamW all of them (freeze the rest)")
    return bool(trainable) and all(covered)


def _unwrapped(opt: Any) -> Any:
    while isinstance(opt, AcceleratedOptimizer):
        opt = opt.optimizer
    return opt


class _Binding(SavedState):
    """What one Accelerator knows about shardopt: the ShardedAdamW it prepared and the model that
    optimizer trains, and the accelerator's own methods that it stands in front of (its saved
    state: ``SavedState``)."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        # Set while shardopt.integrations.accelerate.prepare runs: a torch.optim.AdamW given to it is
        # converted with these ShardedAdamW arguments, and a model given alone waits for its optimizer.
        self.convert_kwargs: dict[str, Any] | None = None
        self.original = {name: getattr(accelerator, name) for name in _PATCHED}
        self._forget()
        accelerator.register_save_state_pre_hook(self._before_save)
        accelerator.register_load_state_pre_hook(self._before_load)
        for name in _PATCHED:
            setattr(accelerator, name, getattr(self, name))

    def _forget(self) -> None:
        """Know no model or optimizer: at construction and after ``free_memory``."""
        if getattr(self, "pending", None) is not None:
            self._drop_pending()
        self.model: torch.nn.Module | None = None  # the bare model the ShardedAdamW trains
        self.opt: ShardedAdamW | None = None
        self.wrapped: ShardedAcceleratedOptimizer | None = None
        self.pending: tuple[torch.nn.Module, dict[str, Any], Any] | None = None  # (model, kwargs, guard hook)
        self.ours: set[int] = set()  # ids of the models prepared here, without DDP

    def free_memory(self, *objects: Any) -> Any:
        """``Accelerator.free_memory``: Accelerate forgets what it prepared, and so does this binding
        (the next ``prepare`` may bring another ShardedAdamW, as Trainer's ``model_init`` does)."""
        self._forget()
        return self.original["free_memory"](*objects)

    # -- prepare -------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """``Accelerator.prepare``, except that a ShardedAdamW (or, through ``shardopt.integrations.
        accelerate.prepare``, a plain AdamW) and the model it trains are prepared without DDP; they
        may come in one call or in several, in either order."""
        acc = self.accelerator
        pending_model, pending_kwargs = (self.pending[0], self.pending[1]) if self.pending else (None, None)
        # Torch optimizers to convert: a Muon with the AdamW beside it make one ShardedMuon, an AdamW alone
        # a ShardedAdamW; taken when shardopt's prepare runs, or when they train the model waiting here.
        torch_opts = [i for i, a in enumerate(args) if is_torch_pair_member(a)]
        units = [torch_opts] if any(type(args[i]) is torch.optim.Muon for i in torch_opts) else \
            [[i] for i in torch_opts]

        def taken(unit: list[int]) -> bool:
            return self.convert_kwargs is not None or (pending_model is not None and \
                _covers(set().union(*(_params(args[i]) for i in unit)), pending_model))

        mine = sorted([i for i, a in enumerate(args) if isinstance(_unwrapped(a), ShardedAdamW)]
                      + [i for unit in units if taken(unit) for i in unit])
        merging = len(mine) > 1 and set(mine) <= set(torch_opts)
        if (len(mine) > 1 and not merging) or (mine and self.opt is not None and _unwrapped(args[mine[0]]) is not self.opt):
            raise ValueError("one Accelerator trains one ShardedAdamW; put all param groups into one optimizer")
        if mine and acc.distributed_type in _UNSUPPORTED:
            raise ValueError(f"ShardedAdamW replaces DDP and shards the optimizer itself; it does not run under "
                             f"Accelerate's {acc.distributed_type.value} (launch without a DeepSpeed/FSDP/Megatron "
                             "config, e.g. `accelerate launch --multi_gpu` or plain torchrun)")
        placement = list(device_placement) if device_placement is not None else [None] * len(args)
        out = list(args)
        base = _unwrapped(args[mine[0]]) if mine else self.opt
        ids = set().union(*(_params(args[i]) for i in mine)) if merging else \
            _params(base) if base is not None else set()
        for i, a in enumerate(args):  # models: those of the optimizer, or waiting for one, get no DDP
            if not isinstance(a, torch.nn.Module):
                continue
            if ids and _covers(ids, a):
                out[i] = self._prepare_model(a, placement[i])
                self._link(acc.unwrap_model(out[i]))
            elif not mine and self.convert_kwargs is not None:
                out[i] = self._prepare_model(a, placement[i])
                self._wait_for_optimizer(acc.unwrap_model(out[i]), self.convert_kwargs)
        if mine:
            kwargs = self.convert_kwargs if self.convert_kwargs is not None else pending_kwargs
            given = [args[i] for i in mine]
            opt = base if isinstance(base, ShardedAdamW) else from_torch(given, **(kwargs or {}))
            if self.model is None and self.pending is not None and _covers(_params(opt), self.pending[0]):
                self._link(self.pending[0])
            self._check_not_in_ddp(opt)
            self._check_devices(opt)
            if opt is not base:  # schedulers built on the torch optimizers (composite ones too) now drive opt
                for a in args:
                    if isinstance(a, torch.optim.lr_scheduler.LRScheduler):
                        retarget_scheduler(a, replacements(given, opt))
            self._take_over_fp16(opt)
            if self.wrapped is None or self.opt is not opt:
                self.opt, self.wrapped = opt, ShardedAcceleratedOptimizer(opt, members=len(mine))
                self.wrapped._is_accelerate_prepared = True
            if self.wrapped not in acc._optimizers:
                acc._optimizers.append(self.wrapped)
            for i in mine:
                out[i] = self.wrapped
        rest = [i for i, a in enumerate(args) if out[i] is a and i not in mine]
        if rest:
            done = self.original["prepare"](*[args[i] for i in rest],
                                            device_placement=None if device_placement is None else
                                            [placement[i] for i in rest])
            for i, d in zip(rest, done if len(rest) > 1 else (done,)):
                out[i] = d
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_model(self, model: torch.nn.Module, placement: bool | None) -> torch.nn.Module:
        prepared = self.accelerator.prepare_model(model, device_placement=placement, evaluation_mode=True)  # no DDP
        self.ours.add(id(self.accelerator.unwrap_model(prepared)))
        return prepared

    def _link(self, model: torch.nn.Module) -> None:
        if self.pending is not None and self.pending[0] is model:
            self._drop_pending()
        self.model = model

    def _drop_pending(self) -> None:
        cast(tuple, self.pending)[2].remove()  # the guard hook of _wait_for_optimizer (callers check there is one)
        self.pending = None

    def _wait_for_optimizer(self, model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
        """A model prepared alone (no DDP): it must not train before its optimizer is prepared, or its
        gradients would never be averaged over the ranks."""

        def guard(module: torch.nn.Module, args: Any) -> None:
            if module.training and torch.is_grad_enabled():
                raise RuntimeError("this model was prepared by shardopt.integrations.accelerate.prepare without "
                                   "DDP, for a ShardedAdamW, but no optimizer over its parameters has been prepared "
                                   "on this accelerator yet: prepare the optimizer (a ShardedAdamW or a "
                                   "torch.optim.AdamW) before training, or its gradients are not averaged")

        if self.pending is not None:
            self._drop_pending()
        self.pending = (model, dict(kwargs), model.register_forward_pre_hook(guard))

    def _check_not_in_ddp(self, opt: ShardedAdamW) -> None:
        """A model of this optimizer that plain ``accelerator.prepare`` handled earlier is wrapped in DDP
        (Accelerate keeps the bare module in ``_models``)."""
        ids = _params(opt)
        for m in self.accelerator._models:
            if id(m) in self.ours or not _covers(ids, m):
                continue
            if self.accelerator.multi_device:
                raise ValueError("this ShardedAdamW's model was prepared by accelerator.prepare(model) before, "
                                 "which wrapped it in DDP; prepare the model through shardopt.integrations."
                                 "accelerate.prepare too (with its optimizer, or on its own before it)")
            self.ours.add(id(m))  # one process: nothing was wrapped
            self._link(m)

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
        if type(opt.internals.scaler) is LossScaler:  # no scaling at all
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
        trainable = {id(p) for g in self.opt.param_groups for p in g["params"] if p.requires_grad}
        if given != trainable:  # frozen ones (even frozen since) have no gradient to clip
            raise ValueError(f"clip_grad_norm_ got {len(given)} trainable parameters, {len(given & ids)} of them the "
                             f"ShardedAdamW's, which trains {len(trainable)}: it clips the global norm of all of the "
                             "optimizer's parameters at once; pass model.parameters()")
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


def install(accelerator: Accelerator) -> Accelerator:
    """Teach ``accelerator`` about ShardedAdamW (idempotent): its ``prepare`` then prepares a
    ShardedAdamW and its model without DDP, and its ``backward``, ``clip_grad_norm_``, ``no_sync``,
    ``get_state_dict``, ``save_state`` and ``load_state`` route through the optimizer; everything
    else (other models, plain optimizers) is left to Accelerate. Every rank."""
    if getattr(accelerator, "_shardopt", None) is None:
        accelerator._shardopt = _Binding(accelerator)
    return accelerator


def prepare(accelerator: Accelerator, *objects: Any, device_placement: list[bool] | None = None,
            **shardopt_kwargs: Any) -> Any:
    """``accelerator.prepare(*objects)`` for training with ShardedAdamW: pass the model, a
    ``shardopt.ShardedAdamW`` (or a ``torch.optim.AdamW``, converted with ``shardopt_kwargs`` such as
    ``stage=2``, ``master_weights="fp32"``), and the dataloaders and schedulers; returns them
    prepared, in order. The model and its optimizer may also be prepared in separate calls. Every rank."""
    binding = install(accelerator)._shardopt
    binding.convert_kwargs = shardopt_kwargs
    try:
        return accelerator.prepare(*objects, device_placement=device_placement)
    finally:
        binding.convert_kwargs = None
