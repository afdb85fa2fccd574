"""Turn a sharded shardopt checkpoint into plain PyTorch state dicts, in one process, no ranks.

    python -m shardopt.convert CKPT_DIR OUT.pt [--fp32-weights]

``OUT.pt`` holds ``{"model": <model state dict>, "optim": <torch.optim.AdamW state dict>}``:

    sd = torch.load("OUT.pt")
    model.load_state_dict(sd["model"])
    opt = torch.optim.AdamW(<the same param groups>); opt.load_state_dict(sd["optim"])

A ShardedMuon checkpoint gives ``torch.optim.Muon``'s keys and state (``momentum_buffer``) for its
Muon groups and AdamW's for its ``"use_muon": False`` groups; ``split_by_rule(sd["optim"])`` cuts it
into the state dicts of a ``torch.optim.Muon`` and a ``torch.optim.AdamW`` over those groups.

The model's weights keep their saved dtype (tied parameters appear under each of their names);
``--fp32-weights`` writes every floating-point tensor in fp32, trained parameters as their fp32
master weights, to continue in fp32 with a plain AdamW. ``CKPT_DIR`` is found as
``load_checkpoint`` finds it (``~``, a trailing ``/``, an interrupted commit; a directory of
checkpoints is refused, naming its latest).

[Note: converting the parts of a model split over ranks]
A checkpoint of a model split over ``model_parallel_group=`` (Megatron-style plain shards,
pipeline stages) holds one model per part, each with its own param groups (checkpoint [Note: one
checkpoint for every part of the model]); no one AdamW state dict holds them, since each is the
state of another model, on other ranks. So ``"model"`` keeps every part's weights under their
keys (``"mp1/fc1.weight"``), ``"optim"`` holds one AdamW state dict per part, by part
(``sd["optim"]["mp1"]``, numbered over that part's param groups as its own AdamW would), and
``"parts"`` each part's position on the named axes (``{"mp1": {"tp": 1}}``);
``split_by_part(sd)`` gives each part's ``{"model", "optim"}`` with its weights' keys as the part's
model names them. Experts on param groups with their own process group, and DTensor parameters,
are whole-model state: an expert group's parameters keep their keys (``"pg1-0/…"``, ``"pg1-1/…"``),
and each such param group lists every group's parameters, in the order of their places (a
torch AdamW over a model that holds every expert in that order loads it); DTensor parameters are
stored whole.

[Note: streaming conversion]
The converter never holds the whole state in memory. Every output tensor is backed by its own
memory-mapped scratch file (``torch.from_file(shared=True)``) next to ``OUT.pt``; DCP reads the
checkpoint chunk by chunk straight into those mappings, and ``torch.save`` then streams them into
``OUT.pt``. Besides the page cache, which the kernel can always write back and drop, memory stays
at about one saved chunk (at most the largest parameter). Scratch space on disk is the size of
the output; it is removed at the end, and ``OUT.pt`` appears only once complete.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import tempfile
from typing import Any, Callable, Sequence

import torch

from shardopt.checkpoint._adamw import adamw_defaults
from shardopt.checkpoint._blocks import (EXP_AVG, EXP_AVG_SQ, GROUP_PREFIX, MAX_EXP_AVG_SQ, MODEL, MOMENTUM, Block,
                                         whole)
from shardopt.checkpoint._files import check_complete, find_checkpoint, read_manifest, verify_data
from shardopt.checkpoint._hyper import TENSORS, restored


def convert_checkpoint(ckpt_dir: str | os.PathLike, out_path: str | os.PathLike, *, fp32_weights: bool = False) -> str:
    """Write the checkpoint at ``ckpt_dir`` as ``{"model": ..., "optim": ...}`` to ``out_path``
    (a model split over ``model_parallel_group=``: ``"optim"`` by part, and ``"parts"``; see
    [Note: converting the parts of a model split over ranks]); returns the checkpoint directory
    it read.

    ``ckpt_dir`` is found as ``load_checkpoint`` finds it (``~`` expanded, a trailing ``/`` and
    ``./`` dropped, a commit a kill interrupted finished; a directory of checkpoints raises
    FileNotFoundError naming its latest); ``~`` in ``out_path`` is expanded too. Needs no process
    group; memory stays near the size of the largest parameter (see [Note: streaming
    conversion]). Raises like ``load_checkpoint`` on a partial or corrupt checkpoint."""
    path = find_checkpoint(ckpt_dir)
    out_path = os.path.expanduser(os.fspath(out_path))
    marker = check_complete(path)
    manifest = read_manifest(path, marker)
    verify_data(path, marker)  # every tensor file against its CRC, as load_checkpoint does before it reads
    out_dir = os.path.dirname(os.path.abspath(out_path))
    scratch = tempfile.mkdtemp(prefix=os.path.basename(out_path) + ".scratch-", dir=out_dir)
    try:
        converted, blocks = _skeleton(manifest, scratch, fp32_weights, path)
        from shardopt.checkpoint._dcp import read_blocks  # DCP, imported when a checkpoint is read

        read_blocks(path, blocks, no_dist=True)
        partial = out_path + ".partial"
        torch.save(converted, partial)
        del converted, blocks
        os.replace(partial, out_path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def _skeleton(manifest: dict, scratch: str, fp32_weights: bool, path: str) -> tuple[dict, list[Block]]:
    """The output (``{"model", "optim"}``, and ``"parts"`` for a model split over ranks), every
    tensor a memory-mapped scratch file, and the blocks to fill."""
    blocks: list[Block] = []
    counter = iter(range(1 << 62))

    def scratch_tensor(key: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        t = torch.from_file(os.path.join(scratch, str(next(counter))), shared=True, size=max(n, 1), dtype=dtype)
        t = t[:n].view(shape)
        if n:
            blocks.append(whole(key, t))
        return t

    model: dict[str, torch.Tensor] = {}
    for key, s in manifest["tensors"].items():
        dtype = getattr(torch, s["dtype"])
        if fp32_weights and dtype.is_floating_point:  # the master where kept, else an exact upcast
            model[key] = scratch_tensor(s.get("master", MODEL + key), s["shape"], torch.float32)
        else:
            model[key] = scratch_tensor(MODEL + key, s["shape"], dtype)
    for alias, key in manifest["aliases"].items():
        model[alias] = model[key]
    parts = manifest.get("parts")
    if not parts:
        return {"model": model, "optim": _optim(manifest, manifest["param_groups"], scratch_tensor, path)}, blocks
    names = sorted(parts, key=_natural)  # see [Note: converting the parts of a model split over ranks]
    optim = {p.rstrip("/"): _optim(manifest, parts[p]["param_groups"], scratch_tensor, path) for p in names}
    where = {p.rstrip("/"): {n: pos for n, pos, _ in parts[p].get("axes", [])} for p in names}
    return {"model": model, "optim": optim, "parts": where}, blocks


def _natural(name: str) -> list:
    """A sort key that puts ``"mp2"`` before ``"mp10"``."""
    return [(0, int(x), "") if x.isdigit() else (1, 0, x) for x in re.split(r"(\d+)", name)]


def _optim(manifest: dict, param_groups: list[dict], scratch_tensor: Callable[[str, list[int], torch.dtype], torch.Tensor],
           path: str) -> dict[str, Any]:
    """The torch optimizer state dict of ``param_groups`` (one part's, or the whole model's), its
    state tensors made by ``scratch_tensor``."""
    state: dict[int, dict[str, Any]] = {}
    groups, index, defaults = [], 0, adamw_defaults()
    for g in param_groups:
        ids = []
        for key in _every_group(g["params"], manifest["tensors"], path):
            s = manifest["tensors"][key]
            steps = s.get("step", manifest["step"])  # its own step count, when it had no gradient in some
            if s["sharded"] and s.get("rule") == "muon":  # torch.optim.Muon's state
                state[index] = {"momentum_buffer": scratch_tensor(MOMENTUM + key, s["shape"], torch.float32)}
            elif s["sharded"] and steps > 0:  # AdamW has no state for a parameter it never updated
                state[index] = {"step": torch.tensor(float(steps), dtype=torch.float32),
                                "exp_avg": scratch_tensor(EXP_AVG + key, s["shape"], torch.float32),
                                "exp_avg_sq": scratch_tensor(EXP_AVG_SQ + key, s["shape"], torch.float32)}
                if s.get("amsgrad") and g.get("amsgrad"):  # torch keeps it for amsgrad groups only
                    state[index]["max_exp_avg_sq"] = scratch_tensor(MAX_EXP_AVG_SQ + key, s["shape"], torch.float32)
            ids.append(index)
            index += 1
        kinds = g.get(TENSORS) or {}  # a tensor lr as torch's state dict holds it (_hyper [Note: tensor hyperparameters])
        hp = {k: tuple(v) if k in ("betas", "ns_coefficients") else restored(None, v, kinds.get(k))
              for k, v in g.items() if k not in ("params", TENSORS)}
        muon = hp.get("use_muon", False) is not False  # a ShardedMuon's Muon group: torch.optim.Muon's keys
        groups.append({**({} if muon else defaults), **hp, "params": ids})
    return {"state": state, "param_groups": groups}


def _every_group(keys: list[str], tensors: dict[str, dict], path: str) -> list[str]:
    """``keys``, one param group's parameters as the rank that wrote the manifest names them; for a
    param group with its own process group (``pg<i>-<k>/`` keys), the same parameters of each of
    its groups of ranks, in the order of their places ``k`` (see [Note: converting the parts of a
    model split over ranks]). Raises ValueError when a group of ranks holds other parameters."""
    m = GROUP_PREFIX.search(keys[0]) if keys else None
    if m is None:
        return keys
    head, gi = keys[0][:m.start()], m.group(1)  # head: the part's prefix, if any
    names = [GROUP_PREFIX.sub("", k[len(head):], count=1) for k in keys]
    of_group = re.compile(re.escape(head) + rf"pg{gi}-(\d+)/")
    held: dict[int, set[str]] = {}
    for key in tensors:
        found = of_group.match(key)
        if found is not None:
            held.setdefault(int(found.group(1)), set()).add(key[found.end():])
    out = []
    for place in sorted(held):
        if held[place] != set(names):
            differ = sorted(held[place] ^ set(names))[0]
            raise ValueError(f"checkpoint {path}: the groups of ranks of param group {gi} hold other parameters "
                             f"({differ!r} is in one of them only, e.g. group {place}), so one torch optimizer "
                             "state dict cannot line them up; load the checkpoint with shardopt.load_checkpoint at "
                             "the expert layout it was saved with instead")
        out += [f"{head}pg{gi}-{place}/{name}" for name in names]
    return out


def split_by_part(sd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A converted checkpoint of a model split over ``model_parallel_group=`` (``sd``, from
    ``convert_checkpoint``) as each part's ``{"model": <its weights, keyed as that part's model
    names them>, "optim": <its torch optimizer state dict>}``, by part (``"mp0"``, ...). No ranks.
    See [Note: converting the parts of a model split over ranks]."""
    if "parts" not in sd:
        raise ValueError("this converted checkpoint holds one model, not parts of one (it was saved without "
                         "model_parallel_group=): load sd['model'] and sd['optim'] as they are")
    out = {}
    for part in sd["parts"]:
        prefix = part + "/"
        out[part] = {"model": {k[len(prefix):]: v for k, v in sd["model"].items() if k.startswith(prefix)},
                     "optim": sd["optim"][part]}
    return out


def split_by_rule(optim: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ShardedMuon optimizer state dict (from ``convert_checkpoint``) as two torch state dicts:
    ``torch.optim.Muon``'s (its Muon groups) and ``torch.optim.AdamW``'s (its ``"use_muon": False``
    groups), each numbered from 0 in its groups' order. No ranks."""
    out = []
    for muon in (True, False):
        ids: dict[int, int] = {}
        groups, state = [], {}
        for g in optim["param_groups"]:
            if (g.get("use_muon", False) is not False) != muon:
                continue
            params = []
            for pid in g["params"]:
                ids[pid] = len(ids)
                params.append(ids[pid])
                if pid in optim["state"]:
                    state[ids[pid]] = optim["state"][pid]
            groups.append({**{k: v for k, v in g.items() if k not in ("params", "use_muon")}, "params": params})
        out.append({"state": state, "param_groups": groups})
    return out[0], out[1]


def join_by_rule(muon: dict[str, Any], adamw: dict[str, Any], use_muon: Sequence[bool] | None = None) -> dict[str, Any]:
    """The state dicts of a ``torch.optim.Muon`` and a ``torch.optim.AdamW`` as one that
    ``ShardedMuon.load_state_dict`` takes, the inverse of :func:`split_by_rule`. ``use_muon[i]``
    says whether the ShardedMuon's param group ``i`` is a Muon group (taken in order from ``muon``)
    or an AdamW one (from ``adamw``); default: the Muon groups first. No ranks."""
    if use_muon is None:
        use_muon = [True] * len(muon["param_groups"]) + [False] * len(adamw["param_groups"])
    if sum(use_muon) != len(muon["param_groups"]) or len(use_muon) - sum(use_muon) != len(adamw["param_groups"]):
        raise ValueError(f"use_muon names {sum(use_muon)} Muon and {len(use_muon) - sum(use_muon)} AdamW groups; the "
                         f"state dicts have {len(muon['param_groups'])} and {len(adamw['param_groups'])}")
    sources = {True: iter(muon["param_groups"]), False: iter(adamw["param_groups"])}
    groups, state, n = [], {}, 0  # n: the next parameter number, in param-group order as torch numbers them
    for is_muon in use_muon:
        sd, g = (muon if is_muon else adamw), next(sources[is_muon])
        params = list(range(n, n + len(g["params"])))
        state.update({new: sd["state"][pid] for new, pid in zip(params, g["params"]) if pid in sd["state"]})
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "use_muon": is_muon, "params": params})
        n += len(params)
    return {"state": state, "param_groups": groups}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m shardopt.convert", description=__doc__.split("\n")[0])
    p.add_argument("ckpt_dir", help="a checkpoint directory written by shardopt.save_checkpoint")
    p.add_argument("out", help="output file (torch.save format)")
    p.add_argument("--fp32-weights", action="store_true",
                   help="write floating-point tensors in fp32, parameters as their fp32 master weights")
    args = p.parse_args(argv)
    try:
        path = convert_checkpoint(args.ckpt_dir, args.out, fp32_weights=args.fp32_weights)
    except (FileNotFoundError, ValueError) as e:  # partial, corrupt or missing: say which file, no traceback
        p.exit(1, f"{p.prog}: error: {e}\n")
    manifest = read_manifest(path)
    out = os.path.expanduser(args.out)
    parts = manifest.get("parts") or {}
    where = ", ".join(f"{q.rstrip('/')} ({_positions(parts[q].get('axes'))})" for q in sorted(parts, key=_natural))
    print(f"wrote {out} from {path}: {len(manifest['tensors'])} model tensors, step {manifest['step']}, "
          f"{os.path.getsize(out) / 2**20:,.1f} MiB")
    if parts:
        print(f"{len(parts)} parts: {where}; sd['optim'][part] is each part's optimizer state dict, "
              "shardopt.convert.split_by_part(sd) gives each part's model and optimizer state dicts")


def _positions(layout: list | None) -> str:
    """``"pp 1, tp 0"``: a part's positions on the named axes (a manifest's ``"axes"``)."""
    return ", ".join(f"{n} {pos}" for n, pos, _ in layout) if layout else "axes not recorded"


if __name__ == "__main__":
    main()
