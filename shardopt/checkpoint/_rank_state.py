"""A ShardedAdamW's own per-rank state dict: this rank's shard, loadable on the same rank at the
same world size and layout (``save_checkpoint`` and ``consolidate_state_dict`` change world size)."""
from __future__ import annotations

import dataclasses
from typing import Any

STATE_FORMAT = "shardopt.rank_shard.v1"


def rank_state_dict(opt: Any) -> dict[str, Any]:
    """``opt``'s shard on this rank: master weights, moments, steps, groups, scaler. Local."""
    opt.finish_param_gather()
    opt._checks.refresh_local()
    groups = []
    for g in opt.param_groups:
        groups.append({k: v for k, v in g.items() if k != "params"})
    return {
        "format": STATE_FORMAT,
        "world_size": opt._comm.world_size,
        "rank": opt._comm.rank,
        "shard_size": opt._comm.shard_size,
        "stage": opt.config.stage,
        "master_weights": opt.config.master_weights,
        "moments": opt.config.moments,
        "seed": opt.config.seed,
        "step": opt._step,
        "skipped_steps": opt.skipped_steps,
        "param_groups": groups,
        "loss_scaler": opt._scaler.state_dict(),
        "buffers": [
            {"dtype": str(b.dtype), "layout_numel": b.layout.numel,
             "param_shapes": [span.shape for span in b.layout.params],
             **{k: v.clone() for k, v in b.master.state_tensors().items()},
             **{k: v.clone() for k, v in b.moments.tensors().items()}, "lag": [r.lag for r in b.records]}
            for b in opt._buffers
        ],
    }


def check_rank_state_dict(opt: Any, sd: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless ``sd`` is ``rank_state_dict``'s output for this rank and layout. Local."""
    if sd["world_size"] != opt._comm.world_size or sd["rank"] != opt._comm.rank or \
            sd.get("shard_size", sd["world_size"]) != opt._comm.shard_size:
        raise ValueError(f"state dict is rank {sd['rank']} of world size {sd['world_size']} sharded over "
                         f"{sd.get('shard_size', sd['world_size'])}, this is rank {opt._comm.rank} of "
                         f"{opt._comm.world_size} sharded over {opt._comm.shard_size}: a ShardedAdamW's state_dict() is one rank's "
                         "shard. Save the whole state with opt.consolidate_state_dict() before state_dict() (it "
                         "loads at any world size), or use shardopt.save_checkpoint / load_checkpoint")
    if sd.get("moments", "fp32") != opt.config.moments:
        raise ValueError(f"state dict was saved with moments={sd.get('moments', 'fp32')!r}, this optimizer uses "
                         f"{opt.config.moments!r}; save with shardopt.save_checkpoint (moments stored as fp32) to "
                         "change modes")
    if sd["master_weights"] != opt.config.master_weights:
        raise ValueError(f"state dict was saved with master_weights={sd['master_weights']!r}, this optimizer "
                         f"uses {opt.config.master_weights!r}")
    if len(sd["buffers"]) != len(opt._buffers) or len(sd["param_groups"]) != len(opt.param_groups):
        raise ValueError("state dict does not match this optimizer's parameters: "
                         f"{len(sd['buffers'])} dtype buffers and {len(sd['param_groups'])} param groups saved, "
                         f"{len(opt._buffers)} and {len(opt.param_groups)} here")
    for saved, b in zip(sd["buffers"], opt._buffers):
        shapes = [tuple(s) for s in saved["param_shapes"]]
        mine = [span.shape for span in b.layout.params]
        if saved["dtype"] != str(b.dtype) or shapes != mine or saved["layout_numel"] != b.layout.numel:
            first = next((i for i, (x, y) in enumerate(zip(shapes, mine)) if x != y), min(len(shapes), len(mine)))
            raise ValueError(f"state dict does not match this optimizer's {b.dtype} parameters: first mismatch "
                             f"at parameter #{first} of the buffer ({len(shapes)} saved, {len(mine)} here); "
                             "was it saved for another model or another bucket_cap_mb?")


def load_rank_state_dict(opt: Any, sd: dict[str, Any]) -> None:
    """Restore ``rank_state_dict``'s output (checked by ``check_rank_state_dict``) on the rank and
    world size it came from, and write the restored master weights into the model. Every rank
    (the weights are all-gathered)."""
    for saved, b in zip(sd["buffers"], opt._buffers):
        b.moments.load_tensors(saved)
        b.load_master(saved)
        for r, lag in zip(b.records, saved.get("lag", [0] * len(b.records))):
            r.lag = int(lag)
    for g, saved in zip(opt.param_groups, sd["param_groups"]):
        g.update(saved)
    opt._step = int(sd["step"])
    opt.skipped_steps = int(sd.get("skipped_steps", 0))
    opt.config = dataclasses.replace(opt.config, seed=int(sd.get("seed", opt.config.seed)))
    for b in opt._buffers:
        b.master.seed = opt.config.seed
    opt._scaler.load_state_dict(sd["loss_scaler"])
    for pending in [b.gather_params() for b in opt._buffers]:
        pending.wait()
    for b in opt._buffers:
        b.binding.record()  # weights loaded into the model before this are superseded by the master
