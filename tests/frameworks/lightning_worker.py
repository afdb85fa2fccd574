"""Lightning's Trainer with strategy="ddp" + torch.optim.AdamW (the reference) and with
shardopt's ShardedStrategy, one run after the other in the same torchrun processes.

``main <out_dir>`` (2 ranks) runs, in order:
  ``ref_clip``        ddp + AdamW + per-step LambdaLR (dict form), fp32, gradient_clip_val=0.5,
                      accumulate_grad_batches=2, 2 epochs; logs torch's clip_grad_norm_ of the DDP gradients;
                      saves ``ddp_epoch0.ckpt`` after epoch 0;
  ``stage1``          the same with a ShardedAdamW(stage=1) built in configure_optimizers (used as is),
                      clipping through the Trainer's default hook, norm read from strategy.last_grad_norm;
  ``stage2``          the same with a plain AdamW converted by ShardedStrategy(stage=2), the norm logged from
                      configure_gradient_clipping; saves ``ckpt_epoch0.ckpt`` after epoch 0 and goes on
                      (the uninterrupted run), reports memory and whether a DDP wrapper exists;
  ``resume2``         ``stage2`` resumed from that checkpoint with Trainer.fit(ckpt_path=...);
  ``from_ddp``        ShardedStrategy resumed from the ddp run's checkpoint;
  ``ref_sched`` / ``sched``   AdamW + a per-step LambdaLR (dict form), ddp vs converted;
  ``ref_manual`` / ``manual_wrapper`` / ``manual_clip``   manual optimization with a StepLR (list form) and
                      clipping to 0.5: torch's clip_grad_norm_ (ddp), opt.clip_grad_norm_ on the
                      LightningOptimizer, self.clip_gradients;
  ``bf16`` / ``fp16`` / ``bf16_mixed``   precision="bf16-true" / "16-true" (loss scaling by the optimizer) /
                      "bf16-mixed";
  ``ref_muon`` / ``muon_lists`` / ``muon_dicts``   a torch.optim.Muon + torch.optim.AdamW pair with a per-step
                      LambdaLR each, clipping to 0.5: ddp with manual optimization (Lightning's only way for two
                      optimizers) against ShardedStrategy(stage=2) given the pair in the two-lists form and in the
                      one-dict-per-optimizer form, in automatic optimization;
  ``err_*``           settings that must raise on every rank.
``resume1 <ckpt>`` (1 rank): ``stage2`` resumed from its checkpoint on one process, same global batch.
Weights go to ``<out_dir>/<run>.weights.pt`` (rank 0), everything else to ``rank{r}.json``.
"""
from __future__ import annotations

import os
import sys
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import shardopt
from common import tiny_gpt2, tokens, torch_muon_pair, write_result
from shardopt.integrations.lightning import ShardedStrategy

CLIP, ACCUM, LR, GLOBAL_BATCH = 0.5, 2, 3e-3, 8
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))


def groups(model: torch.nn.Module) -> list[dict]:
    """Two groups as in GPT training: matrices with weight decay, the rest without and at half the lr."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": LR / 2}]


class GPTModule(pl.LightningModule):
    """Tiny GPT-2. ``optim``: "adamw", "sharded1" (ShardedAdamW stage 1), "sgd", "prebuilt" (a
    ShardedAdamW built in the setup hook, before the precision plugin converts the model).
    ``sched``: None, "dict" (per-step LambdaLR) or "list" (StepLR). ``manual``: None (automatic
    optimization), "torch", "wrapper" or "clip_gradients" (how the manual loop clips).
    ``norm_from``: "hook" (configure_gradient_clipping logs it) or "batch_end"."""

    def __init__(self, optim: str = "adamw", lr: float = LR, sched: str | None = None, manual: str | None = None,
                 norm_from: str = "hook") -> None:
        super().__init__()
        self.gpt = tiny_gpt2(seed=0)
        self.optim, self.lr, self.sched, self.manual, self.norm_from = optim, lr, sched, manual, norm_from
        self.automatic_optimization = manual is None
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.lrs: list[list[float]] = []
        self.comm: list[int] = []
        self.prebuilt: torch.optim.Optimizer | None = None

    def setup(self, stage: str) -> None:
        if self.optim == "prebuilt":  # too early: Lightning converts the module after this hook
            self.prebuilt = shardopt.ShardedAdamW(self.parameters(), lr=self.lr)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        loss = self.gpt(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        if self.manual == "torch":
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP)
        elif self.manual == "wrapper":
            norm = opt.clip_grad_norm_(CLIP)
        else:
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            norm = self.trainer.strategy.last_grad_norm
        self.norms.append(float(norm))
        self.log("grad_norm", norm)
        self.lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        self.lr_schedulers().step()
        return None

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        if self.norm_from != "hook" or not gradient_clip_val:
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if isinstance(optimizer, shardopt.ShardedAdamW):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            norm = self.trainer.strategy.last_grad_norm
        else:  # the reference: DDP has averaged the gradients into p.grad
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)
        self.norms.append(float(norm))
        self.log("grad_norm", norm)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.lrs.append([g["lr"] for g in optimizer.param_groups])

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        if (batch_idx + 1) % self.trainer.accumulate_grad_batches:
            return  # an accumulating micro-batch: no step was taken
        if self.norm_from == "batch_end":
            self.norms.append(float(self.trainer.strategy.last_grad_norm))
        opt = self.trainer.strategy.optimizers[0]
        if isinstance(opt, shardopt.ShardedAdamW):  # gradient bytes reduced since the previous step
            self.comm.append(opt.last_step_comm.reduce_bytes)

    def configure_optimizers(self) -> object:
        if self.optim == "prebuilt":
            return self.prebuilt
        if self.optim == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.optim == "sharded1":
            opt = shardopt.ShardedAdamW(groups(self), lr=self.lr, betas=(0.9, 0.95), stage=1)
        else:
            opt = torch.optim.AdamW(groups(self), lr=self.lr, betas=(0.9, 0.95))
        if self.sched == "dict":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.8 ** max(0, s - 2))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if self.sched == "list":
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]
        return opt


class MuonModule(GPTModule):
    """``form``: "ref" (manual optimization of the torch pair, as Lightning requires for two
    optimizers), "lists" or "dicts" (the pair returned in that form, automatic optimization)."""

    def __init__(self, form: str) -> None:
        super().__init__(manual="torch" if form == "ref" else None)
        self.form = form

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        if self.form != "ref":
            return super().training_step(batch, batch_idx)
        loss = self.gpt(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        opts = self.optimizers()
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP)))
        self.lrs.append([g["lr"] for opt in opts for g in opt.param_groups])
        for opt in opts:
            opt.step()
        for sched in self.lr_schedulers():
            sched.step()
        return None

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.form != "ref":
            super().on_before_optimizer_step(optimizer)

    def configure_optimizers(self) -> object:
        muon, adamw, (s1, s2) = torch_muon_pair(self, LR)
        if self.form == "dicts":
            return ({"optimizer": muon, "lr_scheduler": {"scheduler": s1, "interval": "step"}},
                    {"optimizer": adamw, "lr_scheduler": {"scheduler": s2, "interval": "step"}})
        return [muon, adamw], [{"scheduler": s1, "interval": "step"}, {"scheduler": s2, "interval": "step"}]


class SaveAfterEpoch(pl.Callback):
    def __init__(self, path: str, epoch: int) -> None:
        self.path, self.epoch = path, epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)  # every rank: the optimizer state is consolidated on rank 0


def loader() -> DataLoader:
    return DataLoader(tokens(), batch_size=GLOBAL_BATCH // WORLD, shuffle=False)


def trainer(strategy: object, epochs: int = 1, **kw: object) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_epochs=epochs, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)


def run(name: str, out: dict, module: GPTModule, strategy: object, *, ckpt_path: str | None = None,
        save_weights: bool = False, **trainer_kw: object) -> tuple[pl.Trainer, GPTModule]:
    t = trainer(strategy, **trainer_kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(module, loader(), ckpt_path=ckpt_path)
    out[name] = {"losses": module.losses, "norms": module.norms, "lrs": module.lrs, "reduce_bytes": module.comm,
                 "warnings": [str(w.message) for w in caught
                              if "shardopt" in str(w.message) or "backward" in str(w.message)]}
    if save_weights and RANK == 0:
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()},
                   os.path.join(os.environ["SHARDOPT_TEST_OUT"], f"{name}.weights.pt"))
    return t, module


def expect_error(name: str, out: dict, module: GPTModule, strategy: object, **trainer_kw: object) -> None:
    try:
        trainer(strategy, **trainer_kw).fit(module, loader())
        out[name] = {"raised": None, "message": ""}
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        out[name] = {"raised": type(e).__name__, "message": str(e)}


def memory(t: pl.Trainer) -> dict:
    opt = t.strategy.optimizers[0]
    rep = opt.memory_report()
    params = {id(p): p for p in t.lightning_module.parameters() if p.requires_grad}  # shared ones once
    return {"report": {c: getattr(rep, c) for c in ("params", "grads", "master", "exp_avg", "exp_avg_sq")},
            "numel": sum(p.numel() for p in params.values()), "n_tensors": len(params),
            "param_dtypes": sorted({str(p.dtype) for p in params.values()}),
            "optimizer": type(opt).__name__, "stage": opt.config.stage,
            "model_type": type(t.strategy.model).__name__,
            "ddp_anywhere": isinstance(t.model, DistributedDataParallel)
            or any(isinstance(m, DistributedDataParallel) for m in t.strategy.model.modules())}


def main(out_dir: str) -> None:
    out: dict = {"world": WORLD}
    ckpt, ddp_ckpt = os.path.join(out_dir, "ckpt_epoch0.ckpt"), os.path.join(out_dir, "ddp_epoch0.ckpt")
    clip = dict(epochs=2, gradient_clip_val=CLIP, accumulate_grad_batches=ACCUM)

    run("ref_clip", out, GPTModule(sched="dict"), "ddp", save_weights=True,
        callbacks=[SaveAfterEpoch(ddp_ckpt, 0)], **clip)
    t, _ = run("stage1", out, GPTModule(optim="sharded1", sched="dict", norm_from="batch_end"),
               ShardedStrategy(stage=2), **clip)
    out["stage1"]["stage"] = t.strategy.optimizers[0].config.stage  # the user's ShardedAdamW, as built
    t, _ = run("stage2", out, GPTModule(sched="dict"), ShardedStrategy(stage=2), save_weights=True,
               callbacks=[SaveAfterEpoch(ckpt, 0)], **clip)
    out["stage2"]["memory"] = memory(t)
    run("resume2", out, GPTModule(sched="dict"), ShardedStrategy(stage=2), ckpt_path=ckpt, save_weights=True, **clip)
    run("from_ddp", out, GPTModule(sched="dict"), ShardedStrategy(stage=2), ckpt_path=ddp_ckpt, save_weights=True,
        **clip)

    run("ref_sched", out, GPTModule(sched="dict"), "ddp", epochs=1, save_weights=True)
    t, m = run("sched", out, GPTModule(sched="dict"), ShardedStrategy(stage=2), epochs=1)
    sched = t.lr_scheduler_configs[0].scheduler
    out["sched"]["scheduler_follows"] = sched.optimizer is t.strategy.optimizers[0]

    run("ref_manual", out, GPTModule(sched="list", manual="torch"), "ddp", epochs=1)
    run("manual_wrapper", out, GPTModule(sched="list", manual="wrapper"), ShardedStrategy(stage=2), epochs=1)
    run("manual_clip", out, GPTModule(sched="list", manual="clip_gradients"), ShardedStrategy(stage=1), epochs=1)

    t, _ = run("bf16", out, GPTModule(lr=1e-2), ShardedStrategy(stage=2), epochs=2, precision="bf16-true",
               gradient_clip_val=1.0)
    out["bf16"]["memory"] = memory(t)
    t, _ = run("fp16", out, GPTModule(lr=1e-2), ShardedStrategy(stage=2), epochs=2, precision="16-true")
    opt = t.strategy.optimizers[0]
    out["fp16"].update(loss_scale=opt.loss_scale, step_count=opt.step_count, skipped=opt.skipped_steps)

    # The same module fitted twice (as after a learning-rate finder), with overlapped weight gathers.
    ref = GPTModule(sched="dict")
    run("ref_refit", out, ref, "ddp", epochs=1)
    run("ref_refit", out, ref, "ddp", epochs=1)
    refit = GPTModule(sched="dict")
    run("refit", out, refit, ShardedStrategy(stage=2, overlap_param_gather=True), epochs=1)
    t, _ = run("refit", out, refit, ShardedStrategy(stage=2, overlap_param_gather=True), epochs=1)
    out["refit"]["pending_after_fit"] = t.strategy.optimizers[0].pending_param_buckets()
    out["refit"]["weights_vs_ddp"] = max((a.detach() - b.detach()).abs().max().item()
                                         for a, b in zip(refit.parameters(), ref.parameters()))

    run("ref_muon", out, MuonModule("ref"), "ddp", epochs=1, save_weights=True)
    for form in ("lists", "dicts"):
        t, _ = run(f"muon_{form}", out, MuonModule(form), ShardedStrategy(stage=2), epochs=1, gradient_clip_val=CLIP,
                   save_weights=True)
        out[f"muon_{form}"]["optimizers"] = [type(o).__name__ for o in t.strategy.optimizers]

    expect_error("err_clip_value", out, GPTModule(), ShardedStrategy(), gradient_clip_val=CLIP,
                 gradient_clip_algorithm="value")
    expect_error("err_sgd", out, GPTModule(optim="sgd"), ShardedStrategy())
    expect_error("err_prebuilt", out, GPTModule(optim="prebuilt"), ShardedStrategy(), precision="bf16-true")
    t, _ = run("bf16_mixed", out, GPTModule(lr=1e-2), ShardedStrategy(stage=2), epochs=2, precision="bf16-mixed")
    out["bf16_mixed"]["param_dtype"] = str(next(t.lightning_module.parameters()).dtype)
    # On CPU Lightning turns precision="16-mixed" into "bf16-mixed"; an explicit plugin keeps the GradScaler.
    expect_error("err_16_mixed", out, GPTModule(), ShardedStrategy(), plugins=[MixedPrecision("16-mixed", "cpu")])
    write_result(out)


def resume1(ckpt: str) -> None:
    out: dict = {"world": WORLD}
    run("resume1", out, GPTModule(sched="dict"), ShardedStrategy(stage=2), ckpt_path=ckpt,
        save_weights=True, epochs=2, gradient_clip_val=CLIP, accumulate_grad_batches=ACCUM)
    write_result(out)


if __name__ == "__main__":
    {"main": main, "resume1": resume1}[sys.argv[1]](sys.argv[2])
