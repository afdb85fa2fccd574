"""Loss scaling for 16-bit gradients: none, static, or dynamic, each with a ``state_dict``.

The optimizer multiplies the loss by ``scale`` in ``backward`` and divides it back out inside
the update, so the gradients are never rescaled in a separate pass. ``update`` is told once per
step, identically on every rank, whether any gradient anywhere was inf/NaN.
"""
from __future__ import annotations

import warnings

import torch


class LossScaler:
    """No scaling: ``scale`` is 1 and never changes."""

    kind = "none"
    recovers = False  # whether update(True, ...) can make the next step's gradients finite

    def __init__(self) -> None:
        self.scale = 1.0

    def update(self, found_inf: bool, step: int) -> None:
        """Record the outcome of the ``step``-th call of ``step()`` (skipped ones counted); all ranks
        agree on ``found_inf``."""

    def state_dict(self) -> dict:
        return {"kind": self.kind, "scale": self.scale}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind") != self.kind:
            warnings.warn(f"loss scaler state of kind {sd.get('kind')!r} loaded into a {self.kind!r} scaler; "
                          "only the scale is restored", stacklevel=2)
        self.scale = float(sd["scale"])


class StaticScaler(LossScaler):
    """A constant scale; overflowing steps are still skipped."""

    kind = "static"

    def __init__(self, scale: float) -> None:
        if not (scale > 0 and scale != float("inf")):
            raise ValueError(f"a static loss scale must be a positive finite number, got {scale=}")
        self.scale = float(scale)


class DynamicScaler(LossScaler):
    """Halve on overflow (after ``hysteresis`` overflows in a row), double after ``growth_interval``
    clean steps, never below ``min_scale``. At the minimum it warns once and keeps skipping
    non-finite steps, so training resumes as soon as the gradients become finite again."""

    kind = "dynamic"
    recovers = True

    def __init__(self, init_scale: float = 2.0**16, *, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, hysteresis: int = 1, min_scale: float = 1.0,
                 max_scale: float = 2.0**24) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale=}")
        if not (growth_factor > 1 and 0 < backoff_factor < 1):
            raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor=} {backoff_factor=}")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"need growth_interval >= 1 and hysteresis >= 1, got {growth_interval=} {hysteresis=}")
        if not 0 < min_scale <= max_scale:
            raise ValueError(f"need 0 < min_scale <= max_scale, got {min_scale=} {max_scale=}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.min_scale, self.max_scale = min_scale, max_scale
        self._clean_steps = 0
        self._hysteresis_left = hysteresis
        self._warned_min = False

    def update(self, found_inf: bool, step: int) -> None:
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left > 0:
                return
            self._hysteresis_left = self.hysteresis
            if self.scale <= self.min_scale:
                if not self._warned_min:
                    warnings.warn(f"shardopt: loss scale is at its minimum {self.min_scale:g} and gradients are still "
                                  f"inf/NaN at step {step}; steps keep being skipped until they are finite. Check the "
                                  "model and the data (or lower min_scale).", RuntimeWarning, stacklevel=3)
                    self._warned_min = True
                return
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._hysteresis_left = self.hysteresis
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self._clean_steps = 0
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self._warned_min = False

    def state_dict(self) -> dict:
        return {"kind": self.kind, "scale": self.scale, "clean_steps": self._clean_steps,
                "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self._clean_steps = int(sd.get("clean_steps", 0))
        self._hysteresis_left = int(sd.get("hysteresis_left", self.hysteresis))


def make_scaler(loss_scale: object, param_dtypes: set[torch.dtype]) -> LossScaler:
    """Build the scaler for the ``loss_scale`` argument of ``ShardedAdamW``."""
    if isinstance(loss_scale, LossScaler):
        return loss_scale
    if loss_scale is None:
        return LossScaler()
    if loss_scale == "auto":
        return DynamicScaler() if torch.float16 in param_dtypes else LossScaler()
    if loss_scale == "dynamic":
        return DynamicScaler()
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        return StaticScaler(float(loss_scale))
    raise ValueError(f"loss_scale must be 'auto', 'dynamic', a positive number, None or a LossScaler; "
                     f"got {loss_scale!r}")
