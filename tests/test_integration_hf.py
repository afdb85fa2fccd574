"""Tier 3: transformers.Trainer with shardopt (``ShardedTrainer``) against the same Trainer with
its AdamW under DDP, both under a real torchrun with the real transformers installed.

Catches a Trainer that still wraps the model in DDP, ``max_grad_norm`` that does not clip the
sharded gradients or logs another norm, TrainingArguments that lose their meaning (schedule,
decay groups, accumulation), model weights that safetensors refuses to save, and checkpoints
that do not resume exactly at the same or at another number of processes.
"""
from __future__ import annotations

import pytest
import transformers  # noqa: F401  (the [hf] extra is part of the test setup: fail, never skip, without it)

from frameworks.common import max_diff
from launch import torchrun

pytestmark = pytest.mark.launch  # real torchrun launches (see tests/conftest.py)

WORKER = "tests/frameworks/hf_worker.py"
CLIP = 0.5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf"))
    two = torchrun(WORKER, "parity", root, nproc=2, out_dir=root + "/two")
    one = torchrun(WORKER, "resume", root, nproc=1, out_dir=root + "/one")[0]
    return two, one


def _close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol


def test_loss_curve_and_logged_grad_norm_equal_adamw_under_ddp(runs):
    two, _ = runs
    for rank, r in enumerate(two):
        ref = r["adamw"]
        assert ref["ddp"] and not r["stage1"]["ddp"] and not r["stage2"]["ddp"]
        assert len(ref["losses"]) == 8 and len(ref["norms"]) == 4  # 4 steps of 2 micro-batches
        assert min(ref["norms"]) > CLIP  # clipping bites at every step
        for stage in ("stage1", "stage2"):
            got = r[stage]
            assert _close(got["losses"], ref["losses"], 1e-5), (stage, rank)
            assert _close(got["norms"], ref["norms"], 1e-5), (stage, rank)
            assert _close(got["logged_norms"], ref["logged_norms"], 1e-5), (stage, rank)  # what Trainer logs
            assert max_diff(got["weights"], ref["weights"]) <= 1e-5, (stage, rank)
            assert got["lr"] == ref["lr"]


def test_stage2_holds_half_the_gradients_and_moments(runs):
    two, _ = runs
    for r in two:
        m = r["stage2"]["memory"]
        half = 4 * m["numel"] / 2
        assert half <= m["grads"] <= half * 1.01 + 64 and half <= m["exp_avg"] <= half * 1.01 + 64, m
        assert "shardopt" in r["checkpoint_files"] and "optimizer.pt" not in r["checkpoint_files"]


def test_checkpoint_resumes_exactly_at_two_and_at_one_process(runs):
    two, one = runs
    for r in two:
        assert r["resume"]["losses"] == r["stage2"]["losses"][4:]
        assert max_diff(r["resume"]["weights"], r["stage2"]["weights"]) == 0
    res = one["resume"]  # one process sees both ranks' micro-batches as one: its loss is their mean
    mean = [(a + b) / 2 for a, b in zip(two[0]["stage2"]["losses"][4:], two[1]["stage2"]["losses"][4:])]
    assert _close(res["losses"], mean, 1e-5), (res["losses"], mean)
    assert _close(res["norms"], two[0]["stage2"]["norms"][2:], 1e-5)
    assert max_diff(res["weights"], two[0]["stage2"]["weights"]) <= 1e-5


def test_bf16_autocast_trains_like_adamw(runs):
    _, one = runs
    ref, got = one["bf16_adamw"], one["bf16_stage2"]
    assert _close(got["losses"], ref["losses"], 1e-3)
    assert max_diff(got["weights"], ref["weights"]) <= 1e-3


@pytest.mark.parametrize("how", ["twice", "sequential_lr", "optimizer_cls", "freeze", "model_init"])
def test_trainer_options_train_like_trainer(runs, how):
    """train() twice (also with model_init, as hyperparameter search does), the user's AdamW with a
    composite schedule, optimizer_cls_and_kwargs, and parameters frozen after the first step."""
    two, _ = runs
    for r in two:
        ref, got = r[f"{how}_adamw"], r[f"{how}_stage2"]
        assert len(ref["losses"]) == 8 and _close(got["losses"], ref["losses"], 1e-5), (how, got["losses"])
        assert max_diff(got["weights"], ref["weights"]) <= 1e-5, how


@pytest.mark.parametrize("how", ["muon_stage2", "muon_given"])
def test_muon_trains_like_a_torch_muon_and_adamw_pair_under_ddp(runs, how):
    """shardopt_kwargs={"muon": ...} (stage 2) and a ShardedMuon passed in (stage 1) against Trainer
    with torch.optim.Muon + torch.optim.AdamW under DDP: the same groups, clipping, schedule."""
    two, _ = runs
    for rank, r in enumerate(two):
        ref, got = r["muon_ref"], r[how]
        assert ref["ddp"] and not got["ddp"] and got["optimizer"] == "ShardedMuon"
        assert len(ref["losses"]) == 8 and min(ref["norms"]) > CLIP
        assert _close(got["losses"], ref["losses"], 1e-5), (how, rank, got["losses"], ref["losses"])
        assert _close(got["norms"], ref["norms"], 1e-5), (how, rank)
        # Newton-Schulz runs in bf16: DDP's and shardopt's averaged gradients differ in their last bits
        # (summation order), which can move a bf16 rounding of the orthogonalised update.
        assert max_diff(got["weights"], ref["weights"]) <= 1e-4, (how, rank, max_diff(got["weights"], ref["weights"]))
        assert max_diff(got["weights"], r["adamw"]["weights"]) > 1e-3  # Muon, not AdamW, trained the matrices
        assert got["lr"] == ref["lr"]
