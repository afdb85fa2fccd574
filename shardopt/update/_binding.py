"""Keeping the model's parameters bound to the flat buffers, and noticing writes from outside.

[Note: parameters changed behind the optimizer's back]
After construction every trainable parameter's ``.data`` is a view of its flat buffer and the
master weights are the authority on its value. Ordinary PyTorch code can break either:

* ``p.data = t``, ``model.to(...)``, ``.half()`` / ``.float()`` give ``p`` new storage, so the
  all-gather after an update no longer reaches the model. Same shape, dtype and device: the new
  values are copied into the flat buffer and ``p`` is made a view again (``model.to("cpu:0")``
  on a CPU model just works). Another dtype, device or shape cannot be followed (the buffers,
  the master and the moments were laid out for the old one): every rank raises at the next
  ``clip_grad_norm_`` or ``step``, naming the parameter.
* ``model.load_state_dict``, ``nn.init.*_``, ``with torch.no_grad(): p.copy_(t)`` write the
  values in place. Each such write bumps the parameter's version counter (a parameter has its
  own, not shared with the flat buffer it views, so the optimizer's own writes through the
  buffer do not count). At the next ``clip_grad_norm_`` or ``step`` the written parameters are
  taken as new master weights on every rank: rank 0's values are broadcast (as at construction)
  and each master-weight strategy refreshes its copy (``MasterWeights.refresh_``).
  Writes through ``p.data`` bypass the version counter; after those call
  ``opt.refresh_master_weights()``.
"""
from __future__ import annotations

import operator
import warnings
from itertools import repeat
from typing import Sequence

import torch
from torch import Tensor

from shardopt.core._compat import version
from shardopt.core._flat import FlatParams
from shardopt.core._records import ParamRecord, column


def warn_layout_change(names: Sequence[str], when: str) -> None:
    """Warn that the parameters ``names`` (non-contiguous: channels_last, transposed) are made
    contiguous views of a flat buffer. Local; each rank warns for its own parameters."""
    if names:
        warnings.warn(
            f"shardopt lays each parameter out contiguously in its flat buffer, so these parameters, which had "
            f"another memory format (e.g. channels_last) {when}, are now contiguous: {', '.join(names)}. The values "
            "and the training are unchanged, but kernels that prefer that format (channels_last convolutions on GPUs) "
            "convert the weight on every call; convert the activations, not the weights, to channels_last",
            UserWarning, stacklevel=5)


class ParamBinding:
    """Watches the parameters of one :class:`FlatParams` buffer through their records."""

    def __init__(self, flat: FlatParams, records: Sequence[ParamRecord]) -> None:
        self.flat, self.records = flat, list(records)
        for r in self.records:
            r.bound(r.param.data_ptr())  # its view of the flat buffer
        self.record()

    def record(self) -> None:
        """Take the parameters' current values as seen (after the optimizer took them). Local."""
        for r in self.records:
            r.seen(version(r.param))

    def raced(self, records: Sequence[ParamRecord]) -> list[ParamRecord]:
        """Those of ``records`` written since ``record`` (see ``UsageChecks.note_gathered``). A question. Local."""
        return [r for r in records if version(r.param) != r.version]

    def _unchanged(self) -> bool:
        # C passes (see core._records.column): this runs over every parameter at every step
        records, params = self.records, column(self.records, "param")
        return not any(column(records, "rebound")) and list(map(version, params)) == column(records, "version") and \
            all(map(operator.is_, column(params, "dtype"), repeat(self.flat.dtype))) and \
            list(map(Tensor.data_ptr, params)) == column(records, "ptr")

    def changes(self) -> tuple[list[ParamRecord], list[ParamRecord], list[str]]:
        """(parameters whose values changed from outside since ``record``, parameters given new
        storage of the same shape, dtype and device, which ``rebind`` follows; a message for each
        parameter that can no longer be followed). A question. Local; no communication."""
        written: list[ParamRecord] = []
        rebind: list[ParamRecord] = []
        problems: list[str] = []
        if self._unchanged():
            return written, rebind, problems  # the usual step: nothing changed
        flat = self.flat
        for r in self.records:
            p = r.param
            if p.data_ptr() == r.ptr and p.dtype == flat.dtype:
                if version(p) != r.version or r.rebound:
                    written.append(r)
                continue
            if tuple(p.shape) == r.span.shape and p.dtype == flat.dtype and p.device == flat.device:
                rebind.append(r)
                continue
            was = f"{r.span.shape} {flat.dtype} on {flat.device}"
            now = f"{tuple(p.shape)} {p.dtype} on {p.device}"
            problems.append(
                f"parameter {r.name} is now {now} but was {was} when the optimizer was built: model.to(dtype), "
                ".half(), .float(), .to(device) or p.data = t after building the optimizer gave it new storage that "
                "the optimizer's flat buffers, master weights and moments cannot follow. Convert or move the model "
                "first, then build the optimizer (to continue a run, save_checkpoint before and load_checkpoint after)")
        return written, rebind, problems

    def rebind(self, records: Sequence[ParamRecord]) -> None:
        """Copy the values of ``records`` (given new storage of their own kind) into the flat buffer
        and make each parameter a view of it again; each then counts as written. Local."""
        relaid = []
        for r in records:
            p, view = r.param, self.flat.param_view(self.flat.data, r.index)
            with torch.no_grad():
                view.copy_(p.detach())
            if not p.is_contiguous():
                relaid.append(r.name)
            p.data = view
            r.mark_rebound()
        warn_layout_change(relaid, "after a model.to(memory_format=...) or p.data = t")

    def follow(self) -> tuple[list[ParamRecord], list[str]]:
        """``changes()``, with the re-bindable parameters re-bound: (every parameter written from
        outside, problems). An action. Local."""
        written, rebind, problems = self.changes()
        self.rebind(rebind)
        return sorted(written + rebind, key=lambda r: r.index), problems
