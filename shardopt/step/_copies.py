"""Whether the parameters the model axes hold as copies are copies: checked once, at the first step taken.

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
counted once per rank of the axis (the norm too large); a copy whose gradient differs across the
axis (a LayerNorm applied to each rank's part of the sequence, its gradient that rank's share)
is stepped with a different gradient on each rank, and its copies drift apart.

So at the first ``step()`` that is taken (a step skipped for inf/NaN gradients proves nothing:
identical non-finite gradients would look like copies), every rank fingerprints each parameter it
trains, in param-group order: integer sums of the bits of its weights (their sum, and a weighted
sum of their low 16 bits), and of this rank's part of its averaged gradient (the sum of its bits,
how many are not zero), summed over the data-parallel group. Integer sums are exact in any order,
so equal tensors give equal fingerprints however they were cut into shards, and different ones
different fingerprints but by a chance of about 2**-40. A copy's averaged gradient also gets a
*profile* (``grad_profile``): in float64, its sum of squares and three sums of its elements with
signs (+1 or -1) that follow each element's index in the parameter, summed over the group, so
alike however it is cut into shards. Over each model axis, in turn, one all-reduce of how many
copies and how many candidate parts each rank holds, then, where those counts agree across the
axis (as on tensor-parallel ranks; pipeline stages hold different parameters and are not
compared), one all-reduce (max of ``[x, -x]``: the maximum and the minimum) of their fingerprints,
and one of the copies' profiles:

* a copy whose weights differ across the axis is an error;
* a copy whose weights are the same but whose averaged gradient differs across the axis is an
  error: a part that starts equal (a zero-initialised column-parallel bias put in the
  ``"replicated"`` group), or a copy whose gradient the model leaves as each rank's share (a plain
  LayerNorm in a sequence-parallel region, or a Replicate DTensor read through ``to_local()``
  there). Its gradients differ when the largest difference across the axis of the square root of
  the sum of squares, or of any signed sum, exceeds a tolerance times the largest gradient norm:
  2**-10 for 32-bit gradients, 2**-4 for 16-bit ones (``_TOLERANCE``). That is far above what a
  reduction that rounds in another order leaves: the ranks of an axis reduce over different
  data-parallel groups, whose flat buffers may be laid out differently (an uneven Shard split),
  so a collective that sums in an order of its own (NCCL's ring) may round a copy's gradient
  differently on each; gloo's rank-order sums are bit for bit alike. And far below what a
  different gradient leaves: each signed sum of two gradients that differ by about their own size
  differs by about that size, so they pass all three by a chance of about the tolerance cubed
  (less surely for a parameter of a few elements, whose signs repeat);
* a plain parameter left a part on an axis of ``model_parallel_group`` whose weights are the same
  on every rank of the axis and whose averaged gradient is the same and not zero is an error
  (a part that starts equal, as a zero-initialised bias split over tensor-parallel ranks, gets
  different gradients; a param group marked ``"replicated": False`` says its parameters are parts
  and is not compared).

A Replicate DTensor whose gradient autograd gives as a Partial one is summed over its mesh before
the optimizer takes it (see core._dtensor [Note: a gradient in another placement]): its averaged
gradient is then alike across the axis, and compared as any copy's. Megatron-style copies (a
LayerNorm beside plain shards) get the same gradient on every rank of the axis from the model's
own all-reduce of the activations' gradients.

Then one all-reduce over every rank of the job says whether any rank found one, and every rank
raises a ValueError: the ranks that found it name the parameters and what to declare, the others
the first rank that did. Cost, at the first step taken only: one read of the weights and of the
gradient shard; small all-reduces, two over the data-parallel group (the gradients' parts and
profiles), three per axis and one over every rank of the job.

What is not caught: a copy that got no gradient at that step on any rank (its profile is zero
everywhere), a part whose weights and averaged gradient both happen to be alike at that step
(identical parts stay identical), a copy whose gradients differ by less than the tolerance,
pipeline stages that hold different numbers of such parameters, and anything that goes wrong after
the first step taken (weights are compared as built, before any update).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import Tensor

from shardopt.comm._collectives import Comm, global_rank
from shardopt.comm._model_parts import ModelParts

if TYPE_CHECKING:
    from shardopt.core._flat import ShardView
    from shardopt.core._layout import Range
    from shardopt.core._records import ParamRecord
    from shardopt.group._flat_group import FlatGroup

_CHUNK = 1 << 22  # elements fingerprinted at a time: bounds the int64 temporaries (32 MiB)
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> the integer its bits are read as
_WEIGHTS = 251  # the weighted sum's weights repeat with this period
# The signs of a profile's three signed sums: element i of the parameter gets -1 where
# (i * m) % 257 >= 128, else +1, one multiplier m each (see [Note: declared copies])
_SIGNS = (97, 131, 193)
# gradient element size -> how far a copy's averaged gradients may differ across an axis, relative
# to the largest gradient's norm (see [Note: declared copies])
_TOLERANCE = {2: 2.0**-4, 4: 2.0**-10, 8: 2.0**-10}


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


def grad_profile(g: Tensor, first: int) -> Tensor:
    """1-D float64 (4,) of ``g``, a piece of a gradient whose elements are elements ``first``,
    ``first + 1``, ... of the flattened parameter: the sum of its squares and three sums of its
    elements with signs by their index in the parameter (``_SIGNS``). Sums, so the profiles of a
    gradient's pieces add up to the whole's, whatever the cut. Local."""
    flat = g.detach().reshape(-1)
    out = torch.zeros(4, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        v = flat[start:start + _CHUNK].to(torch.float64)
        at = torch.arange(first + start, first + start + v.numel(), dtype=torch.int64, device=v.device)
        out[0] += (v * v).sum()
        for j, m in enumerate(_SIGNS):
            out[1 + j] += torch.where((at * m) % 257 >= 128, -v, v).sum()
    return out


class DeclaredCopies:
    """The first step's check of [Note: declared copies] for one optimizer: ``records``, its
    trained parameters in param-group order, ``buffers`` (indexed by ``ParamRecord.bucket.buffer``),
    ``param_groups``, ``parts`` (who holds what), ``comm`` (the data-parallel group)."""

    def __init__(self, records: Sequence[ParamRecord], buffers: Sequence[FlatGroup],
                 param_groups: Sequence[dict[str, Any]], parts: ModelParts, comm: Comm) -> None:
        self.records, self.buffers, self.param_groups = list(records), list(buffers), param_groups
        self.parts, self.comm = parts, comm
        self.checked = not parts.axes  # nothing to compare without model axes
        # the records that are copies across some axis: their averaged gradients are profiled
        self.copies = [bool(parts.replicated_over(r.param, param_groups[r.group])) for r in self.records]

    def check_once(self) -> None:
        """At the first ``step()``, after its agreement: raise ValueError on every rank of the job
        when a declaration is wrong (see [Note: declared copies]); later calls do nothing. Every
        rank of the job (every rank is in step(): the step's agreement said so)."""
        if self.checked:
            return
        self.checked = True
        marks, profiles = self._fingerprints()
        problems: list[str] = []
        for axis in self.parts.axes.axes:
            problems += self._compare(axis.name, axis.connected(), marks, profiles)
        flag = torch.tensor([1 if problems else 0, (1 << 40) - global_rank() if problems else 0], dtype=torch.int64)
        self.comm.control_all_reduce(flag, "max").wait()
        self.parts.axes.reduce(flag, "max")
        if problems:
            raise ValueError(" ".join(problems))
        if flag[0]:
            raise ValueError(f"rank {(1 << 40) - int(flag[1])} found parameters declared as copies across a model "
                             "axis that are not copies, or copies left undeclared (its error names them and what "
                             "to declare); this rank stops with it, before the first update")

    def _fingerprints(self) -> tuple[Tensor, Tensor]:
        """(int64 (n, 4), one row per record: its weights' (sum, weighted sum), its averaged
        gradient's (sum, count not zero) over the data-parallel group; float64 (n, 4): a copy's
        averaged gradient's ``grad_profile`` over the group, zeros for a part). Every rank of the
        group."""
        rows, shaped = [], []
        grads = [buf.local_grad() for buf in self.buffers]  # this rank's shard of each buffer's gradient
        for r, copy in zip(self.records, self.copies):
            w = fingerprint(r.param, weighted=True)[:2]
            g = fingerprint(grads[r.bucket.buffer][r.local.as_slice()], weighted=False)[[0, 2]] \
                if r.local is not None else torch.zeros(2, dtype=torch.int64, device=w.device)
            rows.append(torch.cat([w, g]))
            shaped.append(self._profile(r, r.local, grads[r.bucket.buffer]) if copy and r.local is not None
                          else torch.zeros(4, dtype=torch.float64, device=w.device))
        marks = torch.stack(rows).cpu() if rows else torch.zeros((0, 4), dtype=torch.int64)  # one copy to the host
        profiles = torch.stack(shaped).cpu() if shaped else torch.zeros((0, 4), dtype=torch.float64)
        grad_part = marks[:, 2:].contiguous()  # this rank's part of each gradient: summed over the group
        self.comm.control_all_reduce(grad_part).wait()
        marks[:, 2:] = grad_part
        self.comm.control_all_reduce(profiles).wait()
        return marks, profiles

    def _profile(self, r: ParamRecord, local: Range, grad: Tensor | ShardView) -> Tensor:
        """``grad_profile`` of this rank's part ``local`` of record ``r``'s averaged gradient (in
        ``grad``, its buffer's shard), at its place in the parameter. Local."""
        buf = self.buffers[r.bucket.buffer]
        first = buf.flat.layout.to_global(buf.comm.shard_rank, local).start - r.span.global_range.start
        return grad_profile(grad[local.as_slice()], first)

    def _compare(self, axis: str, comm: Comm, marks: Tensor, profiles: Tensor) -> list[str]:
        """The problems found across model axis ``axis`` (its ``comm``), from every record's
        fingerprint ``marks`` and gradient ``profiles``; alike on every rank of the axis. Every rank
        of the axis."""
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
        held = [i for i, s in zip(compared[0][0], same_copies.tolist()) if s]  # copies with the same weights
        drift = [self.records[i] for i in self._gradients_differ(comm, held, profiles[held])]
        problems = []
        if differ:
            problems.append(self._differ_message(axis, differ))
        if drift:
            problems.append(self._drift_message(axis, drift))
        if alike:
            problems.append(self._alike_message(axis, alike))
        return problems

    def _gradients_differ(self, comm: Comm, copies: list[int], profiles: Tensor) -> list[int]:
        """Of the records ``copies`` (alike on every rank of the axis), those whose averaged
        gradients' ``profiles`` differ across the axis by more than ``_TOLERANCE`` (see [Note:
        declared copies]). Every rank of the axis (one all-reduce, also when ``copies`` is empty)."""
        if not copies:  # as many on every rank of the axis
            return []
        flat = profiles.reshape(-1)
        both = torch.cat([flat, -flat])
        comm.control_all_reduce(both, "max").wait()
        high, low = both[:flat.numel()].view(-1, 4), -both[flat.numel():].view(-1, 4)
        sizes = [buf.local_grad().element_size() for buf in self.buffers]  # each buffer's gradient's
        out = []
        for i, hi, lo in zip(copies, high.tolist(), low.tolist()):
            norm = math.sqrt(max(hi[0], 0.0))
            allowed = _TOLERANCE.get(sizes[self.records[i].bucket.buffer], _TOLERANCE[2]) * norm
            spread = [norm - math.sqrt(max(lo[0], 0.0))] + [h - v for h, v in zip(hi[1:], lo[1:])]
            if max(spread) > allowed:
                out.append(i)
        return out

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

    def _drift_message(self, axis: str, records: list[ParamRecord]) -> str:
        named = ", ".join(f"{r.name} ({self._why_copy(r, axis)})" for r in records)
        return (f"parameters declared copies across model axis {axis!r} hold the same weights but got different "
                f"averaged gradients on its ranks at the first step: {named}. Each rank would step its copy with "
                "its own gradient, and the clip norm counts one rank's: the copies drift apart. If each rank holds "
                "its own part (a column-parallel bias that starts at zero on every rank), declare it one: leave it "
                f'out of the "replicated" param group (or name the axes it is a copy across), and beside DTensor '
                "parameters make it a DTensor split over the mesh; if it is a copy whose gradient each rank holds a "
                "share of (a LayerNorm applied to each rank's part of the sequence), give the optimizer the whole "
                "gradient: make it a DTensor with a Replicate placement whose gradient is Partial (torch's "
                "SequenceParallel does; read a DTensor's local tensor there with to_local(grad_placements="
                f"[Partial()])), or all-reduce its gradient over {axis!r} in a hook registered with "
                "p.register_hook (it runs before the optimizer takes the gradient)")

    def _alike_message(self, axis: str, records: list[ParamRecord]) -> str:
        named = ", ".join(f"{r.name} (param group {r.group})" for r in records)
        return (f"plain parameters taken as parts of the model across model axis {axis!r} hold the same weights and "
                f"got the same averaged gradient on every rank of it at the first step: {named}. Each rank's part is "
                f"counted in the clip norm, so a copy is counted once per rank of {axis!r}. If they are copies (a "
                "LayerNorm or a bias beside Megatron-style shards), put them in a param group marked "
                f'"replicated": True (or "replicated": [{axis!r}], the axes they are copies across); if they are '
                "parts, give each rank its own values (identical parts get identical gradients and stay "
                'identical), or mark their param group "replicated": False to keep them as they are')
