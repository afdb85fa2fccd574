"""Tier 1, no process group: the step's all-reduce message packs and reads back field by field.

Catches a field whose length drifted from what its producer writes (the call header, the usage
checks' flags, the hyperparameter digest), which would shift every later field.
"""
from __future__ import annotations

import torch

from shardopt.comm._messages import StepMessage, call_header
from shardopt.step._agreement import hyper_code, hyperparameters
from shardopt.step._usage_checks import Findings, UsageChecks


def test_a_message_reads_back_what_was_packed():
    groups = [{"lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}]
    checks = UsageChecks.flags(Findings(written=[[3]], problems=["x"], scaled=2, used=[[True, False]], regraded=True))
    mine = StepMessage(torch.tensor(1.0), torch.tensor(2.5), call=call_header("step", True), checks=checks,
                       hyper=hyper_code(hyperparameters(groups), maxed=False))
    packed = mine.pack(torch.device("cpu"))
    assert packed.shape == (StepMessage.NUMEL,)
    got = StepMessage.reduced(packed * 2)  # as if two ranks sent the same
    assert (got.nonfinite, got.norm) == (2.0, 5.0)
    assert got.call == [2 * x for x in call_header("step", True)]
    assert got.checks == [2 * x for x in checks] and checks == [1, 2, 0, 0, 1, 1, 1.0, 0.0]
    assert got.hyper == [2 * x for x in hyper_code(hyperparameters(groups), maxed=False)]


def test_a_round_tag_has_the_steps_shape_and_only_a_header():
    tag = StepMessage.tag(call_header("backward", False)).pack(torch.device("cpu"))
    assert tag.shape == (StepMessage.NUMEL,)
    got = StepMessage.reduced(tag)
    assert got.call == call_header("backward", False)
    assert not any(got.checks) and not any(got.hyper) and got.nonfinite == got.norm == 0.0
