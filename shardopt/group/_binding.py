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

[Note: writes into DTensor parameters]
A DTensor parameter is watched through the model's parameter, never through its stand-in (see
core._dtensor), which no outside write reaches. Its values live in its local tensor, a view of the
flat buffer; two version counters see the writes. ``p.copy_``, ``nn.init.*_`` and
``model.load_state_dict`` write the DTensor, which moves the DTensor's own counter only (DTensor
runs the write on the local tensor below autograd, where no counter moves); a write through
``p.to_local()`` moves the local tensor's counter only. So a DTensor parameter's version is the
sum of the two, and the storage it is bound to is its local tensor's. Only a swap gives it another
local tensor: ``model.to(...)``, ``.cpu()``, ``.half()`` swap every DTensor parameter (torch's
``Module._apply`` swaps tensor subclasses rather than set ``.data``), as ``torch.utils.swap_tensors``
does; ``p.data = t`` on a DTensor parameter changes nothing, in torch too. A swap also takes away
the gradient hooks and the gradient accumulator the optimizer holds for the parameter, so it cannot
be followed as a plain parameter's new storage is (``rebind``): a DTensor parameter whose gradient
accumulator is no longer the one the optimizer holds (``ParamRecord.accumulator``) was swapped, and
is reported, even where its new local tensor is the same storage.
"""
from __future__ import annotations

import operator
import warnings
from itertools import repeat
from typing import Sequence, cast

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from shardopt.core._compat import version
from shardopt.core._dtensor import local_of
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
        # (position, record) of each DTensor parameter: watched through the model's DTensor (see
        # [Note: writes into DTensor parameters])
        self.dtensors = [(i, r) for i, r in enumerate(self.records) if r.dtensor is not None]
        for r, held in zip(self.records, self._held()):
            r.bound(held.data_ptr())  # its view of the flat buffer
        self.record()

    def _held(self) -> list[Tensor]:
        """Per record, the tensor that holds the model's values: the parameter, or a DTensor
        parameter's local tensor. A question."""
        held = column(self.records, "param")
        for i, r in self.dtensors:
            held[i] = local_of(cast(Tensor, r.dtensor))
        return held

    def _swapped(self) -> list[ParamRecord]:
        """The DTensor parameters swapped for another tensor since the optimizer hooked them: their
        gradient accumulator is another than the one the optimizer holds. A question."""
        return [r for _, r in self.dtensors if r.accumulator is not None and r.leaf.requires_grad and
                get_gradient_edge(r.leaf).node is not r.accumulator]

    def _versions(self, held: Sequence[Tensor]) -> list[int]:
        """Per record, its parameter's version (``held``: ``_held()``): a DTensor parameter's is its
        own counter plus its local tensor's. A question."""
        versions = list(map(version, held))
        for i, r in self.dtensors:
            versions[i] += version(cast(Tensor, r.dtensor))
        return versions

    def record(self) -> None:
        """Take the parameters' current values as seen (after the optimizer took them). Local."""
        for r, v in zip(self.records, self._versions(self._held())):
            r.seen(v)

    def raced(self, records: Sequence[ParamRecord]) -> list[ParamRecord]:
        """Those of ``records`` (some of this buffer's) written since ``record`` (see
        ``UsageChecks.note_gathered``): their versions only, as ``_versions`` reads them, so that
        each landing bucket costs its own parameters, not the whole buffer. A question. Local."""
        return [r for r in records if self._version_of(r) != r.version]

    @staticmethod
    def _version_of(r: ParamRecord) -> int:
        """``_versions`` of one record."""
        if r.dtensor is None:
            return version(r.param)
        return version(local_of(r.dtensor)) + version(r.dtensor)

    def _unchanged(self, held: Sequence[Tensor]) -> bool:
        # C passes (see core._records.column): this runs over every parameter at every step
        records = self.records
        return not any(column(records, "rebound")) and not self._swapped() and \
            self._versions(held) == column(records, "version") and \
            all(map(operator.is_, column(held, "dtype"), repeat(self.flat.dtype))) and \
            list(map(Tensor.data_ptr, held)) == column(records, "ptr")

    def changes(self) -> tuple[list[ParamRecord], list[ParamRecord], list[str]]:
        """(parameters whose values changed from outside since ``record``, parameters given new
        storage of the same shape, dtype and device, which ``rebind`` follows; a message for each
        parameter that can no longer be followed). A question. Local; no communication."""
        written: list[ParamRecord] = []
        rebind: list[ParamRecord] = []
        problems: list[str] = []
        held = self._held()
        if self._unchanged(held):
            return written, rebind, problems  # the usual step: nothing changed
        flat = self.flat
        swapped = set(map(id, self._swapped()))
        for r, p, v in zip(self.records, held, self._versions(held)):
            was = f"{r.span.shape} {flat.dtype} on {flat.device}"
            now = f"{tuple(p.shape)} {p.dtype} on {p.device}"
            if id(r) in swapped:
                problems.append(
                    f"DTensor parameter {r.name} was swapped for another tensor after ShardedAdamW was built "
                    "(model.to(...), .cpu(), .half() or .float() swap every DTensor parameter, as torch does for "
                    "tensor subclasses; or torch.utils.swap_tensors): its local tensor is now "
                    f"{'the same storage' if p.data_ptr() == r.ptr else 'new storage'} ({now}; the optimizer's "
                    f"flat buffer holds {was}) and the swap took away the optimizer's gradient hooks on it, so "
                    "the optimizer can no longer follow it. Move or convert the model first, then build "
                    "ShardedAdamW (to continue a run, save_checkpoint before and load_checkpoint after)")
                continue
            if p.data_ptr() == r.ptr and p.dtype == flat.dtype:
                if v != r.version or r.rebound:
                    written.append(r)
                continue
            if tuple(p.shape) == r.span.shape and p.dtype == flat.dtype and p.device == flat.device:
                rebind.append(r)
                continue
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
