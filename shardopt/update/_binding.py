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

import warnings
from typing import Sequence

import torch

from shardopt.core._compat import version
from shardopt.core._flat import FlatParams


def warn_layout_change(names: Sequence[str], when: str) -> None:
    """Warn that the parameters ``names`` (non-contiguous: channels_last, transposed) are made
    contiguous views of a flat buffer. Local; each rank warns for its own parameters."""
    if names:
        warnings.warn(
            f"ShardedAdamW lays each parameter out contiguously in its flat buffer, so these parameters, which had "
            f"another memory format (e.g. channels_last) {when}, are now contiguous: {', '.join(names)}. The values "
            "and the training are unchanged, but kernels that prefer that format (channels_last convolutions on GPUs) "
            "convert the weight on every call; convert the activations, not the weights, to channels_last",
            UserWarning, stacklevel=5)


class ParamBinding:
    """Watches the parameters of one :class:`FlatParams` buffer."""

    def __init__(self, flat: FlatParams, names: Sequence[str]) -> None:
        self.flat = flat
        self.names = list(names)  # how error messages name each parameter, in buffer order
        self._ptr = [p.data_ptr() for p in flat.params]
        self._version = [version(p) for p in flat.params]
        self._rebound: set[int] = set()  # re-bound since record: written, though their versions did not move

    def record(self) -> None:
        """Take the parameters' current values as seen (after the optimizer took them). Local."""
        self._version = [version(p) for p in self.flat.params]
        self._rebound = set()

    def raced(self, indices: Sequence[int]) -> list[int]:
        """Those of ``indices`` written since ``record`` (see ``UsageChecks.note_gathered``). Local."""
        return [i for i in indices if version(self.flat.params[i]) != self._version[i]]

    def check(self) -> tuple[list[int], list[str]]:
        """Re-bind parameters given new storage of the same kind; return the indices of parameters
        whose values changed from outside since ``record`` and a message for each parameter that
        can no longer be followed. Local; no communication."""
        written: list[int] = []
        problems: list[str] = []
        flat = self.flat
        dtype = flat.dtype
        if (not self._rebound and [p.data_ptr() for p in flat.params] == self._ptr
                and [version(p) for p in flat.params] == self._version and all(p.dtype is dtype for p in flat.params)):
            return written, problems  # the usual step: nothing changed
        relaid = []
        for i, p in enumerate(flat.params):
            if p.data_ptr() == self._ptr[i] and p.dtype == flat.dtype:
                if version(p) != self._version[i] or i in self._rebound:
                    written.append(i)
                continue
            span = flat.layout.params[i]
            if tuple(p.shape) == span.shape and p.dtype == flat.dtype and p.device == flat.device:
                view = flat.param_view(flat.data, i)
                with torch.no_grad():
                    view.copy_(p.detach())
                if not p.is_contiguous():
                    relaid.append(self.names[i])
                p.data = view
                self._rebound.add(i)
                written.append(i)
                continue
            was = f"{span.shape} {flat.dtype} on {flat.device}"
            now = f"{tuple(p.shape)} {p.dtype} on {p.device}"
            problems.append(
                f"parameter {self.names[i]} is now {now} but was {was} when ShardedAdamW was built: model.to(dtype), "
                ".half(), .float(), .to(device) or p.data = t after building the optimizer gave it new storage that "
                "the optimizer's flat buffers, master weights and moments cannot follow. Convert or move the model "
                "first, then build ShardedAdamW (to continue a run, save_checkpoint before and load_checkpoint after)")
        warn_layout_change(relaid, "after a model.to(memory_format=...) or p.data = t")
        return written, problems
