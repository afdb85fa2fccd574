"""What rides in the step's one small all-reduce, field by field.

Owns the layout of the all-reduce that ``clip_grad_norm_`` and ``step`` start with (and that each
backward pass's round tag mirrors): which numbers each rank puts in, where they sit, and how the
reduced tensor is read back. The modules that fill a field (``_agreement`` for the call header and
the hyperparameter digest, ``_usage_checks`` for the check flags) take their lengths from here,
so nothing else does index arithmetic on it. Every decision that leads to a collective after the
step's all-reduce is taken from the reduced message, never from a rank-local value.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Sequence

import torch
from torch import Tensor

CALL_LEN = 13  # _agreement.call_header: one slot per call (_agreement.CALLS), a lost round as (a, -a)
CHECKS_LEN = 8  # _usage_checks.UsageChecks.flags
HYPER_LEN = 16  # _agreement.hyper_code: a 32-bit digest of the hyperparameters in 4-bit chunks, twice


@dataclass
class StepMessage:
    """One rank's part of the step's all-reduce, or (after ``reduced``) every rank's, summed or maxed."""

    nonfinite: Tensor | float  # > 0: some element of the gradient is inf/NaN
    norm: Tensor | float  # the gradient's norm to the power p (or its max for the inf-norm)
    call: Sequence[float]  # which optimizer call this rank is in, whether it lost a round
    checks: Sequence[float]  # the usage checks' flags
    hyper: Sequence[float]  # the hyperparameters' digest

    LENGTHS: ClassVar[dict[str, int]] = {"nonfinite": 1, "norm": 1, "call": CALL_LEN, "checks": CHECKS_LEN, "hyper": HYPER_LEN}
    NUMEL = sum(LENGTHS.values())  # elements of the all-reduce

    def pack(self, device: torch.device) -> Tensor:
        """1D fp32, ``NUMEL`` elements, in field order. Local."""
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            t = v.reshape(-1).float() if isinstance(v, Tensor) else torch.tensor(
                [float(v)] if f.name in ("nonfinite", "norm") else [float(x) for x in v], dtype=torch.float32)
            if t.numel() != self.LENGTHS[f.name]:
                raise AssertionError(f"step message field {f.name} has {t.numel()} numbers, its slot "
                                     f"{self.LENGTHS[f.name]}")
            parts.append(t.to(device))
        return torch.cat(parts)

    @classmethod
    def tag(cls, call: Sequence[float]) -> StepMessage:
        """A message that carries only a call header: each backward pass's round tag, which has the
        step's shape so that a rank in a backward pass meets a rank in a step."""
        return cls(0.0, 0.0, call, [0.0] * CHECKS_LEN, [0.0] * HYPER_LEN)

    @classmethod
    def reduced(cls, t: Tensor) -> StepMessage:
        """Read back the reduced tensor: every field as plain floats. Local (one device sync)."""
        values = t.tolist()
        out: dict[str, Any] = {}
        at = 0
        for name, n in cls.LENGTHS.items():
            out[name] = values[at] if name in ("nonfinite", "norm") else values[at:at + n]
            at += n
        return cls(**out)
