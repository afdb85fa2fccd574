"""transformers.Trainer with AdamW (DDP) and ShardedTrainer with shardopt, under torchrun.

``parity <out>`` (2 ranks): Trainer + AdamW, then ShardedTrainer at stage 1 and at stage 2
(clipping, accumulation 2, linear schedule with warmup, a checkpoint every 2 steps), then the
stage-2 run resumed from its first checkpoint in a fresh trainer; then Muon: Trainer with a
torch.optim.Muon + torch.optim.AdamW pair under DDP (``TorchPair``) against ShardedTrainer with
``shardopt_kwargs={"muon": ...}`` (stage 2) and with a ShardedMuon passed in (stage 1).
``resume <out>`` (any number of ranks): that resume alone, then Trainer and ShardedTrainer with
bf16 autocast.
Each run records every micro-batch's loss on this rank, every step's grad norm, and the weights.
"""
from __future__ import annotations

import os
import sys

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import shardopt

from common import is_hidden_matrix, tiny_gpt2, tokens, weights, write_result
from shardopt.integrations.hf import ShardedTrainer

STEPS, ACCUM, CLIP = 4, 2, 0.5


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.data = tokens()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


class Recording:
    """Records what the Trainer computes, without changing it."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.seen_losses.append(float(loss))
        return loss

    def _clip_grad_norm(self, model):
        norm = super()._clip_grad_norm(model)
        self.seen_norms.append(float(norm))
        return norm


class RecordingTrainer(Recording, Trainer):
    pass


class RecordingShardedTrainer(Recording, ShardedTrainer):
    pass


def args(out: str, **kw) -> TrainingArguments:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    options = dict(
        output_dir=out, per_device_train_batch_size=8 // world, gradient_accumulation_steps=ACCUM, max_steps=STEPS,
        learning_rate=3e-3, weight_decay=0.1, adam_beta2=0.95, max_grad_norm=CLIP, lr_scheduler_type="linear",
        warmup_steps=1, logging_steps=1, save_strategy="steps", save_steps=2, save_total_limit=3, report_to=[],
        use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, ddp_backend="gloo")
    return TrainingArguments(**{**options, **kw})


class FreezeAt(TrainerCallback):
    """Freezes the final layer norm after the first step (training goes on without it)."""

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step == 1:
            for p in model.transformer.ln_f.parameters():
                p.requires_grad_(False)


MUON = {"adjust_lr_fn": "match_rms_adamw", "momentum": 0.9}


def muon_groups(model: torch.nn.Module, lr: float = 3e-3, wd: float = 0.1) -> tuple[list[dict], list[dict]]:
    """GPT-2's hidden matrices (2-D, not the token or position embeddings, which the head shares) for
    Muon; the rest for AdamW in Trainer's decay / no-decay groups, with the TrainingArguments' values."""
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    mats = [p for n, p in named if is_hidden_matrix(n, p)]
    rest = [(n, p) for n, p in named if not is_hidden_matrix(n, p)]
    adamw = [{"params": [p for n, p in rest if n in decay], "weight_decay": wd},
             {"params": [p for n, p in rest if n not in decay], "weight_decay": 0.0}]
    return [{"params": mats, "lr": lr, "weight_decay": wd, **MUON}], [g for g in adamw if g["params"]]


class TorchPair(torch.optim.Optimizer):
    """The reference: torch.optim.Muon for the hidden matrices and torch.optim.AdamW for the rest,
    stepped together as one optimizer (the form Trainer takes), their param groups shared."""

    def __init__(self, model: torch.nn.Module) -> None:
        muon, adamw = muon_groups(model)
        self.muon = torch.optim.Muon(muon)
        self.adamw = torch.optim.AdamW(adamw, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
        super().__init__([torch.zeros(1, requires_grad=True)], {})  # a placeholder: the groups are the pair's

    @property
    def param_groups(self) -> list[dict]:  # the two optimizers' own, also after their load_state_dict
        return self.muon.param_groups + self.adamw.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:  # Optimizer.__init__'s; the groups are the pair's
        pass

    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def run(cls, out: str, shardopt_kwargs: dict | None = None, resume: str | None = None, twice: bool = False,
        how: str = "", **kw) -> dict:
    extra = {} if shardopt_kwargs is None else {"shardopt_kwargs": shardopt_kwargs}
    model = tiny_gpt2(seed=0)
    if how == "sequential_lr":  # the user's AdamW and a composite schedule
        lr = torch.optim.lr_scheduler
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
        sched = lr.SequentialLR(opt, [lr.LinearLR(opt, start_factor=0.1, total_iters=2), lr.ConstantLR(opt, 1.0)],
                                milestones=[2])
        extra["optimizers"] = (opt, sched)
    elif how == "optimizer_cls":
        extra["optimizer_cls_and_kwargs"] = (torch.optim.AdamW, {"lr": 1e-3, "betas": (0.8, 0.9)})
    elif how == "freeze":
        extra["callbacks"] = [FreezeAt()]
    elif how == "muon_ref":
        extra["optimizers"] = (TorchPair(model), None)
    elif how == "muon_given":  # the user's ShardedMuon, stage 1
        muon, adamw = muon_groups(model)
        given = muon + [{**g, "use_muon": False, "lr": 3e-3, "betas": (0.9, 0.95)} for g in adamw]
        extra["optimizers"] = (shardopt.ShardedMuon(given, stage=1), None)
    if how == "model_init":
        trainer = cls(model_init=lambda: tiny_gpt2(seed=0), args=args(out, **kw), train_dataset=Tokens(), **extra)
    else:
        trainer = cls(model=model, args=args(out, **kw), train_dataset=Tokens(), **extra)
    trainer.seen_losses, trainer.seen_norms = [], []
    trainer.train(resume_from_checkpoint=resume)
    if twice:  # train() again on the same trainer goes on from the trained weights
        trainer.train()
    opt = getattr(trainer, "sharded_optimizer", None)
    report = opt.memory_report() if opt is not None else None
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return {"losses": trainer.seen_losses, "norms": trainer.seen_norms, "logged_norms": logged,
            "weights": weights(trainer.model), "ddp": isinstance(trainer.model_wrapped,
                                                                  torch.nn.parallel.DistributedDataParallel),
            "lr": trainer.lr_scheduler.get_last_lr(), "optimizer": type(opt).__name__,
            "memory": None if report is None else {"grads": report.grads, "exp_avg": report.exp_avg,
                                                   "numel": report.num_params}}


def main() -> None:
    what, out = sys.argv[1], sys.argv[2]
    stage2 = os.path.join(out, "stage2")
    if what == "resume":  # then bf16 autocast, which one process cannot switch back from
        result = {"resume": run(RecordingShardedTrainer, os.path.join(out, "resumed"), {"stage": 2},
                                resume=os.path.join(stage2, "checkpoint-2"))}
        result["bf16_adamw"] = run(RecordingTrainer, os.path.join(out, "bf16-adamw"), bf16=True)
        result["bf16_stage2"] = run(RecordingShardedTrainer, os.path.join(out, "bf16-s2"), {"stage": 2}, bf16=True)
        write_result(result)
        return
    result = {"adamw": run(RecordingTrainer, os.path.join(out, "adamw")),
              "stage1": run(RecordingShardedTrainer, os.path.join(out, "stage1"), {"stage": 1}),
              "stage2": run(RecordingShardedTrainer, stage2, {"stage": 2})}
    result["resume"] = run(RecordingShardedTrainer, os.path.join(out, "resumed2"), {"stage": 2},
                           resume=os.path.join(stage2, "checkpoint-2"))
    result["checkpoint_files"] = sorted(os.listdir(os.path.join(stage2, "checkpoint-2")))
    for how in ("twice", "sequential_lr", "optimizer_cls", "freeze", "model_init"):
        twice = how in ("twice", "model_init")
        result[f"{how}_adamw"] = run(RecordingTrainer, os.path.join(out, f"{how}-adamw"), twice=twice, how=how,
                                     max_steps=2 if twice else 4, save_strategy="no")
        result[f"{how}_stage2"] = run(RecordingShardedTrainer, os.path.join(out, f"{how}-s2"), {"stage": 2},
                                      twice=twice, how=how, max_steps=2 if twice else 4, save_strategy="no")
    result["muon_ref"] = run(RecordingTrainer, os.path.join(out, "muon-ref"), how="muon_ref", save_strategy="no")
    result["muon_stage2"] = run(RecordingShardedTrainer, os.path.join(out, "muon-s2"), {"stage": 2, "muon": MUON},
                                save_strategy="no")
    result["muon_given"] = run(RecordingShardedTrainer, os.path.join(out, "muon-given"), {}, how="muon_given",
                               save_strategy="no")
    write_result(result)


if __name__ == "__main__":
    main()
