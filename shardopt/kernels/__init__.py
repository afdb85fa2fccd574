"""The update math: ``reference`` (plain PyTorch, the oracle) and ``fused`` (the same code compiled).

:func:`select` picks the implementation, once, for one sharded buffer: the environment variable
``SHARDOPT_KERNEL`` forces ``fused`` or ``reference``; otherwise (``auto``) the fused path is used
unless the compiled code differs from the reference in a codec that buffer's step runs (see
:mod:`shardopt.kernels._self_check`), and the reference is used instead, with a warning. Should
compilation itself fail when a kernel compiles (at its first call for a variant of its arguments,
see fused [Note: one compile per variant]), the object goes over to the reference then (see
fused [Note: compile failure]).
"""
from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Iterable

import torch

from shardopt.kernels import _self_check, reference
from shardopt.kernels.codecs import round_to_dtype
from shardopt.kernels.reference import adamw_update_, make_scalars

__all__ = ["adamw_update_", "make_scalars", "round_to_dtype", "reference", "select", "Kernels"]

STEP_NAMES = ("step_fp32", "step_remainder", "step_stochastic", "step_none", "moment8_scan",
              "grad_nonfinite", "grad_max", "grad_norm_power")


class Kernels:
    """The step functions and gradient statistics of one sharded buffer (one object per buffer, so
    per master mode, weight dtype, moments and device), chosen at construction: each name of
    :data:`STEP_NAMES` is an attribute holding a plain function, the fused one or the reference
    one, and ``name`` says which ("fused" or "reference").

    ``Kernels("fused", codecs, device)`` runs the self-check for ``codecs`` (the codecs the buffer's
    step runs, see _self_check.codecs_run; every codec when left out) on ``device`` and takes the
    reference, with one warning, when one of them differs (a RuntimeError under
    ``SHARDOPT_KERNEL=fused``). A compile failure when a fused function compiles moves the object
    to the reference then (see fused [Note: compile failure])."""

    if TYPE_CHECKING:  # set by _use: each with the signature of reference's function of that name
        step_fp32 = staticmethod(reference.step_fp32)
        step_remainder = staticmethod(reference.step_remainder)
        step_stochastic = staticmethod(reference.step_stochastic)
        step_none = staticmethod(reference.step_none)
        moment8_scan = staticmethod(reference.moment8_scan)
        grad_nonfinite = staticmethod(reference.grad_nonfinite)
        grad_max = staticmethod(reference.grad_max)
        grad_norm_power = staticmethod(reference.grad_norm_power)

    def __init__(self, name: str, codecs: Iterable[str] = _self_check.NAMES,
                 device: torch.device | str = "cpu") -> None:
        self.codecs = tuple(codecs)  # the checked codecs this buffer's step runs
        self.device = str(device)
        self._use("fused" if name == "fused" and self._codecs_compile_exactly() else "reference")

    def _use(self, name: str) -> None:
        """Bind every step function to implementation ``name``."""
        self.name = name
        if name == "fused":
            from shardopt.kernels import fused  # imports the compiler's machinery: only when used

            for step_name in STEP_NAMES:
                setattr(self, step_name, fused.with_fallback(step_name, self._compile_failed))
        else:
            for step_name in STEP_NAMES:
                setattr(self, step_name, getattr(reference, step_name))

    def _codecs_compile_exactly(self) -> bool:
        """Whether this device's compiled code computes every codec of ``self.codecs`` bit for bit
        as eager does (see _self_check [Note: self-check]); if not, warns once (raises with
        SHARDOPT_KERNEL=fused). A compile failure here is handled as one when a kernel compiles."""
        try:
            bad = _self_check.failing(self.codecs, self.device)
        except Exception as e:  # noqa: BLE001 - any compiler failure means: use the reference
            self._compile_failed(e)
            return False
        if bad is None:
            return True
        message = (f"shardopt: torch {torch.__version__}'s compiler does not compute the {bad} codec bit for bit "
                   f"as written on {self.device}, so the fused update could lose precision silently; these "
                   "parameters use the reference kernel (slower, exact). torch 2.13 compiles every codec exactly "
                   "(see the README's install section); SHARDOPT_KERNEL=reference skips the check")
        if os.environ.get("SHARDOPT_KERNEL", "auto") == "fused":
            raise RuntimeError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)
        return False

    def _compile_failed(self, error: Exception) -> None:
        """torch.compile raised ``error`` before the compiled code ran: re-raise it with
        SHARDOPT_KERNEL=fused, else warn once and use the reference from now on."""
        if os.environ.get("SHARDOPT_KERNEL", "auto") == "fused":
            raise error
        warnings.warn(f"shardopt: torch.compile of the fused update failed ({_why(error)}) before it ran, so "
                      "nothing was written; these parameters use the reference kernel from now on (set "
                      "SHARDOPT_KERNEL=reference to skip compiling)", RuntimeWarning, stacklevel=4)
        self._use("reference")


def _why(error: Exception) -> str:
    """``error``'s type and message, and the first line of its cause where it has one (dynamo's
    ``FailOnRecompileLimitHit`` says only "Hard failure due to fullgraph=True"; its cause names the limit)."""
    why = f"{type(error).__name__}: {error}"
    cause = error.__cause__
    first = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
    if first and first not in why:
        why += f"; {first}"
    return why


def select(choice: str | None = None, *, dtype: torch.dtype | None = None, master: str | None = None,
           moments: str | None = None, device: torch.device | str = "cpu", rule: str = "adamw") -> Kernels:
    """The kernels of one sharded buffer. ``choice`` or ``$SHARDOPT_KERNEL``: "fused", "reference"
    or "auto" (fused, unless the self-check or compiling fails). ``dtype`` (its weights'),
    ``master`` (its master-weight mode) and ``moments`` (its moments format) name the codecs its
    step runs, which the self-check covers on ``device``; one left out stands for every value
    (a wider check). ``rule="muon"``: the buffer takes no AdamW step (Muon's update is eager), only
    the gradient statistics, which run no codec."""
    choice = choice or os.environ.get("SHARDOPT_KERNEL", "auto")
    if choice not in ("auto", "fused", "reference"):
        raise ValueError(f"SHARDOPT_KERNEL must be 'auto', 'fused' or 'reference', got {choice!r}")
    if choice == "auto" and not hasattr(torch, "compile"):
        choice = "reference"
    codecs = () if rule == "muon" else _self_check.codecs_run(master, dtype, moments)
    return Kernels("reference" if choice == "reference" else "fused", codecs, device)
