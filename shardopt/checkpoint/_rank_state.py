"""A ShardedAdamW's own per-rank state dict: this rank's shard, loadable on the same rank at the
same world size and layout (``save_checkpoint`` and ``consolidate_state_dict`` change world size)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor

from shardopt.checkpoint._hyper import restore_group
from shardopt.checkpoint._resume import resume

if TYPE_CHECKING:
    from shardopt.checkpoint._sharded_optimizer import ShardedOptimizer
    from shardopt.core._records import ParamRecord

STATE_FORMAT = "shardopt.rank_shard.v1"


def rank_state_dict(opt: ShardedOptimizer) -> dict[str, Any]:
    """``opt``'s shard on this rank: master weights, moments, steps, groups, scaler, and torch's two
    keys (see [Note: torch's keys in the rank state dict]). Local."""
    opt.finish_param_gather()
    opt.internals.checks.refresh_local()
    problems = opt.state.take_writes()  # writes into opt.state, as the state dict reads it
    if problems:
        raise RuntimeError(problems[0])
    return _shard_state(opt, lambda t: t.clone(), torch_keys=True)


def _shard_state(opt: ShardedOptimizer, copy: Callable[[Tensor], Tensor], *, torch_keys: bool) -> dict[str, Any]:
    """The rank state dict of ``opt`` as it is now, each tensor ``copy``'d; ``torch_keys``: with
    torch's per-parameter "state" (else only the entries of ``opt.state`` under other keys). Local."""
    index = param_indices(opt.param_groups)
    groups = []
    for g in opt.param_groups:
        # a param group's own process_group is this run's object, not state (and cannot be pickled)
        groups.append({**{k: v for k, v in g.items() if k not in ("params", "process_group")},
                       "params": [index[id(p)] for p in g["params"]]})
    inner = opt.internals
    buffers = [{k: copy(v) for k, v in b.moments.tensors().items()} for b in inner.buffers]
    state: dict[Any, Any] = {}
    if torch_keys:
        for b, moments in zip(inner.buffers, buffers):
            for r in b.records:
                if opt.state.has_entry(b, r, inner.progress.step):
                    state[index[id(r.leaf)]] = _on_clones(opt.state.entry(b, r, inner.progress.step), moments, r)
        state = {k: state[k] for k in sorted(state)}
    state.update(opt.state.other_entries())  # entries of other keys, as torch
    return {
        "format": STATE_FORMAT,
        "world_size": inner.comm.world_size,
        "rank": inner.comm.rank,
        "shard_size": inner.comm.shard_size,
        "stage": opt.config.stage,
        "master_weights": opt.config.master_weights,
        "moments": opt.config.moments,
        "seed": opt.config.seed,
        "step": inner.progress.step,
        "skipped_steps": opt.skipped_steps,
        "param_groups": groups,
        "loss_scaler": inner.scaler.state_dict(),
        "buffers": [
            {"dtype": str(b.dtype), "layout_numel": b.layout.numel,
             "bucket_pieces": [bucket.piece_numel for bucket in b.layout.buckets],
             "param_shapes": [span.shape for span in b.layout.params],
             **{k: copy(v) for k, v in b.master.state_tensors().items()},
             **moments, "lag": [r.lag for r in b.records]}
            for b, moments in zip(inner.buffers, buffers)
        ],
        "state": state,
    }


HEAL_FORMAT = "shardopt.heal_shard.v1"


def heal_state_dict(opt: ShardedOptimizer) -> dict[str, Any]:
    """What a replica group that heals takes from this rank (torchft, see shardopt.fault_tolerance):
    its rank state dict (this rank's shard of master weights and moments, counters, groups, scaler)
    and the weights of its flat buffers, copied into host memory under the optimizer's state lock,
    so from any thread and between two steps. No communication; takes in nothing written since
    the last step (a read only). Local."""
    with opt.internals.state_lock:
        def host(t: Tensor) -> Tensor:
            return t.detach().to("cpu", copy=True)
        sd = _shard_state(opt, host, torch_keys=False)
        sd["format"] = HEAL_FORMAT
        sd["weights"] = [host(b.flat.data) for b in opt.internals.buffers]
    return sd


def load_heal_state_dict(opt: ShardedOptimizer, sd: dict[str, Any]) -> None:
    """Take ``heal_state_dict``'s output from the same rank of a live replica group, in place into
    this optimizer's flat buffers (weights, master weights, moments) and counters, under the state
    lock. No communication: every rank of the group loads its own. Raises ``ValueError`` for another
    shard count or layout, before changing anything. Local."""
    if not isinstance(sd, dict) or sd.get("format") != HEAL_FORMAT:
        raise ValueError(f"a replica group heals from shardopt.fault_tolerance's state (format {HEAL_FORMAT!r}), "
                         f"got {type(sd).__name__} {sd.get('format') if isinstance(sd, dict) else ''!r}: register "
                         "the optimizer with shardopt.fault_tolerance.register(manager, optimizer) on every group")
    try:
        check_rank_state_dict(opt, sd)
    except ValueError as e:
        raise ValueError(f"this replica group cannot heal from the live group: {e}. Replica groups under torchft must "
                         f"have the same shard count, model and settings; a group of another shard count restarts "
                         f"from a checkpoint (shardopt.load_checkpoint reshards) instead") from None
    with opt.internals.state_lock:
        for saved, weights, b in zip(sd["buffers"], sd["weights"], opt.internals.buffers):
            b.flat.data.copy_(weights)  # every piece of the weights; this rank's own is rewritten from its master next
            b.moments.load_tensors(saved)
            b.load_master(saved)
        for g, saved in zip(opt.param_groups, sd["param_groups"]):
            restore_group(g, saved)
        for k, v in sd.get("state", {}).items():
            if not isinstance(k, int):
                opt.state[k] = v
        lags = {id(b): saved["lag"] for saved, b in zip(sd["buffers"], opt.internals.buffers)}
        resume(opt, step=int(sd["step"]), lag_of=lambda b, r: lags[id(b)][r.index],
                    skipped_steps=int(sd["skipped_steps"]), seed=sd.get("seed"), loss_scaler=sd["loss_scaler"])


# [Note: torch's keys in the rank state dict]
# torch.optim's contract is a dict with "state" (per parameter index) and "param_groups" (each
# with "params": the indices of its parameters, numbered over every group in order, as torch
# numbers them), and code around optimizers reads and changes them (state-dict hooks, framework
# checkpointing). The rank state dict has both: "param_groups" as torch's, "state" holding for
# each parameter with state what ``opt.state[p]`` holds on this rank (its step count and this
# rank's piece of each state tensor, see _torch_state [Note: opt.state of a sharded optimizer]),
# plus any entry of ``opt.state`` under another key. Its pieces with ``moments="fp32"`` are views
# of the moments under "buffers" (no second copy; a change in place is a change there), decoded
# copies otherwise. "buffers" restores the shard bit for bit; load_state_dict restores from it,
# puts the entries under other keys back into ``opt.state``, and takes the param groups'
# hyperparameters.
def param_indices(param_groups: list[dict[str, Any]]) -> dict[int, int]:
    """Each parameter's index (by ``id``) as torch.optim's state_dict numbers them: in param-group
    order, from 0, a parameter listed again keeping its first index."""
    index: dict[int, int] = {}
    for g in param_groups:
        for p in g["params"]:
            index.setdefault(id(p), len(index))
    return index


def _on_clones(entry: dict[str, Any], moments: dict[str, Tensor], r: ParamRecord) -> dict[str, Any]:
    """``entry`` (``opt.state`` of record ``r``) with each fp32 piece replaced by the same piece of
    the cloned moments ``moments``, so that the state dict holds no second copy of them."""
    out = dict(entry)
    for k, v in entry.items():
        t = moments.get(k)
        if k != "step" and t is not None and t.dtype == torch.float32 and r.local is not None:
            out[k] = t[r.local.as_slice()].view(v.shape)
    return out


def check_rank_state_dict(opt: ShardedOptimizer, sd: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless ``sd`` is ``rank_state_dict``'s output for this rank and layout. Local."""
    comm = opt.internals.comm
    if sd["world_size"] != comm.world_size or sd["rank"] != comm.rank or \
            sd.get("shard_size", sd["world_size"]) != comm.shard_size:
        raise ValueError(f"state dict is rank {sd['rank']} of world size {sd['world_size']} sharded over "
                         f"{sd.get('shard_size', sd['world_size'])}, this is rank {comm.rank} of "
                         f"{comm.world_size} sharded over {comm.shard_size}: a {type(opt).__name__}'s state_dict() is one rank's "
                         "shard. Save the whole state with opt.consolidate_state_dict() before state_dict() (it "
                         "loads at any world size), or use shardopt.save_checkpoint / load_checkpoint")
    if sd.get("moments", "fp32") != opt.config.moments:
        raise ValueError(f"state dict was saved with moments={sd.get('moments', 'fp32')!r}, this optimizer uses "
                         f"{opt.config.moments!r}; save with shardopt.save_checkpoint (moments stored as fp32) to "
                         "change modes")
    if sd["master_weights"] != opt.config.master_weights:
        raise ValueError(f"state dict was saved with master_weights={sd['master_weights']!r}, this optimizer "
                         f"uses {opt.config.master_weights!r}")
    if len(sd["buffers"]) != len(opt.internals.buffers) or len(sd["param_groups"]) != len(opt.param_groups):
        raise ValueError("state dict does not match this optimizer's parameters: "
                         f"{len(sd['buffers'])} dtype buffers and {len(sd['param_groups'])} param groups saved, "
                         f"{len(opt.internals.buffers)} and {len(opt.param_groups)} here")
    for saved, b in zip(sd["buffers"], opt.internals.buffers):
        shapes = [tuple(s) for s in saved["param_shapes"]]
        mine = [span.shape for span in b.layout.params]
        pieces = [bucket.piece_numel for bucket in b.layout.buckets]
        if "bucket_pieces" not in saved and shapes == mine and comm.shard_size > 1 and len(pieces) > 1:
            raise ValueError(f"this rank state dict was saved by a shardopt whose shards were one range of the flat "
                             f"buffer; shards are now each rank's equal piece of every bucket, so this rank's "
                             f"saved {b.dtype} shard does not hold what it holds now ({len(pieces)} buckets, "
                             f"{comm.shard_size} ranks). Load it with the shardopt that saved it and write a "
                             f"checkpoint with save_checkpoint (or full_state_dict), which every version and world "
                             f"size loads")
        if saved["dtype"] != str(b.dtype) or shapes != mine or saved["layout_numel"] != b.layout.numel or \
                saved.get("bucket_pieces", pieces) != pieces:
            first = next((i for i, (x, y) in enumerate(zip(shapes, mine)) if x != y), min(len(shapes), len(mine)))
            raise ValueError(f"state dict does not match this optimizer's {b.dtype} parameters: first mismatch "
                             f"at parameter #{first} of the buffer ({len(shapes)} saved, {len(mine)} here); "
                             "was it saved for another model or another bucket_cap_mb?")


def load_rank_state_dict(opt: ShardedOptimizer, sd: dict[str, Any]) -> None:
    """Restore ``rank_state_dict``'s output (checked by ``check_rank_state_dict``) on the rank and
    world size it came from, and write the restored master weights into the model. Every rank
    (the weights are all-gathered)."""
    for saved, b in zip(sd["buffers"], opt.internals.buffers):
        b.moments.load_tensors(saved)
        b.load_master(saved)
    for g, saved in zip(opt.param_groups, sd["param_groups"]):
        restore_group(g, saved)  # a tensor lr stays a tensor (see _hyper [Note: tensor hyperparameters])
    for k, v in sd.get("state", {}).items():
        if not isinstance(k, int):
            opt.state[k] = v  # entries of other keys, as torch.optim keeps them
    for pending in [b.gather_params() for b in opt.internals.buffers]:
        pending.wait()
    lags = {id(b): saved.get("lag", [0] * len(b.records)) for saved, b in zip(sd["buffers"], opt.internals.buffers)}
    resume(opt, step=int(sd["step"]), lag_of=lambda b, r: lags[id(b)][r.index],
                skipped_steps=int(sd.get("skipped_steps", 0)), seed=sd.get("seed"), loss_scaler=sd["loss_scaler"])
