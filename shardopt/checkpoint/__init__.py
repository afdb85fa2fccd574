"""Checkpoints of a model trained with ``ShardedAdamW``: every rank saves its own shard in parallel,
and a checkpoint loads at any world size, bucket size, stage or master-weight mode.

What a checkpoint holds (``PATH/``):

* ``__<rank>_0.distcp`` and ``.metadata``: the tensors, through ``torch.distributed.checkpoint``,
  one key per model state-dict entry and per optimizer tensor, by fully qualified name, with
  shape, dtype and chunk offsets (see ``checkpoint._dcp``);
* ``shardopt.json``: step, skipped steps, param-group hyperparameters, loss-scaler state,
  optimizer settings and the parameter table (name, shape, dtype, place in the flat buffer);
* ``extra.pt``: the caller's ``extra`` object, if any (e.g. the LR scheduler's state);
* ``complete.json``: written last; see [Note: a checkpoint is complete only when its marker says so].

[Note: what is stored for the master weights]
Master-weight strategies keep different things (an fp32 copy, a 16-bit remainder, nothing). A
checkpoint stores what they all decode to: the fp32 master (``MasterWeights.fp32()``), per
parameter, plus both fp32 moments. For fp32 parameters the master *is* the weight, so only the
``model.`` key is written. Loading hands each rank's new shard of the fp32 master to
``load_state_tensors`` of whatever strategy is configured now, which re-encodes it and writes the
model's weights. For ``remainder`` this is exact: weight and remainder are the fp32 master.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from shardopt.checkpoint._adamw import full_state_dict, load_full_state_dict, settle
from shardopt.checkpoint._blocks import (EXP_AVG, EXP_AVG_SQ, GROUP_PREFIX, MASTER, MAX_EXP_AVG_SQ, MODEL, MOMENTUM, Block,
                                         blocks_of, placed, whole)
from shardopt.checkpoint._files import (EXTRA, FORMAT, MANIFEST, agree, check_complete, check_replaceable,
                                        checkpoint_path, claim, commit, data_checksums, find_checkpoint, latest_checkpoint,
                                        list_checkpoints, read_extra, read_manifest, temp_path, verify_data,
                                        write_json)
from shardopt.checkpoint._hyper import TENSORS, jsonable, restore_group, tensor_kinds
from shardopt.checkpoint._resume import resume
from shardopt.comm._collectives import Comm, ProcessGroup, world_size
from shardopt.comm._messages import enter, entry_deadline
from shardopt.core._dtensor import is_dtensor, local_box, local_of, replicated
from shardopt.core._layout import Range, ShardPiece
from shardopt._version import __version__

if TYPE_CHECKING:
    from shardopt.checkpoint._sharded_optimizer import ShardedOptimizer
    from shardopt.core._records import ParamRecord
    from shardopt.group._flat_group import FlatGroup

__all__ = ["full_state_dict", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "load_full_state_dict",
           "save_checkpoint"]


@dataclass
class _Entry:
    """One model state-dict entry, and where ShardedAdamW keeps it if it shards it."""

    key: str
    tensor: Tensor  # the model's tensor, detached (a sharded parameter's is a view of the flat buffer); local
    where: tuple[FlatGroup, int] | None  # (FlatGroup, index in its layout) for a sharded parameter
    shape: tuple[int, ...] = ()  # the whole tensor's: a DTensor's global shape, else the tensor's
    offsets: tuple[int, ...] = ()  # where ``tensor`` starts in it (a DTensor's local piece)
    writes: bool = True  # this rank writes it: False for a copy another rank of a model axis writes

    def blocks(self, key: str, local_shape: tuple[int, ...], r: Range, piece: Tensor) -> list[Block]:
        """``blocks_of`` the flat range ``r`` of the local piece (of ``local_shape``), placed in the
        whole tensor of ``shape`` at ``offsets``."""
        return placed(blocks_of(key, local_shape, r, piece), self.shape, self.offsets)

    def whole(self, key: str) -> list[Block]:
        """The local piece, whole, as a block of the whole tensor."""
        return placed([whole(key, self.tensor)], self.shape, self.offsets)


def _part(opt: ShardedOptimizer | None) -> str:
    """The prefix of this rank's keys in a checkpoint it saves (``ModelParts.key_part``; "" for a
    weights-only load). Local."""
    return opt.internals.parts.key_part() if opt is not None else ""


def _saved_part(manifest: dict, opt: ShardedOptimizer | None) -> str:
    """The prefix of this rank's keys in the checkpoint of ``manifest``: ``_part``; in a checkpoint
    written before parts were named by their ranks, the prefix it gave this rank's part: by the
    axes' names as this optimizer names them (``ModelParts.named_part``, ``"pp1.tp0/"``), or on
    one axis of any name, the part at this rank's place (``"tp1/"`` at place 1). Local."""
    part, parts = _part(opt), manifest.get("parts") or {}
    if opt is None or not part or part in parts:
        return part
    if opt.internals.parts.named_part() in parts:
        return opt.internals.parts.named_part()
    one_axis = {m.group(1) if (m := re.fullmatch(r"([^./\d]+)\d+/", p)) else None for p in parts}
    if len(one_axis) == 1 and None not in one_axis and len(opt.internals.parts.layout()) == 1:
        return f"{one_axis.pop()}{opt.internals.parts.place}/"
    return part


def replicated_writer(opt: ShardedOptimizer | None) -> bool:
    """Whether this rank writes the copies every rank of a DTensor mesh holds (``ModelParts.writes_copies``)."""
    return opt is None or opt.internals.parts.writes_copies()


def _state_items(model: torch.nn.Module, opt: ShardedOptimizer | None, part: str) -> list[tuple[str, Any]]:
    """The model's state-dict entries, keyed with this rank's ``part`` prefix. Local."""
    own = opt.internals.parts.key_prefix if opt is not None else {}
    return [(part + own.get(id(t), "") + key, t) for key, t in model.state_dict(keep_vars=True).items()]


def _entries(model: torch.nn.Module, opt: ShardedOptimizer | None, part: str) -> tuple[list[_Entry], dict[str, str]]:
    """The model's state-dict entries (each tensor once, keyed under this rank's ``part``) and the
    aliases of tied ones. Local."""
    where = {id(r.leaf): (b, r.index) for b in (opt.internals.buffers if opt is not None else []) for r in b.records}
    entries, aliases = [], {}
    first: dict[int, str] = {}  # id(tensor) -> its first key
    for key, t in _state_items(model, opt, part):
        if not isinstance(t, Tensor):
            raise TypeError(f"model state-dict entry {key!r} is a {type(t).__name__}, not a tensor; checkpoints "
                            "hold tensors only (pass other state through extra=)")
        if id(t) in first:
            aliases[key] = first[id(t)]
            continue
        first[id(t)] = key
        # a DTensor: its local piece, at its offsets in the whole (see [Note: one checkpoint for every part of the model])
        split = is_dtensor(t) and not replicated(t)
        shape, offsets = local_box(t) if is_dtensor(t) else (tuple(t.shape), (0,) * t.dim())
        # a DTensor's local tensor, sharing its version counter: a weights-only load moves it (see _load)
        local = (local_of(t) if is_dtensor(t) else t).detach()
        entries.append(_Entry(key, local, where.pop(id(t), None), shape, offsets, split or replicated_writer(opt)))
    if where:
        b, i = next(iter(where.values()))
        raise ValueError(f"{len(where)} parameters that the optimizer updates are not in the model's state dict "
                         f"(the first has shape {b.layout.params[i].shape}); pass the model the optimizer was "
                         "built for")
    return entries, aliases


def _group_keys(opt: ShardedOptimizer, model: torch.nn.Module, part: str) -> list[list[str]]:
    """For each param group, the state-dict key of each of its parameters (under ``part``)."""
    key_of: dict[int, str] = {}
    for key, t in _state_items(model, opt, part):
        key_of.setdefault(id(t), key)
    out = []
    for gi, g in enumerate(opt.param_groups):
        missing = [tuple(p.shape) for p in g["params"] if id(p) not in key_of]
        if missing:
            raise ValueError(f"param group {gi} has a parameter of shape {missing[0]} that is not in the model")
        out.append([key_of[id(p)] for p in g["params"]])
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _manifest(opt: ShardedOptimizer, model: torch.nn.Module, entries: list[_Entry], aliases: dict[str, str],
              part: str) -> dict:
    tensors = {}
    for e in entries:
        info: dict[str, Any] = {"shape": list(e.shape), "dtype": _dtype_name(e.tensor.dtype),
                                "sharded": e.where is not None}
        if e.where is not None:
            b, i = e.where
            span = b.layout.params[i]
            info["master"] = (MODEL if b.dtype == torch.float32 else MASTER) + e.key
            info["buffer"] = opt.internals.buffers.index(b)
            info["flat_range"] = [span.global_range.start, span.global_range.end]  # elements, in the flat buffer
            info["rule"] = b.rule  # which moments it has: AdamW's two, or Muon's momentum buffer
            if b.amsgrad:  # AdamW's third: amsgrad's max_exp_avg_sq
                info["amsgrad"] = True
            if b.records[i].lag:  # steps this parameter took, when fewer than the optimizer's (it had no gradient in some)
                info["step"] = opt.internals.progress.step - b.records[i].lag
        tensors[e.key] = info
    groups = []
    for gi, (g, keys) in enumerate(zip(opt.param_groups, _group_keys(opt, model, part))):
        hp = {k: v for k, v in g.items() if k not in ("params", "process_group")}
        kinds = tensor_kinds(hp)  # a tensor lr comes back a tensor (see _hyper [Note: tensor hyperparameters])
        groups.append({**{k: jsonable(v, f"param group {gi} {k!r}") for k, v in hp.items()},
                       **({TENSORS: kinds} if kinds else {}), "params": keys})
    cfg, inner = opt.config, opt.internals
    config = {f.name: jsonable(getattr(cfg, f.name), f"optimizer setting {f.name!r}") for f in dataclasses.fields(cfg)}
    return {
        "format": FORMAT, "shardopt_version": __version__, "torch_version": torch.__version__,
        "world_size": inner.comm.world_size, "shard_size": inner.comm.shard_size, "step": inner.progress.step,
        "skipped_steps": opt.skipped_steps,
        "config": config,  # informational, but for the stochastic-rounding seed, which load_checkpoint restores
        "loss_scaler": jsonable(inner.scaler.state_dict(), "loss scaler state"),
        "param_groups": groups,
        "buffers": [{"dtype": _dtype_name(b.dtype), "numel": b.layout.numel} for b in inner.buffers],
        "tensors": tensors, "aliases": aliases,
        **({"axes": inner.parts.layout()} if part else {}),  # moved beside its part by _merged
    }


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, opt: ShardedOptimizer, *, extra: Any = None,
                    timeout: float | None = None) -> str:
    """Save ``model`` and ``opt`` (a ``ShardedAdamW``) to the directory ``path``; returns ``path``
    as the checkpoint functions write it (``~`` expanded; a trailing ``/``, ``./`` and doubled ``/``
    dropped: ``ckpt/step_1/`` is saved and found as ``ckpt/step_1``).

    Every rank of the optimizer's group must call it; each writes only its own shard, in parallel.
    A rank waits at most ``timeout`` seconds (default: the optimizer's ``timeout``, else 60;
    ``math.inf``: as long as a step would) for the others to call it too, then raises
    TimeoutError naming the call; a rank in another optimizer call raises RuntimeError on every
    rank.
    ``path`` must be on a filesystem that every rank sees. The checkpoint appears at ``path`` only
    once complete (an existing one there is replaced); a save that fails or is killed leaves
    ``path`` as it was; where a rank dies in it, the others raise RuntimeError naming the call
    and saying so, and whatever one rank raises in it is raised on every rank (see [Note: every
    rank raises]). ``extra`` (rank 0's is kept; tensors, numbers, strings, containers) is
    returned by ``load_checkpoint``: the place for an LR scheduler's or a data loader's state."""
    path = checkpoint_path(path)
    with opt.internals.comm.during("save_checkpoint()"):
        _save(path, model, opt, extra, timeout)
    return path


# [Note: one checkpoint for every part of the model]
# Beside tensor or pipeline parallelism (an optimizer with model axes, see comm._model_axes) each
# data-parallel group holds one part of the model. Every rank of the job saves into one
# checkpoint, in one DCP save over all of them, and one commit makes it appear at once.
# A DTensor parameter is stored as the whole tensor it is a piece of: each rank's blocks of its
# local tensor are placed at the piece's offsets (``local_box``), a Replicate placement (and a
# plain parameter or buffer beside DTensors) is written by rank 0 of the mesh only. So such a
# checkpoint loads at any tensor-parallel size, or into the same model without tensor parallelism,
# and the other way round. Plain tensors of ``model_parallel_group``'s parts share names that
# shardopt cannot place in a whole (every Megatron-style shard of "fc1.weight" is "fc1.weight"; a
# pipeline stage may name its layers as the others do): each part's keys carry its place among
# the ranks that hold one copy of the model ("mp1/fc1.weight", whatever the axes are named: see
# comm._model_parts [Note: a part is named by its ranks]), its manifest (parameter table, param
# groups, its axes) is kept under that prefix, and a part is loaded by the ranks at the same
# place, so those axes must be the same
# at load. Within a part everything reshards as before (another data-parallel size, stage, bucket
# size). Separately, every save
# claims its path in the default store for the ranks that write it: another group of ranks that
# saves to the same path in the same job (two data-parallel groups of one model built without
# model_parallel_group, whose saves would replace each other's) is refused, naming both.


def _job(opt: ShardedOptimizer) -> Comm:
    """The ranks that write or read one checkpoint together: the optimizer's group, or with model
    axes every rank of the default group (``ModelParts.job``, made at construction where the
    data-parallel group and the axes cover the default group). Local."""
    parts, comm = opt.internals.parts, opt.internals.comm
    axes = parts.axes
    if not axes:
        return comm
    if parts.job is None:
        n = comm.world_size * axes.size
        raise ValueError(f"a checkpoint of a model split over {axes.describe()} is written by every rank of "
                         f"the job together, over the default group, but the data-parallel group ({comm.world_size} "
                         f"ranks) times the model axes make {n} ranks, not the {world_size()} of the default group; "
                         "build the optimizer on every rank of the job")
    return parts.job


def _merged(parts: list[tuple[str, dict]]) -> dict:
    """One manifest from every rank's (part, manifest): the first's, with every rank's tensors and
    aliases (each part's, each expert group's), and each part's param groups, buffers and axes
    (name, position, size of each) under ``"parts"`` when there are model axes."""
    first = dict(parts[0][1])
    first.pop("axes", None)
    first["tensors"], first["aliases"] = {}, {}
    if parts[0][0]:
        first["parts"] = {}
    for part, m in parts:
        first["tensors"].update(m["tensors"])
        first["aliases"].update(m["aliases"])
        if part:
            first["parts"][part] = {"param_groups": m["param_groups"], "buffers": m["buffers"], "axes": m["axes"]}
    return first


def _unprefixed(key: str) -> str:
    """``key`` without the prefix of its param group's own process group (see optimizer [Note:
    param groups with their own data-parallel group]), as another such group names it."""
    return GROUP_PREFIX.sub("", key, count=1)


def _group_of(key: str) -> str:
    """The process-group prefix of ``key`` (after its part's), or ""."""
    m = GROUP_PREFIX.search(key)
    return m.group(0) if m is not None else ""


def _own_part(manifest: dict, opt: ShardedOptimizer | None, path: str, part: str) -> dict:
    """``manifest`` as this rank's ``part`` (``_saved_part``) sees it: its tensors, aliases, param
    groups and buffers. Raises ValueError when the checkpoint was saved with another layout of
    model axes (see comm._model_parts [Note: a part is named by its ranks]). Local."""
    parts = manifest.get("parts")
    mine_groups = set(opt.internals.parts.key_prefix.values()) if opt is not None else set()
    if any(GROUP_PREFIX.search(k) for k in manifest["tensors"]):  # other expert groups' keys are theirs
        manifest = {**manifest,
                    "tensors": {k: v for k, v in manifest["tensors"].items() if _group_of(k) in mine_groups | {""}},
                    "aliases": {k: v for k, v in manifest["aliases"].items() if _group_of(k) in mine_groups | {""}}}
    if not part and not parts:
        return manifest
    places = opt.internals.parts.places if opt is not None else 1
    saved_axes = (parts or {}).get(part, {}).get("axes")  # None in a checkpoint of before parts were named by ranks
    if not part or not parts or part not in parts or len(parts) != places or (
            saved_axes is not None and opt is not None and not _same_axes(saved_axes, opt.internals.parts.layout())):
        def axes(layout: list | None) -> str:
            return " x ".join(f"{n} {size}" for n, _, size in layout) if layout else "axes unrecorded"

        saved = ", ".join(f"{p.rstrip('/')} ({axes(v.get('axes'))}{_positions(v.get('axes'))})"
                          for p, v in sorted((parts or {}).items())) or "none"
        here = (f"{part.rstrip('/')} of {places} "
                f"({axes(opt.internals.parts.layout())}{_positions(opt.internals.parts.layout())})"
                if part and opt is not None else "(the whole model: no model_parallel_group)")
        raise ValueError(f"checkpoint {path} was saved by a model split into the parts {saved}; this rank holds "
                         f"part {here}: load it with the same tensor- and pipeline-parallel layout (the ranks and "
                         "sizes of model_parallel_group's axes, whatever they are named, and the meshes of DTensor "
                         "parameters) as it was saved with")
    mine = {k: v for k, v in manifest["tensors"].items() if k.startswith(part)}
    aliases = {k: v for k, v in manifest["aliases"].items() if k.startswith(part)}
    own = {k: v for k, v in parts[part].items() if k != "axes"}
    return {**manifest, "tensors": mine, "aliases": aliases, **own}


def _positions(layout: list | None) -> str:
    """``": tp 1, pp 0"``: the positions of a part's ``layout`` (``ModelParts.layout``), or ""."""
    return ": " + ", ".join(f"{n} {pos}" for n, pos, _ in layout) if layout else ""


def _same_axes(saved: list, mine: list) -> bool:
    """Whether a part saved on the axes ``saved`` is this rank's on ``mine`` (both ``ModelParts.layout``,
    the part's key already equal): as many axes of the same sizes, and where the axes are named
    alike, the same position on each name. See comm._model_parts [Note: a part is named by its ranks]."""
    if len(saved) == len(mine) and [size for *_, size in saved] != [size for *_, size in mine]:
        return False
    saved_at, mine_at = ({n: pos for n, pos, _ in layout} for layout in (saved, mine))
    return saved_at.keys() != mine_at.keys() or saved_at == mine_at


def _save(path: str, model: torch.nn.Module, opt: ShardedOptimizer, extra: Any, timeout: float | None) -> None:
    """``save_checkpoint`` of a path written as ``checkpoint_path`` writes it. Every rank."""
    settle(opt, "save_checkpoint", timeout)
    comm: Comm = _job(opt)  # every rank of the model (see [Note: one checkpoint for every part of the model])
    if comm is not opt.internals.comm:  # the other parts' ranks are in this call too
        enter(comm, "save_checkpoint", deadline=timeout)
    with comm.during("save_checkpoint()"):  # what a failure of the other ranks names
        _write(path, model, opt, comm, extra)


# [Note: every rank raises]
# A checkpoint call runs from one agreement (``_files.agree``) to the next, and the work between
# two is local: reading or writing files, checking the model, building the fp32 copies a save
# writes, restoring the state. Whatever one rank raises there (a model that does not match, a
# PermissionError or an EIO from one file, a MemoryError or torch.OutOfMemoryError, a bug) is
# caught, whatever its class (any Exception), and taken to the next agreement, so that every rank
# raises it (its own, or "on rank r: ..." as ``_files.restated`` makes it: the same class where
# it is a built-in one, an OSError with its errno) and leaves the call at the same point. So a
# caller that catches it (a resume loop that falls back to an older checkpoint) finds every rank
# out of the call and ready for the next; a rank that left alone would meet the next call's
# messages with the others still in this one's, or leave them waiting in DCP's exchanges until
# the group's timeout. DCP's save and load come right after an agreement, with nothing of ours
# between: DCP gathers what a rank raises in its own steps (an EIO reading a file, a full disk)
# and raises it on every rank, which ``_dcp._reraise`` restates alike on every rank (an OSError,
# with its errno, where some rank's was one). A failure of the collectives themselves (a rank
# died in DCP's exchanges, the weight gather, the default store) cannot be agreed on: the rank
# raises at once, naming the call and saying that another rank died (``Comm.collective_failed``),
# and gives up on the others (``agree`` then raises its error without a message). A load ends in
# one agreement over every rank of the job, after the weights are gathered: no rank returns from
# a load that another rank, of any part of the model, did not finish.


def _write(path: str, model: torch.nn.Module, opt: ShardedOptimizer, comm: Comm, extra: Any) -> None:
    """``_save`` once every rank of ``comm`` (``_job``) is in the call. Every rank."""
    error: Exception | None  # this rank's, which agree() raises on every rank
    part, manifest = _part(opt), {}
    try:
        entries, aliases = _entries(model, opt, part)
        manifest, error = _manifest(opt, model, entries, aliases, part), None
        check_replaceable(path)
        if comm.rank == 0 and extra is not None:
            _check_loadable(extra)
        claim(path, comm)
    except Exception as e:  # noqa: BLE001 - whatever it is, every rank raises it (see [Note: every rank raises])
        error = e
    # the ranks' manifests differ only when they hold different parts: gathered then, merged on every rank
    agreed = agree(comm, error, (uuid.uuid4().hex[:12], os.path.abspath(path),
                                 (part, manifest) if opt.internals.parts else None))
    if opt.internals.parts:
        manifest = _merged([part for _, _, part in agreed])
    paths = [where for _, where, _ in agreed]
    if len(set(paths)) > 1:
        other = next(r for r, where in enumerate(paths) if where != paths[0])
        raise ValueError(f"save_checkpoint got different paths on different ranks: {paths[0]!r} on rank 0, "
                         f"{paths[other]!r} on rank {other}; every rank must pass the same path, on a filesystem "
                         "they all see (build it once, e.g. on rank 0, and broadcast it)")
    token, started = agreed[0][0], time.time()
    tmp = temp_path(path, token)
    try:
        os.makedirs(tmp, exist_ok=True)
        if comm.rank == 0:
            write_json(os.path.join(tmp, MANIFEST), manifest)
            if extra is not None:
                with open(os.path.join(tmp, EXTRA), "wb") as f:
                    torch.save(extra, f)
                    f.flush()
                    os.fsync(f.fileno())
        error = None
    except Exception as e:  # noqa: BLE001 - see [Note: every rank raises]
        error = e
    agree(comm, error)
    from shardopt.checkpoint._dcp import CollectiveFailed, write_blocks  # DCP, imported when a checkpoint is written

    blocks: list[Block] = []
    try:  # fp32 copies of the master weights and moments (out of memory: agreed before DCP's exchanges)
        blocks, error = _blocks_to_save(entries, opt.internals.comm), None
    except Exception as e:  # noqa: BLE001 - see [Note: every rank raises]
        error = e
    try:
        agree(comm, error)
        write_blocks(tmp, blocks, comm.group)  # what a rank raises in DCP's steps, DCP raises on every rank
    except Exception as e:  # the save failed on every rank: nothing of it is kept
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, CollectiveFailed):  # a rank died (or hangs) in DCP's exchanges: say so, naming the call
            comm.collective_failed(e.cause, "DCP's exchange of the checkpoint's plans and metadata")
        raise
    crcs, error = {}, None
    try:
        crcs = data_checksums(tmp, comm.rank)  # this rank's files, while they are still in the page cache
    except Exception as e:  # noqa: BLE001 - see [Note: every rank raises]
        error = e
    every = agree(comm, error, crcs)
    if comm.rank == 0:  # every rank's files are written: DCP's last step gathered them all
        try:
            commit(tmp, path, token, {k: v for mine in every for k, v in mine.items()}, started)
        except Exception as e:  # noqa: BLE001 - see [Note: every rank raises]
            error = e
    agree(comm, error)


def _check_loadable(extra: Any) -> None:
    """Refuse, before anything is written, an ``extra`` that ``load_checkpoint`` could not read
    back (it loads with ``weights_only=True``: tensors, numbers, strings, containers)."""
    import io
    import pickle

    buf = io.BytesIO()
    torch.save(extra, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"extra= holds an object that load_checkpoint cannot read back with torch.load("
                         f"weights_only=True) ({first}); store tensors, numbers, strings and containers of them "
                         "(e.g. a numpy RNG state as a list or a tensor)") from None


def _pieces(b: FlatGroup, rank: int) -> dict[int, ShardPiece]:
    return {piece.param: piece for piece in b.layout.shard_pieces(rank)}


def _blocks_to_save(entries: list[_Entry], comm: Comm) -> list[Block]:
    """What this rank writes: its shard, once per shard (by the ranks of the first replica), and
    on rank 0 the tensors every rank holds whole."""
    blocks: list[Block] = []
    pieces: dict[int, dict[int, ShardPiece]] = {}
    masters: dict[int, Tensor] = {}
    moments: dict[int, tuple[Tensor, ...]] = {}
    for e in entries:
        if not e.writes:  # a copy that rank 0 of a model axis writes
            continue
        if e.where is None:
            if comm.rank == 0:  # replicated on every rank: one copy is enough
                blocks += e.whole(MODEL + e.key)
            continue
        b, i = e.where
        if b.comm.replica != 0:  # the first replica's ranks write the shards
            continue
        if id(b) not in pieces:  # the buffer's own group: a param group's own process_group, else the optimizer's
            pieces[id(b)], masters[id(b)] = _pieces(b, b.comm.shard_rank), b.master.fp32()
            moments[id(b)] = b.moments.fp32()  # stored as fp32 whatever the moments mode
        piece = pieces[id(b)].get(i)
        if piece is None:
            continue
        shape, r, local = b.layout.params[i].shape, piece.param_range, piece.local_range.as_slice()
        blocks += e.blocks(MODEL + e.key, shape, r, b.flat.slice(piece.global_range))
        if b.dtype != torch.float32:
            blocks += e.blocks(MASTER + e.key, shape, r, masters[id(b)][local])
        for key, moment in zip(_moment_keys(b.rule, b.amsgrad), moments[id(b)]):
            blocks += e.blocks(key + e.key, shape, r, moment[local])
    return blocks


def _moment_keys(rule: str, amsgrad: bool = False) -> tuple[str, ...]:
    """The DCP key prefixes of a rule's moments, in ``Moments.fp32()`` order (``amsgrad``: with
    AdamW's running maximum of exp_avg_sq, third)."""
    return (MOMENTUM,) if rule == "muon" else (EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ) if amsgrad else (EXP_AVG, EXP_AVG_SQ)


def _check_matches(manifest: dict, entries: list[_Entry], aliases: dict[str, str], opt: ShardedOptimizer | None,
                   model: torch.nn.Module, path: str, part: str) -> None:
    """Raise ValueError naming the first parameter where the checkpoint and the model differ."""
    saved = manifest["tensors"]
    mine = {e.key for e in entries}
    for e in entries:
        s = saved.get(e.key)
        if s is None:
            raise ValueError(f"parameter {e.key!r} of the model is not in checkpoint {path}"
                             + (f" (there it is tied to {manifest['aliases'][e.key]!r})" if e.key in manifest["aliases"]
                                else "; is it a checkpoint of another model?"))
        if tuple(s["shape"]) != tuple(e.shape):
            raise ValueError(f"parameter {e.key!r} has shape {tuple(s['shape'])} in checkpoint {path} but "
                             f"{tuple(e.shape)} in this model; is it a checkpoint of another model?")
    for key in saved:
        if key not in mine:
            raise ValueError(f"checkpoint {path} has parameter {key!r}, which this model lacks"
                             + (f" (here it is tied to {aliases[key]!r})" if key in aliases else ""))
    if opt is None:
        return
    groups = manifest["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"checkpoint {path} has {len(groups)} param groups, this optimizer {len(opt.param_groups)}")
    for gi, (g, keys) in enumerate(zip(groups, _group_keys(opt, model, part))):
        keys = [_unprefixed(k) for k in keys]
        saved_keys = [_unprefixed(k) for k in g["params"]]
        for a, b in zip(saved_keys + [None] * len(keys), keys + [None] * len(saved_keys)):
            if a != b:
                raise ValueError(f"param group {gi} differs from checkpoint {path}: parameter {b!r} here, {a!r} there")


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module, opt: ShardedOptimizer | None = None, *,
                    process_group: ProcessGroup = None, timeout: float | None = None) -> Any:
    """Load the checkpoint at ``path`` into ``model`` and, if given, ``opt`` (a ``ShardedAdamW``
    at any world size, bucket size, stage or master-weight mode); returns the ``extra`` object
    saved with it (or None).

    Every rank of the optimizer's group (of ``process_group`` when ``opt`` is None) must call it.
    Each rank reads only what its new shard needs (plus the non-sharded state); without ``opt``
    every rank reads the whole model. A partial or corrupt checkpoint raises FileNotFoundError or
    ValueError naming the file; a checkpoint of another model raises ValueError naming the first
    mismatching parameter; either is raised on every rank. A rank waits at most ``timeout`` seconds
    (default: the optimizer's ``timeout``, else 60; ``math.inf``: as long as a step would) for the
    others to call it too, then raises TimeoutError naming the call. Whatever one rank raises in
    it is raised on every rank, each leaving the call at the same point (see [Note: every rank
    raises]); where a rank dies in it, the others raise RuntimeError naming the call and saying
    so, and no rank (of any part of a model split over ranks) returns before every rank has
    finished. ``path`` is written as ``save_checkpoint`` writes it, after finishing a commit to it
    that a kill interrupted; a directory of checkpoints raises FileNotFoundError naming its latest."""
    path = checkpoint_path(path)
    comm: Comm = opt.internals.comm if opt is not None else Comm(process_group, connect=entry_deadline(timeout))
    with comm.during("load_checkpoint()"):
        return _load(path, model, opt, comm, timeout)


def _load(path: str, model: torch.nn.Module, opt: ShardedOptimizer | None, comm: Comm, timeout: float | None) -> Any:
    """``load_checkpoint`` of a path written as ``checkpoint_path`` writes it, over ``comm``. Every rank."""
    if opt is None:
        enter(comm, "load_checkpoint", deadline=timeout)
    else:
        settle(opt, "load_checkpoint", timeout)
        opt.zero_grad()  # gradients of the state being replaced must not reach the loaded one
    job = _job(opt) if opt is not None else comm  # see [Note: one checkpoint for every part of the model]
    if job is not comm:  # the other parts' ranks are in this call too
        enter(job, "load_checkpoint", deadline=timeout)
    with job.during("load_checkpoint()"):  # what a failure of the other ranks names
        return _read(path, model, opt, job)


def _read(path: str, model: torch.nn.Module, opt: ShardedOptimizer | None, job: Comm) -> Any:
    """``_load`` once every rank of ``job`` (``_job``, or the weights-only load's group) is in the
    call: check, read, restore, each step agreed over ``job`` (see [Note: every rank raises]).
    Every rank."""
    try:
        path = find_checkpoint(path)  # see _files [Note: a kill between the renames of a commit]
        marker = check_complete(path)
        full = read_manifest(path, marker)
        part = _saved_part(full, opt)
        manifest = _own_part(full, opt, path, part)
        verify_data(path, marker, job.rank, job.world_size)  # each rank its share of the tensor files
        entries, aliases = _entries(model, opt, part)
        _check_matches(manifest, entries, aliases, opt, model, path, part)
        extra = read_extra(path)  # before anything is modified: a load completes or changes nothing
        plan = _plan(manifest, entries, opt)
        error = None
    except Exception as err:  # noqa: BLE001 - whatever it is, every rank raises it (see [Note: every rank raises])
        error = err
    agree(job, error)
    _read_blocks(path, plan, job)  # what a rank raises in DCP's steps, DCP raises on every rank
    try:
        _fill(plan, entries, opt)
        error = None
    except Exception as err:  # noqa: BLE001 - see [Note: every rank raises]
        error = err
    agree(job, error)  # every rank has its shard: the weight gather that follows needs every one
    if opt is not None:
        try:
            with torch.no_grad():
                _restore_optimizer(opt, manifest, {(id(e.where[0]), e.where[1]): e.key for e in entries if e.where})
            error = None
        except Exception as err:  # noqa: BLE001 - see [Note: every rank raises]
            error = err
        agree(job, error)  # the end of the load, over every part's ranks: none returns before all have finished
    return extra


@dataclass
class _ReadPlan:
    """What a load reads (``blocks``) and where it lands before it is restored. Local."""

    blocks: list[Block]
    staging: dict[int, Tensor]  # by id of buffer: 1D fp32, this rank's shard of the master weights
    moments: dict[int, tuple[Tensor, ...]]  # by id of buffer: 1D fp32 shards, encoded into the moments mode once read
    without_max: list[tuple[Tensor, Tensor]]  # amsgrad here, not in the checkpoint: (max, exp_avg_sq) pieces


def _plan(manifest: dict, entries: list[_Entry], opt: ShardedOptimizer | None) -> _ReadPlan:
    """The blocks to read from the checkpoint of ``manifest`` (this rank's part of it, checked
    against the model's ``entries``) into the model and, if given, ``opt``'s staging. Local:
    nothing is modified."""
    plan = _ReadPlan([], {}, {}, [])
    for b in opt.internals.buffers if opt is not None else []:
        plan.staging[id(b)] = torch.zeros(b.layout.shard_numel, dtype=torch.float32, device=b.flat.device)
        plan.moments[id(b)] = tuple(torch.zeros_like(plan.staging[id(b)]) for _ in range(3 if b.amsgrad else 2))
    pieces = {id(b): _pieces(b, b.comm.shard_rank) for b in (opt.internals.buffers if opt is not None else [])}
    for e in entries:
        s = manifest["tensors"][e.key]
        if math.prod(s["shape"]) == 0 or not e.tensor.numel():
            continue
        if e.where is None:
            # Same dtype: the stored weights, bit for bit; another dtype: from the fp32 master if kept.
            same = s["dtype"] == _dtype_name(e.tensor.dtype)
            plan.blocks += e.whole(MODEL + e.key if same else s.get("master", MODEL + e.key))
            continue
        b, i = e.where
        piece = pieces[id(b)].get(i)
        if piece is None:
            continue
        # the local piece's shape: a DTensor's is read from wherever its whole was cut when saved
        shape, r, local = b.layout.params[i].shape, piece.param_range, piece.local_range.as_slice()
        plan.blocks += e.blocks(s.get("master", MODEL + e.key), shape, r, plan.staging[id(b)][local])
        # Moments of the rule it was saved with; none when it was frozen, or saved under the
        # other rule (a run moved between AdamW and Muon): they start at zero, as a new optimizer's.
        if s["sharded"] and s.get("rule", "adamw") == b.rule:
            saved_max = b.amsgrad and s.get("amsgrad", False)
            for key, moment in zip(_moment_keys(b.rule, saved_max), plan.moments[id(b)]):
                plan.blocks += e.blocks(key + e.key, shape, r, moment[local])
            if b.amsgrad and not saved_max:  # the running maximum starts at the loaded exp_avg_sq
                plan.without_max.append((plan.moments[id(b)][2][local], plan.moments[id(b)][1][local]))
    return plan


def _read_blocks(path: str, plan: _ReadPlan, job: Comm) -> None:
    """Read the checkpoint at ``path`` as ``plan`` says: into the model's non-sharded tensors and
    ``plan``'s staging. Every rank of ``job``; raises on every rank alike (DCP's own agreement),
    or where a rank died in DCP's exchanges, as ``Comm.collective_failed``."""
    from shardopt.checkpoint._dcp import CollectiveFailed, read_blocks  # DCP, imported when a checkpoint is read

    try:
        with torch.no_grad():
            read_blocks(path, plan.blocks, job.group)
    except CollectiveFailed as failed:  # a rank died (or hangs) in DCP's exchanges: say so, naming the call
        job.collective_failed(failed.cause, "DCP's exchange of the checkpoint's read plans")


def _fill(plan: _ReadPlan, entries: list[_Entry], opt: ShardedOptimizer | None) -> None:
    """Write what ``_read_blocks`` read as ``plan`` said into ``opt``'s moments and this rank's
    shard of its master weights and weights, if given. Local."""
    with torch.no_grad():
        for vmax, v in plan.without_max:
            vmax.copy_(v)
        for b in opt.internals.buffers if opt is not None else []:
            b.moments.load_(*plan.moments[id(b)])
            b.load_master({"master": plan.staging[id(b)]})  # also writes this rank's weight shard
        for e in entries:  # a weights-only load into a trained model: its optimizer's next step sees the write
            torch.autograd.graph.increment_version(e.tensor)


def _restore_optimizer(opt: ShardedOptimizer, manifest: dict, model_keys: dict[tuple, str]) -> None:
    """Gather the loaded weights (every rank's shard, written by ``_fill``), then restore the param
    groups and the counters of ``manifest``; ``model_keys``: (id of buffer, index in it) ->
    state-dict key of that parameter. Every rank."""
    for pending in [b.gather_params() for b in opt.internals.buffers]:
        pending.wait()
    for g, saved in zip(opt.param_groups, manifest["param_groups"]):
        restore_group(g, saved)
    step = int(manifest["step"])

    def lag_of(b: FlatGroup, r: ParamRecord) -> int:  # a parameter saved without state was left out of every step
        saved = manifest["tensors"].get(model_keys.get((id(b), r.index), ""), {})
        return step - int(saved.get("step", step)) if saved.get("sharded") else step

    resume(opt, step=step, lag_of=lag_of, skipped_steps=int(manifest["skipped_steps"]),
           seed=manifest["config"].get("seed"), loss_scaler=manifest["loss_scaler"])
