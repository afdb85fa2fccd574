"""ShardedAdamW (or ShardedMuon) inside Hugging Face ``transformers.Trainer``.

``ShardedTrainer`` is a ``Trainer`` whose optimizer is a ShardedAdamW built from the
``TrainingArguments`` (learning_rate, weight_decay with Trainer's decay/no-decay grouping,
adam_beta1/2, adam_epsilon) plus ``shardopt_kwargs`` (``stage``, ``master_weights``, ...); with
``shardopt_kwargs={"muon": {...}}`` it is a ShardedMuon whose Muon group holds the model's hidden
matrices (2-D, not the input or output embeddings) and whose AdamW groups hold the rest, grouped
and set as for AdamW. It owns what differs from a plain Trainer:

- the model is not wrapped in DDP: the Trainer's Accelerator is taught about shardopt
  (``shardopt.integrations.accelerate.install``), so ``max_grad_norm`` clips, and ``grad_norm``
  logs, the global norm over all ranks and shards, and accumulation reduces once per step;
- checkpoints keep the optimizer as a sharded checkpoint in ``<checkpoint-N>/shardopt``, which
  ``resume_from_checkpoint`` loads at any number of processes (a checkpoint of a plain Trainer
  with AdamW, ``optimizer.pt``, also loads);
- the model's weights are saved from copies: they are views of one flat buffer, which
  safetensors refuses.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Any, cast

import torch
from torch.optim.lr_scheduler import LRScheduler
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME

from shardopt.checkpoint import load_checkpoint, save_checkpoint
from shardopt.integrations._convert import from_torch, replacements, retarget_scheduler
from shardopt.integrations.accelerate import CHECKPOINT_DIR, install
from shardopt.muon import ShardedMuon
from shardopt.optimizer import ShardedAdamW

__all__ = ["ShardedTrainer"]


class ShardedTrainer(Trainer):
    """``transformers.Trainer`` training with ``shardopt.ShardedAdamW`` instead of AdamW under DDP.

    Change ``Trainer(...)`` to ``ShardedTrainer(..., shardopt_kwargs={"stage": 2})``; every
    ``TrainingArguments`` keeps its meaning. ``shardopt_kwargs={"muon": {"adjust_lr_fn":
    "match_rms_adamw", ...}}`` trains the hidden matrices with Muon (``ShardedMuon``; its ``lr`` and
    ``weight_decay`` default to the TrainingArguments', the other keys to ``torch.optim.Muon``'s) and
    the rest with AdamW as above. An optimizer passed in ``optimizers=`` must be a ShardedAdamW, a
    ShardedMuon, a ``torch.optim.AdamW`` or a ``torch.optim.Muon`` (converted, with its scheduler
    re-pointed). Launch with ``torchrun`` (or ``accelerate launch`` without a DeepSpeed/FSDP
    config), as for DDP."""

    def __init__(self, *args: Any, shardopt_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.shardopt_kwargs = dict(shardopt_kwargs or {})
        muon = self.shardopt_kwargs.pop("muon", None)
        self.muon_kwargs: dict[str, Any] | None = {} if muon is True else None if muon is None else dict(muon)
        super().__init__(*args, **kwargs)
        if self.args.fp16:
            self.shardopt_kwargs.setdefault("loss_scale", "dynamic")  # shardopt scales fp16 losses itself
        optim = getattr(self.args.optim, "value", self.args.optim)
        if optim not in ("adamw_torch", "adamw_torch_fused", "adamw_hf"):
            warnings.warn(f"ShardedTrainer trains with shardopt.ShardedAdamW; TrainingArguments.optim={optim!r} "
                          "is ignored", stacklevel=2)
        given = getattr(self, "optimizer_cls_and_kwargs", None)
        if given is not None and given[0] is not torch.optim.AdamW and given[0] is not ShardedAdamW:
            raise ValueError(f"ShardedTrainer trains with shardopt.ShardedAdamW; optimizer_cls_and_kwargs names "
                             f"{given[0].__qualname__}: pass torch.optim.AdamW (its lr, betas, eps and weight_decay "
                             "are used) or leave it unset")

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        install(self.accelerator)

    @property
    def sharded_optimizer(self) -> ShardedAdamW | None:
        """The ShardedAdamW being trained (``self.optimizer`` may be Accelerate's wrapper around it)."""
        opt = self.optimizer
        while opt is not None and not isinstance(opt, ShardedAdamW) and hasattr(opt, "optimizer"):
            opt = opt.optimizer
        return opt if isinstance(opt, ShardedAdamW) else None

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """Build the ShardedAdamW from the TrainingArguments, with Trainer's decay/no-decay groups.
        Every rank."""
        opt_model = cast(torch.nn.Module, self.model if model is None else model)  # Trainer has its model by now
        if self.sharded_optimizer is not None:  # a second train(): self.optimizer is Accelerate's wrapper
            return cast(torch.optim.Optimizer, self.optimizer)
        if self.optimizer is None:
            decay = set(self.get_decay_parameter_names(opt_model))
            named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            hp: dict[str, Any] = dict(lr=self.args.learning_rate, betas=(self.args.adam_beta1, self.args.adam_beta2),
                      eps=self.args.adam_epsilon, weight_decay=self.args.weight_decay)
            given = getattr(self, "optimizer_cls_and_kwargs", None)
            if given is not None:  # Trainer(optimizer_cls_and_kwargs=(AdamW, {...})): those values win, as in Trainer
                hp.update({k: v for k, v in given[1].items() if k in hp})
            muon = set() if self.muon_kwargs is None else _hidden_matrices(opt_model)
            wd = self.args.weight_decay
            groups: list[dict[str, Any]]
            groups = [{"params": [p for n, p in named if n in decay and n not in muon], "weight_decay": wd},
                      {"params": [p for n, p in named if n not in decay and n not in muon], "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
            if self.muon_kwargs is None:
                self.optimizer = ShardedAdamW(groups, **hp, **self.shardopt_kwargs)
            else:  # the matrices with Muon, the rest with AdamW's groups and values
                adamw = [{**g, "use_muon": False, "lr": hp["lr"], "betas": hp["betas"], "eps": hp["eps"]}
                         for g in groups]
                muon_hp = {"lr": self.args.learning_rate, "weight_decay": self.args.weight_decay, **self.muon_kwargs}
                self.optimizer = ShardedMuon([{"params": [p for n, p in named if n in muon]}, *adamw], **muon_hp,
                                             **self.shardopt_kwargs)
        elif not isinstance(self.optimizer, ShardedAdamW):
            old = self.optimizer
            self.optimizer = from_torch([old], **self.shardopt_kwargs)
            if self.lr_scheduler is not None:  # composite schedulers too
                retarget_scheduler(self.lr_scheduler, replacements([old], self.optimizer))
        return self.optimizer

    # -- checkpoints ---------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None and self.args.should_save:  # copies out of the flat buffer (see accelerate.py)
            state_dict = self.accelerator.get_state_dict(self.model)
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        opt = self.sharded_optimizer
        if opt is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # Every rank; rank 0 arrives after writing the model's weights alone (Trainer.save_model), which
        # may take minutes: wait as long as a step would, not the checkpoint's default entry deadline.
        model = cast(torch.nn.Module, self.model)
        save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR), model, opt, timeout=math.inf)
        if self.args.should_save:  # Trainer made its scheduler with the optimizer
            torch.save(cast(LRScheduler, self.lr_scheduler).state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        opt = self.sharded_optimizer
        path = None if checkpoint is None else os.path.join(checkpoint, CHECKPOINT_DIR)
        if opt is None or path is None or not os.path.isdir(path):
            return super()._load_optimizer_and_scheduler(checkpoint)  # e.g. a plain AdamW's optimizer.pt
        load_checkpoint(path, cast(torch.nn.Module, self.model), opt)  # every rank, at any number of processes
        sched = os.path.join(cast(str, checkpoint), SCHEDULER_NAME)  # not None: path is not
        if os.path.isfile(sched):  # Trainer made its scheduler with the optimizer
            cast(LRScheduler, self.lr_scheduler).load_state_dict(torch.load(sched, weights_only=True))


def _hidden_matrices(model: torch.nn.Module) -> set[str]:
    """Names of the trainable 2-D parameters Muon is meant for: all but embeddings (every
    ``nn.Embedding``, and the output embeddings), which, like vectors, train with AdamW."""
    modules: list[torch.nn.Module | None] = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    for get in ("get_input_embeddings", "get_output_embeddings"):
        modules.append(getattr(model, get, lambda: None)())
    embeddings = {id(p) for m in modules if m is not None for p in m.parameters()}
    return {n for n, p in model.named_parameters() if p.requires_grad and p.dim() == 2 and id(p) not in embeddings}
