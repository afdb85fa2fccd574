"""Steps skipped for inf/NaN gradients: whether a skip can fix itself, and what every rank says
when it cannot.

[Note: skips that cannot fix themselves]
With fp16 dynamic loss scaling a skipped step lowers the scale and the next step usually goes
through. Without it (bf16 or fp32 parameters, a static scale) the same gradients come back: a NaN
born inside the graph (the derivative of ``sqrt(0)``, ``log(0)``, ``0/0``) skips every step while
the loss still looks finite, and the weights never move. So at the first skip of a run of such
skips every rank warns, naming the parameters whose gradients were not finite, and after
``max_consecutive_skips`` skips in a row every rank raises with the same names. The names are
those of the whole model: each rank names the parameters whose part of its gradient shard is not
finite, and the names are gathered over the data-parallel group and then over each model axis
(comm._model_parts ``ModelParts.gather_names``), so a rank of another tensor-parallel shard,
pipeline stage or expert group names them too, each marked with the part that holds it
(``"pp0/"``, ``"tp1/"``). A few small gathers, issued only on those skipped steps; every rank
issues them, since whether a step is skipped is decided from reduced values.
"""
from __future__ import annotations

import warnings
from typing import Callable

from shardopt.step._loss_scale import LossScaler

_SHOWN = 8  # parameter names a message lists before "and N more"


class SkipWatch:
    """Counts steps skipped in a row; warns and raises on every rank alike (see the Note)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit  # skips in a row that raise; None: never raise
        self.in_row = 0  # steps skipped since the last step taken

    def taken(self) -> None:
        self.in_row = 0

    def skipped(self, attempt: int, scaler: LossScaler, nonfinite: Callable[[], list[str]]) -> None:
        """Step call ``attempt`` was skipped. ``nonfinite()``: the names of the parameters whose
        averaged gradient has an inf/NaN on some rank of the model (collectives over every rank of
        the job). Every rank."""
        self.in_row += 1
        if scaler.recovers:  # a lower scale can fix it (the dynamic scaler warns at its minimum)
            return
        over = self.limit is not None and self.in_row >= self.limit
        if self.in_row != 1 and not over:
            return
        names = nonfinite()
        shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
        where = (f"the gradients of {shown} are not finite" if names else
                 "the gradient norm is not finite (finite gradients whose squares overflow fp32)")
        why = (f"step {attempt} was skipped ({self.in_row} in a row) because {where} on some rank, and with no dynamic "
               f"loss scale to lower ({type(scaler).__name__}) the next step will see the same: a NaN made inside the "
               "graph (the derivative of sqrt(0) or log(0), 0/0) skips every step while the loss looks finite")
        if over:
            raise RuntimeError(f"{why}. Stopped after {self.in_row} skipped steps in a row (max_consecutive_skips="
                               f"{self.limit}); find where those gradients become inf/NaN (e.g. "
                               "torch.autograd.set_detect_anomaly(True)), or pass max_consecutive_skips=None to keep "
                               "skipping")
        warnings.warn(f"shardopt: {why}; after {self.limit} skips in a row step() raises" if self.limit else
                      f"shardopt: {why}", RuntimeWarning, stacklevel=4)
