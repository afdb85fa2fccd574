"""Tier 3: PyTorch Lightning's Trainer with ShardedStrategy under a real torchrun launch, against
strategy="ddp" + torch.optim.AdamW run in the same processes (tests/frameworks/lightning_worker.py).

Catches: a strategy that wraps the model in DDP or leaves ZeRO-2's bytes unsharded; clipping that
goes to torch's clip_grad_norm_ (raises in stage 2) or is lost (the per-step losses drift from the
reference, whose clipping bites at every step); a grad norm that is not the global one; accumulation
that communicates on every micro-batch; a scheduler left pointing at the replaced AdamW (its learning
rates stop reaching the optimizer); opt.clip_grad_norm_ on the LightningOptimizer whose clip never
reaches the step; a Lightning .ckpt that does not resume exactly at 2 processes or at 1; fp16 weights
whose backward bypasses the optimizer's loss scale; errors raised on only one rank (a hang).
Two launches: ``main`` at 2 ranks (every run, about 10 s), ``resume1`` at 1 rank.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from launch import ROOT, run_launcher, torchrun

pytestmark = pytest.mark.launch  # real torchrun launches (see tests/conftest.py)

WORKER = "tests/frameworks/lightning_worker.py"
CLIP = 0.5
PARITY = 1e-5  # fp32, the same math as DDP + AdamW up to summation order


@pytest.fixture(scope="module")
def main_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], str]:
    out = str(tmp_path_factory.mktemp("lightning_main"))
    return torchrun(WORKER, "main", out, nproc=2, out_dir=out, timeout=240), out


@pytest.fixture(scope="module")
def resume1_run(main_run: tuple[list[dict], str], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = str(tmp_path_factory.mktemp("lightning_resume1"))
    ckpt = os.path.join(main_run[1], "ckpt_epoch0.ckpt")
    return torchrun(WORKER, "resume1", ckpt, nproc=1, out_dir=out, timeout=180)[0], out


def max_abs(a: list, b: list) -> float:
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    assert ta.shape == tb.shape, (ta.shape, tb.shape)
    return float((ta - tb).abs().max())


def weights_diff(a_path: str, b_path: str) -> float:
    a, b = torch.load(a_path), torch.load(b_path)
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.parametrize("run", ["stage1", "stage2"])
def test_clipping_and_accumulation_match_ddp(main_run, run):
    results, _ = main_run
    for rank, res in enumerate(results):
        ref, got = res["ref_clip"], res[run]
        assert len(ref["losses"]) == 16 and len(ref["norms"]) == 8  # 2 epochs x 4 steps of 2 micro-batches
        assert min(ref["norms"]) > CLIP, ref["norms"]  # clipping bites at every step
        assert max_abs(ref["losses"], got["losses"]) <= PARITY, (rank, ref["losses"], got["losses"])
        assert max_abs(ref["norms"], got["norms"]) <= PARITY, (rank, ref["norms"], got["norms"])
        assert got["lrs"] == ref["lrs"] and len({tuple(lr) for lr in ref["lrs"]}) >= 5  # LambdaLR, per step
    assert results[0][run]["norms"] == results[1][run]["norms"]  # one global norm, the same on every rank
    assert results[0]["stage1"]["stage"] == 1  # a ShardedAdamW from configure_optimizers is used as built


def test_accumulation_does_not_communicate(main_run):
    """A step after two micro-batches reduces as many gradient bytes as a step after one."""
    for res in main_run[0]:
        accumulated, single = res["stage2"]["reduce_bytes"], res["sched"]["reduce_bytes"]
        assert len(accumulated) == 8 and len(single) == 8 and single[0] > 0
        assert set(accumulated) == {single[0]} == set(single), (accumulated, single)
        assert set(res["stage1"]["reduce_bytes"]) == set(res["manual_clip"]["reduce_bytes"])  # stage 1 too


def test_stage2_holds_zero2_bytes_and_no_ddp_wrapper(main_run):
    for res in main_run[0]:
        for run, psize, master in (("stage2", 4, 0), ("bf16", 2, 4)):  # fp32 parameters are their own master
            m = res[run]["memory"]
            n, rep = m["numel"], m["report"]
            assert m["optimizer"] == "ShardedAdamW" and m["stage"] == 2
            assert m["model_type"] == "GPTModule" and not m["ddp_anywhere"]
            pad = 8 * m["n_tensors"] + 16  # elements: at most one alignment per parameter and per rank
            assert rep["params"] >= n * psize  # replicated
            for cat, full in (("grads", n * psize), ("master", n * master), ("exp_avg", n * 4), ("exp_avg_sq", n * 4)):
                per_elem = full // n
                assert abs(rep[cat] - full / 2) <= pad * per_elem, (run, cat, rep[cat], full)
        assert res["bf16"]["memory"]["param_dtypes"] == ["torch.bfloat16"]


def test_checkpoint_resumes_at_two_and_one_processes(main_run, resume1_run):
    results, out = main_run
    ckpt = torch.load(os.path.join(out, "ckpt_epoch0.ckpt"), weights_only=False)
    state = ckpt["optimizer_states"][0]  # an ordinary Lightning checkpoint, AdamW's format
    assert set(state) >= {"state", "param_groups"} and len(state["state"]) == 28
    uninterrupted = [r["stage2"] for r in results]
    for rank, res in enumerate(results):  # resumed at 2 processes: epoch 1 again, exactly
        assert max_abs(uninterrupted[rank]["losses"][8:], res["resume2"]["losses"]) <= 1e-6
        assert max_abs(uninterrupted[rank]["norms"][4:], res["resume2"]["norms"]) <= 1e-6
    assert weights_diff(os.path.join(out, "stage2.weights.pt"), os.path.join(out, "resume2.weights.pt")) <= 1e-6
    # At 1 process with the same global batch (8 sequences at once, not 4 + 4 averaged): the loss is
    # the mean of the two ranks' losses; only the rounding of the split differs (measured 2e-7 on weights).
    one, out1 = resume1_run
    both = [(a + b) / 2 for a, b in zip(uninterrupted[0]["losses"][8:], uninterrupted[1]["losses"][8:])]
    assert max_abs(both, one["resume1"]["losses"]) <= 1e-6
    assert max_abs(uninterrupted[0]["norms"][4:], one["resume1"]["norms"]) <= 1e-6
    assert weights_diff(os.path.join(out, "stage2.weights.pt"), os.path.join(out1, "resume1.weights.pt")) <= 1e-6


def test_ddp_checkpoint_resumes_under_sharded_strategy(main_run):
    """A .ckpt written by strategy="ddp" + AdamW continues under ShardedStrategy as under DDP."""
    results, out = main_run
    for res in results:
        assert max_abs(res["ref_clip"]["losses"][8:], res["from_ddp"]["losses"]) <= PARITY
        assert max_abs(res["ref_clip"]["norms"][4:], res["from_ddp"]["norms"]) <= PARITY
    assert weights_diff(os.path.join(out, "ref_clip.weights.pt"), os.path.join(out, "from_ddp.weights.pt")) <= PARITY


def test_plain_adamw_and_scheduler_are_converted(main_run):
    for res in main_run[0]:
        ref, got = res["ref_sched"], res["sched"]
        assert got["scheduler_follows"]
        assert len({tuple(lr) for lr in ref["lrs"]}) >= 5, ref["lrs"]  # warmup then decay: changes every step
        assert got["lrs"] == ref["lrs"]  # the learning rates the optimizer actually used
        assert max_abs(ref["losses"], got["losses"]) <= PARITY


@pytest.mark.parametrize("run", ["manual_wrapper", "manual_clip"])
def test_manual_optimization_with_clipping_matches_ddp(main_run, run):
    for res in main_run[0]:
        ref, got = res["ref_manual"], res[run]
        assert len(ref["norms"]) == 8 and min(ref["norms"]) > CLIP, ref["norms"]
        assert max_abs(ref["norms"], got["norms"]) <= PARITY
        assert max_abs(ref["losses"], got["losses"]) <= PARITY, (ref["losses"], got["losses"])
        assert got["lrs"] == ref["lrs"] and ref["lrs"][-1][0] < ref["lrs"][0][0]  # StepLR, list form


def test_16_bit_precisions_train(main_run):
    for res in main_run[0]:
        for run in ("bf16", "fp16", "bf16_mixed"):
            losses = res[run]["losses"]
            assert len(losses) == 16 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, (run, losses)
            assert res[run]["warnings"] == [], (run, res[run]["warnings"])  # fp16: no "call opt.backward" warning
        assert res["fp16"]["step_count"] + res["fp16"]["skipped"] == 16 and res["fp16"]["step_count"] >= 14
        assert res["fp16"]["loss_scale"] >= 2.0**14  # dynamic scaling active, not collapsed
        assert res["bf16_mixed"]["param_dtype"] == "torch.float32"


@pytest.mark.parametrize("run, kind, words", [
    ("err_clip_value", "ValueError", ["gradient_clip_algorithm='value'", "'norm'"]),
    ("err_sgd", "TypeError", ["torch.optim.sgd.SGD", "torch.optim.AdamW"]),
    ("err_prebuilt", "RuntimeError", ["before Lightning converted", "inside configure_optimizers"]),
    ("err_16_mixed", "ValueError", ["GradScaler", "'16-true'"]),
])
def test_unsupported_settings_raise_on_every_rank(main_run, run, kind, words):
    for res in main_run[0]:
        assert res[run]["raised"] == kind, res[run]
        for w in words:
            assert w in res[run]["message"], res[run]["message"]


def test_example_under_lightnings_own_launcher():
    """``python examples/lightning_gpt.py --devices 2``: Lightning starts the second process itself."""
    cmd = [sys.executable, os.path.join(ROOT, "examples", "lightning_gpt.py"), "--devices", "2", "--steps", "20"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = run_launcher(cmd, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    losses = [float(line.split("| loss ")[1].split()[0]) for line in proc.stdout.splitlines() if "| loss " in line]
    assert len(losses) == 2 and losses[-1] < losses[0] - 0.5, proc.stdout
    assert proc.stdout.count("memory on rank") == 2 and "memory on rank 1 of 2 (stage 2" in proc.stdout


def test_fitting_the_same_module_twice_matches_ddp_and_ends_with_the_last_weights(main_run):
    """A second fit builds a second ShardedAdamW over the same parameters: the first must stop
    taking the gradients; with overlapped gathers, fit must return with the last step's weights."""
    results, _ = main_run
    for r in results:
        ref, got = r["ref_refit"], r["refit"]
        assert len(got["losses"]) == len(ref["losses"]) == 16
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= 1e-5
        assert got["pending_after_fit"] == [] and got["weights_vs_ddp"] <= 1e-5, got["weights_vs_ddp"]


@pytest.mark.parametrize("form", ["lists", "dicts"])
def test_a_torch_muon_and_adamw_pair_becomes_one_sharded_muon_that_trains_like_ddp(main_run, form):
    """configure_optimizers returns torch's pair with a schedule each; ShardedStrategy merges it into
    one ShardedMuon, so automatic optimization takes it, against DDP stepping the pair by hand."""
    # Newton-Schulz runs in bf16: DDP's and shardopt's averaged gradients differ in their last bits
    # (summation order), which can move a bf16 rounding of the orthogonalised update; at lr 0.02 the
    # runs drift apart by about 5e-5 in loss, 3e-4 in norm and 6e-4 in weights over 8 steps; the
    # learning rates of every group must match exactly, and AdamW alone lands 3e-2 away.
    tol = 1e-3
    results, out = main_run
    for res in results:
        ref, got = res["ref_muon"], res[f"muon_{form}"]
        assert got["optimizers"] == ["ShardedMuon"]
        assert len(ref["norms"]) == 8 and min(ref["norms"]) > CLIP, ref["norms"]  # clipping bites at every step
        assert len({tuple(lr) for lr in ref["lrs"]}) == 8 and got["lrs"] == ref["lrs"]  # each group its own schedule
        assert max_abs(ref["losses"], got["losses"]) <= tol and max_abs(ref["norms"], got["norms"]) <= tol
    diff = weights_diff(os.path.join(out, "ref_muon.weights.pt"), os.path.join(out, f"muon_{form}.weights.pt"))
    assert diff <= 2 * tol, diff
    assert weights_diff(os.path.join(out, "ref_muon.weights.pt"), os.path.join(out, "ref_sched.weights.pt")) > 1e-2
