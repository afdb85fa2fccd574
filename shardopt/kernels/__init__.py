"""The update math: ``reference`` (plain PyTorch, the oracle) and ``fused`` (the same code compiled).

:func:`select` picks the implementation: the environment variable ``SHARDOPT_KERNEL`` forces
``fused`` or ``reference``; otherwise (``auto``) the fused path is used and, should compilation
fail or the compiled code differ from the reference in a codec a call runs (see
:mod:`shardopt.kernels._self_check`), the reference with a warning.
"""
from __future__ import annotations

import os
import types
import warnings

import torch

from shardopt.kernels import reference
from shardopt.kernels.codecs import round_to_dtype
from shardopt.kernels.reference import adamw_update_, make_scalars

__all__ = ["adamw_update_", "make_scalars", "round_to_dtype", "reference", "select", "Kernels"]

STEP_NAMES = ("step_fp32", "step_remainder", "step_stochastic", "step_none", "moment8_scan",
              "grad_nonfinite", "grad_max", "grad_norm_power")


class Kernels:
    """The step functions and gradient statistics of one implementation (one object per sharded
    buffer, so per master mode, weight dtype and moments); a fused one falls back to the reference
    (with one warning) the first time compilation fails or a call needs a codec this torch's
    compiler gets wrong."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._impl: types.ModuleType = reference
        if name == "fused":
            from shardopt.kernels import fused

            self._impl = fused

    def __getattr__(self, step_name: str):  # noqa: ANN204 - first use of a step function; cached below
        if step_name not in STEP_NAMES:
            raise AttributeError(step_name)
        if self._impl is reference:
            fn = getattr(reference, step_name)
        else:
            fused_fn, reference_fn = getattr(self._impl, step_name), getattr(reference, step_name)
            checked = []  # the first call passed the self-check: one buffer's calls run the same codecs

            def fn(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
                if self._impl is reference:  # an earlier compile failed, or the self-check
                    return reference_fn(*args, **kwargs)
                try:
                    if not checked:
                        if self._self_check_failed(reference_fn, args, kwargs):
                            return reference_fn(*args, **kwargs)
                        checked.append(True)
                    return fused_fn(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - any compiler failure means: use the reference
                    if os.environ.get("SHARDOPT_KERNEL", "auto") == "fused":
                        raise
                    warnings.warn(f"shardopt: torch.compile of the fused update failed ({type(e).__name__}: {e}); "
                                  "using the reference kernel (set SHARDOPT_KERNEL=reference to skip compiling)",
                                  RuntimeWarning, stacklevel=2)
                    self._impl, self.name = reference, "reference"
                    return reference_fn(*args, **kwargs)

        self.__dict__[step_name] = fn  # later lookups find it without building a wrapper per call
        return fn

    def _self_check_failed(self, reference_fn: types.FunctionType, args: tuple, kwargs: dict) -> bool:
        """Whether this fused call runs a codec that this device's compiled code does not compute
        bit for bit as eager does (see _self_check [Note: self-check]); if so, this object uses the
        reference from now on, with one warning (an error with SHARDOPT_KERNEL=fused)."""
        from shardopt.kernels import _self_check

        used = _self_check.codecs_used(reference_fn, args, kwargs)
        if not used:
            return False
        device = next((str(a.device) for a in args if isinstance(a, torch.Tensor)), "cpu")
        bad = next((name for name in _self_check.differences(device) if name in used), None)
        if bad is None:
            return False
        message = (f"shardopt: torch {torch.__version__}'s compiler does not compute the {bad} codec bit for bit "
                   f"as written on {device}, so the fused update could lose precision silently; these "
                   "parameters use the reference kernel (slower, exact). torch 2.13 compiles every codec exactly "
                   "(see the README's install section); SHARDOPT_KERNEL=reference skips the check")
        if os.environ.get("SHARDOPT_KERNEL", "auto") == "fused":
            raise RuntimeError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        self._impl, self.name = reference, "reference"
        return True


def select(choice: str | None = None) -> Kernels:
    """``choice`` or ``$SHARDOPT_KERNEL``: "fused", "reference" or "auto" (fused with fallback)."""
    choice = choice or os.environ.get("SHARDOPT_KERNEL", "auto")
    if choice not in ("auto", "fused", "reference"):
        raise ValueError(f"SHARDOPT_KERNEL must be 'auto', 'fused' or 'reference', got {choice!r}")
    if choice == "auto" and not hasattr(torch, "compile"):
        choice = "reference"
    return Kernels("reference" if choice == "reference" else "fused")
