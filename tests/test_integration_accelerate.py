"""Tier 3: Hugging Face Accelerate's standard loop with shardopt, against the same loop with
torch.optim.AdamW under DDP, both under a real torchrun with the real accelerate installed.

Catches a model that Accelerate still wraps in DDP, clipping that does not reach the sharded
gradients (or reports another norm), accumulation that loses a micro-batch, a scheduler left
driving the AdamW that was converted, and a saved state that does not resume exactly, at the
same or at another number of processes.
"""
from __future__ import annotations

import accelerate  # noqa: F401  (the [hf] extra is part of the test setup: fail, never skip, without it)
import pytest

from frameworks.common import max_diff
from launch import torchrun

pytestmark = pytest.mark.launch  # real torchrun launches (see tests/conftest.py)

WORKER = "tests/frameworks/accelerate_worker.py"
CLIP = 0.5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerate")
    state = str(root / "state")
    two = torchrun(WORKER, "parity", state, nproc=2, out_dir=str(root / "two"))
    one = torchrun(WORKER, "resume", state, nproc=1, out_dir=str(root / "one"))[0]["resume"]
    return two, one


def test_loss_curve_and_grad_norm_equal_adamw_under_ddp(runs):
    two, _ = runs
    for rank, r in enumerate(two):
        ref = r["adamw"]
        assert r["ddp"] and not r["stage2_ddp"], "the reference runs under DDP, shardopt without it"
        assert r["stage1_is_sharded"], "prepare converts a plain AdamW"
        assert min(ref["norms"]) > CLIP, ref["norms"]  # clipping bites at every step
        assert len(ref["losses"]) == 8 and len(ref["norms"]) == 4  # accumulation 2
        assert not r["split_ddp"]
        for stage in ("stage1", "stage2", "split"):
            got = r[stage]
            assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= 1e-5, (stage, rank)
            assert max(abs(a - b) for a, b in zip(got["norms"], ref["norms"])) <= 1e-5, (stage, rank)
            assert max_diff(got["weights"], ref["weights"]) <= 1e-5, (stage, rank)


def test_stage2_holds_a_half_of_the_state_at_two_ranks(runs):
    two, _ = runs
    for r in two:
        m = r["memory"]
        half = 4 * m["numel"] / 2  # fp32 bytes of half the parameters
        for key in ("grads", "exp_avg", "exp_avg_sq"):
            assert half <= m[key] <= half * 1.01 + 64, (key, m)
        assert m["master"] == 0, m  # fp32 weights are their own master
        assert r["subset_clip"] and "global norm" in r["subset_clip"]


def test_saved_state_resumes_exactly_at_two_and_at_one_process(runs):
    two, one = runs
    for r in two:  # resumed in fresh objects at 2 processes: bit for bit
        assert r["resume"]["losses"] == r["stage2"]["losses"][4:]
        assert max_diff(r["resume"]["weights"], r["stage2"]["weights"]) == 0
        assert r["resume"]["lr"] == r["stage2"]["lr"]
    # at 1 process the same global batches are one micro-batch of 8: the loss is the ranks' mean
    mean = [(a + b) / 2 for a, b in zip(two[0]["stage2"]["losses"][4:], two[1]["stage2"]["losses"][4:])]
    assert max(abs(a - b) for a, b in zip(one["losses"], mean)) <= 1e-5, (one["losses"], mean)
    assert max(abs(a - b) for a, b in zip(one["norms"], two[0]["stage2"]["norms"][2:])) <= 1e-5
    assert max_diff(one["weights"], two[0]["stage2"]["weights"]) <= 1e-5


def test_exported_weights_and_other_models_stay_whole(runs):
    two, _ = runs
    for r in two:
        assert max_diff(r["exported"], r["stage2"]["weights"]) == 0  # save_model wrote every weight
        assert r["other_is_ddp"] and r["other_is_plain"]  # a plain model and AdamW stay Accelerate's
        assert r["frozen_mid_run"] == "ok" and r["after_free_memory"]


def test_a_torch_muon_and_adamw_pair_is_one_sharded_muon_that_trains_like_ddp(runs):
    """prepare(acc, model, muon, adamw, ...) converts the pair into one ShardedMuon, handed out in
    both places; stepping both steps once, and each schedule drives its own groups."""
    two, _ = runs
    for rank, r in enumerate(two):
        ref, got = r["muon_ddp"], r["muon"]
        assert ref["ddp"] and not got["ddp"] and got["optimizers"] == ["ShardedMuon", "ShardedMuon"]
        assert len(ref["norms"]) == 4 and min(ref["norms"]) > CLIP and len(ref["losses"]) == 8
        assert got["lrs"] == ref["lrs"] and len({tuple(x) for x in ref["lrs"]}) == 4
        # Newton-Schulz runs in bf16: DDP's and shardopt's averaged gradients differ in their last
        # bits (summation order), which can move a bf16 rounding of the orthogonalised update. A
        # second step per round (both members stepping) would change the losses by far more.
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= 1e-3, (rank, got["losses"])
        assert max(abs(a - b) for a, b in zip(got["norms"], ref["norms"])) <= 1e-3, (rank, got["norms"])
        assert max_diff(got["weights"], ref["weights"]) <= 2e-3, (rank, max_diff(got["weights"], ref["weights"]))
