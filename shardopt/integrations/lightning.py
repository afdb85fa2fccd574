"""``ShardedStrategy``: PyTorch Lightning data parallelism with ``ShardedAdamW`` instead of DDP.

Owns the glue between Lightning's training loop and the optimizer: the optimizers returned by
``configure_optimizers`` (a ``torch.optim.AdamW`` is converted, a Muon + AdamW pair merged, their
LR schedulers re-targeted),
the backward (through the optimizer's loss scaling when it scales), gradient clipping (the
optimizer's global norm), accumulation without communication (``no_sync``), the
``LightningOptimizer`` wrapper and consolidated checkpoints. Process-group setup, the distributed
sampler and barrier/broadcast/reduce are ``DDPStrategy``'s. Lightning is imported when this module
is imported (``pip install shardopt[lightning]``); no other shardopt module imports this one.

    trainer = lightning.pytorch.Trainer(strategy=ShardedStrategy(stage=2), devices=N, accelerator="cpu",
                                        gradient_clip_val=1.0, accumulate_grad_batches=4)

[Note: why no DistributedDataParallel wrapper]
``ShardedAdamW`` averages gradients itself, from post-accumulate-grad hooks while backward runs,
into its own flat buffers (stage 2 keeps only this rank's shard). A DDP wrapper would all-reduce
the same gradients a second time into ``p.grad`` and keep the full gradient stage 2 exists to
avoid. So the model stays the bare LightningModule and everything DDP's wrapper did is done here:
rank 0's parameters and buffers are broadcast once at setup (``sync_module_states``), and
Lightning's ``block_backward_sync`` (accumulation, ``toggle_model(sync_grad=False)``) enters
``opt.no_sync()``.

[Note: where the module is converted]
The optimizer's parameters become views of its flat buffers, so the model must have its final
dtype and device before the optimizer is built. ``setup`` runs the precision plugin's
``convert_module`` and ``model_to_device`` before ``setup_optimizers`` (which calls
``configure_optimizers``), as ``DDPStrategy`` does. A ``ShardedAdamW`` built earlier (in
``__init__`` or the ``setup`` hook) was laid out for the unconverted parameters; that is detected
before training and reported on every rank.

[Note: clipping and the precision plugin]
Lightning clips through ``trainer.precision_plugin.clip_gradients``, whose default calls
``torch.nn.utils.clip_grad_norm_`` on ``p.grad``: in stage 2 that raises (the gradient lives
sharded), in stage 1 it would clip this rank's copy only after the optimizer has taken its own
view. While the strategy is set up, its precision plugin is a copy of the user's (the same
attributes) whose class is a subclass of the plugin's with a mixin in front (``_ShardedClipping``)
that sends a ``ShardedAdamW`` to ``opt.clip_grad_norm_``, leaves other optimizers to the plugin,
and keeps the returned norm in ``strategy.last_grad_norm``; teardown puts the user's own plugin
object back, which is never changed. The copy is made in ``setup``, in the training process, so
that launchers that pickle the strategy never see the generated class.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Iterator, Literal, cast

import torch
from torch import Tensor

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.utilities.optimizer import _optimizers_to_device
    from lightning.pytorch.core.optimizer import LightningOptimizer, _MockOptimizer
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("shardopt.integrations.lightning needs PyTorch Lightning: pip install shardopt[lightning] "
                      "(or pip install lightning)") from e

from shardopt.comm._module_sync import sync_module_states
from shardopt.integrations._convert import Replacement, from_torch, is_torch_pair_member, retarget_scheduler
from shardopt.integrations._lightning_conf import merge_torch_pair
from shardopt.optimizer import ShardedAdamW

__all__ = ["ShardedStrategy"]

# ShardedAdamW's keyword-only options, which ShardedStrategy passes on to converted optimizers.
_SHARDOPT_OPTIONS = frozenset(
    name for name, p in inspect.signature(ShardedAdamW.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY)


class ShardedStrategy(DDPStrategy):
    """Data parallelism where ``ShardedAdamW`` shards the optimizer state (and, stage 2, the
    gradients) over the ranks and reduces the gradients itself; the model is not wrapped in DDP.

    ``stage``, ``master_weights`` and ``shardopt_options`` (``loss_scale``, ``bucket_cap_mb``,
    ``overlap_param_gather``, ... as in ``ShardedAdamW``) apply to the ``torch.optim.AdamW``
    optimizers that ``configure_optimizers`` returns, which are converted; a ``ShardedAdamW`` (or
    ``ShardedMuon``) it returns is used as it was built. A ``torch.optim.Muon`` with a
    ``torch.optim.AdamW`` for the other parameters (``[muon, adamw]``, ``([muon, adamw], [sched,
    ...])`` or one dict per optimizer) becomes one ``ShardedMuon``, so automatic optimization
    trains it as one optimizer (``self.optimizers()`` is that one); each LR scheduler keeps
    driving its own optimizer's param groups. Other optimizers raise ``TypeError``. Launch as for
    ``strategy="ddp"`` (``torchrun`` or Lightning's own launcher); every rank runs the same code.

    Supported precisions: ``"32-true"``, ``"bf16-true"``, ``"16-true"`` (loss scaling by the
    optimizer: the backward goes through ``opt.backward``), ``"bf16-mixed"``. ``"16-mixed"``
    raises: torch's GradScaler unscales ``p.grad`` in place, which stage 2 does not keep.

    Gradient clipping (``Trainer(gradient_clip_val=...)`` or ``self.clip_gradients``) is by the
    global norm over all ranks and shards; ``gradient_clip_algorithm="value"`` raises. The norm
    of the last clip is ``trainer.strategy.last_grad_norm``, e.g.::

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            self.log("grad_norm", self.trainer.strategy.last_grad_norm)

    (or ``norm = optimizer.clip_grad_norm_(gradient_clip_val)`` there, or on ``self.optimizers()``
    in manual optimization). Checkpoints are ordinary Lightning ``.ckpt`` files: the optimizer
    state is consolidated on rank 0 in ``torch.optim.AdamW``'s format (plus shardopt's fp32 master
    weights of 16-bit parameters) and loads at any number of devices.
    """

    strategy_name = "shardopt"

    def __init__(
        self,
        stage: int = 2,
        master_weights: str = "fp32",
        *,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: Any = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **shardopt_options: Any,
    ) -> None:
        unknown = sorted(set(shardopt_options) - _SHARDOPT_OPTIONS)
        if unknown:
            raise TypeError(f"ShardedStrategy got unknown options {unknown}; it takes stage, master_weights and "
                            f"ShardedAdamW's keyword options {sorted(_SHARDOPT_OPTIONS - {'stage', 'master_weights'})} "
                            "(DistributedDataParallel's options do not apply: the model is not wrapped)")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self.shardopt_options: dict[str, Any] = dict(stage=stage, master_weights=master_weights, **shardopt_options)
        # while ShardedStrategy is set up: the precision plugin it replaced with one that clips by the global norm
        self._own_plugin: Precision | None = None
        self._replaced = False

    # -- set-up ----------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        """DDPStrategy's set-up without the DDP wrapper: convert the module (precision plugin), move
        it to the device, take rank 0's parameters and buffers, then build the optimizers (see
        [Note: where the module is converted]). Every rank."""
        if self.accelerator is None or self.model is None:
            raise RuntimeError("ShardedStrategy.setup ran before Lightning gave the strategy its accelerator and model: "
                               "pass the strategy to pl.Trainer(strategy=ShardedStrategy(...)) and let the Trainer "
                               "call it, not strategy.setup() by hand")
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            _check_trainer(trainer, self.precision_plugin)
            if self._layer_sync:
                self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        sync_module_states(self.model)  # what DDP's constructor does; ShardedAdamW never sees buffers
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._put_clipping_in_front()

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Run ``configure_optimizers``, convert each ``torch.optim.AdamW`` into a ``ShardedAdamW``
        (a torch Muon + AdamW pair into one ``ShardedMuon``) and point the LR schedulers built on
        them at the new optimizer. Every rank."""
        module = cast(pl.LightningModule, self.lightning_module)  # connected by now
        own = module.__dict__.get("configure_optimizers")
        hook = module.configure_optimizers
        views: dict[int, Replacement] = {}
        # The pair is merged before Lightning counts the optimizers (one in automatic optimization).
        module.configure_optimizers = lambda: merge_torch_pair(hook(), views, **self.shardopt_options)  # type: ignore[method-assign]  # on this instance, for the call
        try:
            super().setup_optimizers(trainer)
        finally:
            if own is None:
                del module.configure_optimizers
            else:
                module.configure_optimizers = own  # type: ignore[method-assign]  # the instance's own, put back
        for config in self.lr_scheduler_configs:  # each pair member's schedulers onto its own groups
            if id(config.scheduler) in views:
                config.scheduler.optimizer = views[id(config.scheduler)]  # type: ignore[assignment]  # a GroupView stands in
        given = [opt.optimizer if isinstance(opt, LightningOptimizer) else opt for opt in self.optimizers]
        converted = [self._sharded(i, opt) for i, opt in enumerate(given)]
        replaced = {id(old): new for old, new in zip(given, converted) if new is not old}
        for config in self.lr_scheduler_configs:
            retarget_scheduler(config.scheduler, replaced)
        self.optimizers = converted

    def _sharded(self, index: int, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if isinstance(opt, ShardedAdamW):
            _check_built_on_final_module(opt, self.precision_plugin)
            return opt
        if isinstance(opt, _MockOptimizer):  # configure_optimizers returned None
            return opt
        if not is_torch_pair_member(opt):
            raise TypeError(f"ShardedStrategy trains with shardopt.ShardedAdamW, but configure_optimizers returned "
                            f"{type(opt).__module__}.{type(opt).__qualname__} (optimizer {index}); return a "
                            "torch.optim.AdamW (converted with the strategy's options) or a shardopt.ShardedAdamW "
                            "built in configure_optimizers, or use strategy='ddp' for other optimizers")
        return from_torch([opt], **self.shardopt_options)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers
        self._lightning_optimizers = [
            (_ShardedLightningOptimizer if isinstance(opt, ShardedAdamW) else LightningOptimizer)
            ._to_lightning_optimizer(opt, self) for opt in optimizers]

    def _sharded_optimizers(self) -> list[ShardedAdamW]:
        return [opt for opt in self.optimizers if isinstance(opt, ShardedAdamW)]

    # -- training --------------------------------------------------------------------------
    def backward(self, closure_loss: Tensor, optimizer: torch.optim.Optimizer | None, *args: Any,
                 **kwargs: Any) -> Tensor:
        """Lightning's backward, with the loss multiplied by the optimizer's loss scale
        (``opt.backward``) when the ShardedAdamW scales (fp16 weights); otherwise the precision
        plugin's (and so ``LightningModule.backward``). Every rank."""
        opt = self._scaling_optimizer(optimizer)
        if opt is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        if args:
            raise TypeError("with ShardedStrategy pass backward options by keyword (retain_graph=..., create_graph=...)")
        if self.lightning_module is None:
            raise RuntimeError("ShardedStrategy.backward ran without a LightningModule connected to the strategy: "
                               "call it through pl.Trainer.fit (or manual_backward inside training_step), not by hand")
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        opt.backward(closure_loss, **kwargs)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def _scaling_optimizer(self, optimizer: torch.optim.Optimizer | None) -> ShardedAdamW | None:
        """The ShardedAdamW whose loss scale this backward must apply, or None when nothing scales.
        Manual optimization passes no optimizer: then the only ShardedAdamW is meant."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        candidates = [optimizer] if optimizer is not None else self._sharded_optimizers()
        scaling = [opt for opt in candidates if isinstance(opt, ShardedAdamW) and opt.loss_scale != 1.0]
        if len(scaling) > 1:
            raise ValueError(f"manual_backward with {len(scaling)} ShardedAdamW optimizers that scale the loss "
                             "(fp16 weights): one loss cannot carry several loss scales; call opt.backward(loss) "
                             "on the optimizer of each loss instead")
        return scaling[0] if scaling else None

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication (what DDP's
        ``no_sync`` is for); the first backward after it reduces everything. Any rank."""
        with contextlib.ExitStack() as stack:
            for opt in self._sharded_optimizers():
                stack.enter_context(opt.no_sync())
            yield None

    @property
    def last_grad_norm(self) -> Tensor | None:
        """Global gradient norm (0-d tensor, unscaled, over all ranks and shards) returned by the
        last clip Lightning ran through this strategy; None before the first. Same on every rank."""
        return getattr(self.precision_plugin, "_shardopt_last_grad_norm", None)

    # -- checkpoints -----------------------------------------------------------------------
    # Saving: Strategy.optimizer_state calls opt.consolidate_state_dict() on every rank and keeps
    # rank 0's state_dict() (torch.optim.AdamW's format plus shardopt's master weights). Loading:
    # Strategy.load_optimizer_state_dict calls opt.load_state_dict(rank 0's dict) on every rank,
    # which takes that format at any world size. The model's weights are restored before
    # setup() builds the optimizer, so the master weights start from them.

    # -- teardown --------------------------------------------------------------------------
    def teardown(self) -> None:
        for opt in self._sharded_optimizers():  # when fit returns, the module holds the last step's weights
            opt.finish_param_gather()
        if self._replaced:
            self.precision_plugin = self._own_plugin  # the user's own object (None: Lightning's default) again
        self._own_plugin, self._replaced = None, False
        super().teardown()

    def _put_clipping_in_front(self) -> None:
        """Use, until teardown, a copy of the precision plugin whose class puts the sharded clipping
        in front of the plugin's own: an instance of a subclass, so Lightning's isinstance checks
        still see the plugin's class, with the same attributes (the same objects: a shallow copy).
        The user's plugin object itself is left as it is."""
        plugin = self.precision_plugin  # Lightning builds its default plugin on every access
        if isinstance(plugin, _ShardedClipping):
            return
        sharded: Precision = object.__new__(_with_sharded_clipping(cast(type, type(plugin))))
        sharded.__dict__.update(plugin.__dict__)
        self._own_plugin, self._replaced = self._precision_plugin, True
        self.precision_plugin = sharded


def _check_trainer(trainer: pl.Trainer, plugin: Precision) -> None:
    """Settings ShardedAdamW cannot honour, refused before anything is built. Local and the same
    on every rank (every rank has the same Trainer arguments)."""
    if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
        raise ValueError(f"precision={plugin.precision!r} scales the loss with torch's GradScaler, which unscales "
                         "p.grad in place (ShardedAdamW keeps the reduced gradient in its own buffers): use "
                         "precision='16-true' (fp16 weights; ShardedAdamW scales the loss itself) or 'bf16-mixed'")
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
        raise ValueError(_CLIP_VALUE_MESSAGE.format(val=trainer.gradient_clip_val))


_CLIP_VALUE_MESSAGE = ("gradient_clip_algorithm='value' (gradient_clip_val={val}) is not supported by ShardedStrategy: "
                       "the gradient lives sharded over the ranks, and ShardedAdamW clips by the global norm only; "
                       "use gradient_clip_algorithm='norm'")


def _check_built_on_final_module(opt: ShardedAdamW, plugin: Precision) -> None:
    """Raise if ``opt`` was laid out for parameters that the precision plugin or the move to the
    device have since converted. Local: every rank converts the same way, so every rank raises."""
    moved = opt.parameters_moved()
    if moved:
        raise RuntimeError(
            f"configure_optimizers returned a ShardedAdamW built before Lightning converted the model: "
            f"{moved[0]} (precision {plugin.precision!r}). Build the ShardedAdamW inside "
            "configure_optimizers, which Lightning calls after converting the module and moving it to the "
            "device, or return a torch.optim.AdamW and let ShardedStrategy convert it")


class _ShardedClipping:
    """Put in front of the precision plugin's class while ShardedStrategy is set up: clipping a
    ShardedAdamW uses its global norm (see [Note: clipping and the precision plugin])."""

    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip_val: float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        opt = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if not isinstance(opt, ShardedAdamW):
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)  # type: ignore[misc]
        if clip_val is None or clip_val <= 0:
            return None
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ValueError(_CLIP_VALUE_MESSAGE.format(val=clip_val))
        self.clip_grad_by_norm(opt, clip_val)
        return None

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        opt = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if not isinstance(opt, ShardedAdamW):
            return super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]
        self._shardopt_last_grad_norm = opt.clip_grad_norm_(clip_val)
        return None

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        opt = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(opt, ShardedAdamW):
            raise ValueError(_CLIP_VALUE_MESSAGE.format(val=clip_val))
        return super().clip_grad_by_value(optimizer, clip_val)  # type: ignore[misc]


@functools.cache
def _with_sharded_clipping(cls: type) -> type:
    return type(f"Sharded{cls.__name__}", (_ShardedClipping, cls), {"__module__": __name__})


def _forwarded(name: str) -> Any:
    method = getattr(ShardedAdamW, name)

    @functools.wraps(method)
    def forward(self: LightningOptimizer, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._optimizer, name)(*args, **kwargs)

    return forward


# [Note: the LightningOptimizer wrapper]
# LightningOptimizer makes itself an instance of a generated subclass of the optimizer's class, so a
# method the optimizer's class defines runs with the *wrapper* as ``self``: reads fall through to the
# optimizer (``__getattr__``) but writes land on the wrapper. ``opt.clip_grad_norm_(...)`` on
# ``self.optimizers()`` would keep its clip coefficient on the wrapper and the step (which runs on the
# optimizer) would never apply it; ShardedAdamW.__del__ would remove the optimizer's forward hook when
# a wrapper is collected. This wrapper sends every public method ShardedAdamW defines, except step
# (which goes through the strategy as usual), to the optimizer itself.
_ShardedLightningOptimizer: type[LightningOptimizer] = type(
    "_ShardedLightningOptimizer", (LightningOptimizer,),
    {"__module__": __name__, "__del__": lambda self: None,
     "__doc__": "LightningOptimizer for a ShardedAdamW (see [Note: the LightningOptimizer wrapper]).",
     **{name: _forwarded(name) for name, value in vars(ShardedAdamW).items()
        if callable(value) and not name.startswith("_") and name != "step"}})
