"""Whether the parameters the model axes hold as copies are copies: checked once, at the first step.

[Note: declared copies]
Beside model axes (see comm._model_axes) every parameter is either a *copy* across an axis, the
same tensor on each of its ranks (counted once in the clip norm, by the axis's rank 0; beside
DTensors saved once, by the mesh's rank 0), or a *part*, different on each (counted, and saved,
by every rank). What it is comes from how the model was declared (``ModelParts.replicated_over``):
a Replicate placement, a plain parameter beside DTensor parameters, a param group marked
``"replicated"`` are copies; a Shard placement and the other plain parameters of
``model_parallel_group=`` are parts. A wrong declaration trains on without a word: a part marked
a copy is left out of the norm on every rank but the axis's first (the clip norm too small) and,
beside DTensors, saved from that rank alone (every rank loads its values); a copy left unmarked is
counted once per rank of the axis (the norm too large).

So at the first ``step()`` every rank fingerprints each parameter it trains, in param-group order:
integer sums of the bits of its weights (their sum, and a weighted sum of their low 16 bits),
and of this rank's part of its averaged gradient (the sum of its bits, how many are not zero),
summed over the data-parallel group. Integer sums are exact in any order, so equal tensors give
equal fingerprints however they were cut into shards, and different ones different fingerprints
but by a chance of about 2**-40. Over each model axis, in turn, one all-reduce of how many copies
and how many candidate parts each rank holds, then, where those counts agree across the axis (as
on tensor-parallel ranks; pipeline stages hold different parameters and are not compared),
one all-reduce (max of ``[x, -x]``: the maximum and the minimum) of their fingerprints:

* a copy whose weights differ across the axis is an error;
* a plain parameter left a part on an axis of ``model_parallel_group`` whose weights are the same
  on every rank of the axis and whose averaged gradient is the same and not zero is an error
  (a part that starts equal, as a zero-initialised bias split over tensor-parallel ranks, gets
  different gradients; a param group marked ``"replicated": False`` says its parameters are parts
  and is not compared).

Gradients are compared bit for bit, so a copy whose gradient a reduction rounds differently on
another rank of the axis is not seen (it trains as before); weights are compared as built, before
any update. Then one all-reduce over every rank of the job says whether any rank found one, and
every rank raises a ValueError: the ranks that found it name the parameters and what to declare,
the others the first rank that did. Cost, at the first step only: one read of the weights and of
the gradient shard; small all-reduces, one over the data-parallel group (the gradients' parts),
two per axis and one over every rank of the job.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import Tensor

from shardopt.comm._collectives import Comm, global_rank
from shardopt.comm._model_parts import ModelParts

if TYPE_CHECKING:
    from shardopt.core._records import ParamRecord
    from shardopt.step._usage_checks import CheckedBuffer

_CHUNK = 1 << 22  # elements fingerprinted at a time: bounds the int64 temporaries (32 MiB)
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> the integer its bits are read as
_WEIGHTS = 251  # the weighted sum's weights repeat with this period


def fingerprint(t: Tensor, weighted: bool) -> Tensor:
    """1-D int64 (3,) of tensor ``t``: the sum of its elements' bits as integers, the sum of
    their low 16 bits times ``(index % 251) + 1`` (``weighted``; else 0), and how many are not 0.
    Exact (no rounding), so equal tensors give equal fingerprints whatever their layout. Local."""
    flat = t.detach().reshape(-1)
    out = torch.zeros(3, dtype=torch.int64, device=flat.device)
    if not flat.numel():
        return out
    bits = _BITS.get(flat.element_size())
    if bits is None:
        raise AssertionError(f"no integer of {flat.element_size()} bytes to fingerprint a {flat.dtype} tensor by")
    for start in range(0, flat.numel(), _CHUNK):
        b = flat[start:start + _CHUNK].view(bits).to(torch.int64)
        out[0] += b.sum()
        if weighted:
            at = torch.arange(start, start + b.numel(), dtype=torch.int64, device=b.device) % _WEIGHTS + 1
            out[1] += ((b & 0xFFFF) * at).sum()
        out[2] += (b != 0).sum()
    return out


class DeclaredCopies:
    """The first step's check of [Note: declared copies] for one optimizer: ``records``, its
    trained parameters in param-group order, ``buffers`` (indexed by ``ParamRecord.bucket.buffer``),
    ``param_groups``, ``parts`` (who holds what), ``comm`` (the data-parallel group)."""

    def __init__(self, records: Sequence[ParamRecord], buffers: Sequence[CheckedBuffer],
                 param_groups: Sequence[dict[str, Any]], parts: ModelParts, comm: Comm) -> None:
        self.records, self.buffers, self.param_groups = list(records), list(buffers), param_groups
        self.parts, self.comm = parts, comm
        self.checked = not parts.axes  # nothing to compare without model axes

    def check_once(self) -> None:
        """At the first ``step()``, after its agreement: raise ValueError on every rank of the job
        when a declaration is wrong (see [Note: declared copies]); later calls do nothing. Every
        rank of the job (every rank is in step(): the step's agreement said so)."""
        if self.checked:
            return
        self.checked = True
        marks = self._fingerprints()
        problems: list[str] = []
        for axis in self.parts.axes.axes:
            problems += self._compare(axis.name, axis.connected(), marks)
        flag = torch.tensor([1 if problems else 0, (1 << 40) - global_rank() if problems else 0], dtype=torch.int64)
        self.comm.control_all_reduce(flag, "max").wait()
        self.parts.axes.reduce(flag, "max")
        if problems:
            raise ValueError(" ".join(problems))
        if flag[0]:
            raise ValueError(f"rank {(1 << 40) - int(flag[1])} found parameters declared as copies across a model "
                             "axis that are not copies, or copies left undeclared (its error names them and what "
                             "to declare); this rank stops with it, before the first update")

    def _fingerprints(self) -> Tensor:
        """int64 (n, 4), one row per record: its weights' (sum, weighted sum), its averaged
        gradient's (sum, count not zero) over the data-parallel group. Every rank of the group."""
        rows = []
        grads = [buf.reducer.local_grad() for buf in self.buffers]  # this rank's shard of each buffer's gradient
        for r in self.records:
            w = fingerprint(r.param, weighted=True)[:2]
            g = fingerprint(grads[r.bucket.buffer][r.local.as_slice()], weighted=False)[[0, 2]] \
                if r.local is not None else torch.zeros(2, dtype=torch.int64, device=w.device)
            rows.append(torch.cat([w, g]))
        marks = torch.stack(rows).cpu() if rows else torch.zeros((0, 4), dtype=torch.int64)  # one copy to the host
        grad_part = marks[:, 2:].contiguous()  # this rank's part of each gradient: summed over the group
        self.comm.control_all_reduce(grad_part).wait()
        marks[:, 2:] = grad_part
        return marks

    def _compare(self, axis: str, comm: Comm, marks: Tensor) -> list[str]:
        """The problems found across model axis ``axis`` (its ``comm``), from every record's
        fingerprint ``marks``; alike on every rank of the axis. Every rank of the axis."""
        copies, parts = [], []
        for i, r in enumerate(self.records):
            group = self.param_groups[r.group]
            if axis in self.parts.replicated_over(r.param, group):
                copies.append(i)
            elif axis in self.parts.user_axes and axis not in self.parts.dtensor_axes and r.dtensor is None \
                    and group.get("replicated") is not False:
                parts.append(i)
        counts = torch.tensor([len(copies), -len(copies), len(parts), -len(parts)], dtype=torch.int64)
        comm.control_all_reduce(counts, "max").wait()
        compared = [(copies, marks[copies, :2]) if counts[0] == -counts[1] else ([], marks[:0, :2]),
                    (parts, marks[parts]) if counts[2] == -counts[3] else ([], marks[:0])]
        flat = torch.cat([m.reshape(-1) for _, m in compared])
        both = torch.cat([flat, -flat])
        comm.control_all_reduce(both, "max").wait()
        same = both[:flat.numel()] == -both[flat.numel():]
        same_copies = same[:compared[0][1].numel()].view(-1, 2).all(dim=1)
        same_parts = same[compared[0][1].numel():].view(-1, 4).all(dim=1)
        differ = [self.records[i] for i, s in zip(compared[0][0], same_copies.tolist()) if not s]
        alike = [self.records[i] for i, s, m in zip(compared[1][0], same_parts.tolist(), compared[1][1].tolist())
                 if s and m[3] > 0]
        problems = []
        if differ:
            problems.append(self._differ_message(axis, differ))
        if alike:
            problems.append(self._alike_message(axis, alike))
        return problems

    def _why_copy(self, r: ParamRecord, axis: str) -> str:
        if r.dtensor is not None:
            return "a DTensor with a Replicate placement"
        if axis in self.parts.dtensor_axes:
            return "a plain parameter beside DTensor parameters on that mesh"
        return f'in param group {r.group}, marked "replicated"'

    def _differ_message(self, axis: str, records: list[ParamRecord]) -> str:
        named = ", ".join(f"{r.name} ({self._why_copy(r, axis)})" for r in records)
        return (f"parameters declared copies across model axis {axis!r} hold different weights on its ranks at the "
                f"first step: {named}. A copy is counted once in the clip norm (by the axis's rank 0) and, beside "
                "DTensor parameters, saved once: a part that differs per rank would be clipped with a wrong norm and "
                "load with rank 0's values everywhere. If each rank holds its own part, declare it one: leave it out "
                f'of the "replicated" param group (or name the axes it is a copy across: "replicated": [...] of '
                "model_parallel_group's axes), and beside DTensor parameters make it a DTensor split over the mesh "
                "(torch.nn.Parameter(DTensor.from_local(part, mesh, [Shard(0)])), its forward reading "
                ".to_local()); if it is meant to be a copy, give it the same values on every rank of "
                f"{axis!r} before building the optimizer (the same seed, or a broadcast from the axis's rank 0)")

    def _alike_message(self, axis: str, records: list[ParamRecord]) -> str:
        named = ", ".join(f"{r.name} (param group {r.group})" for r in records)
        return (f"plain parameters taken as parts of the model across model axis {axis!r} hold the same weights and "
                f"got the same averaged gradient on every rank of it at the first step: {named}. Each rank's part is "
                f"counted in the clip norm, so a copy is counted once per rank of {axis!r}. If they are copies (a "
                "LayerNorm or a bias beside Megatron-style shards), put them in a param group marked "
                f'"replicated": True (or "replicated": [{axis!r}], the axes they are copies across); if they are '
                "parts, give each rank its own values (identical parts get identical gradients and stay "
                'identical), or mark their param group "replicated": False to keep them as they are')
