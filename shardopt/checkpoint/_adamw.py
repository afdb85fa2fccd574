"""Export to and import from ``torch.optim.AdamW``'s own state-dict format, one parameter at a time.

The format: ``{"state": {i: {"step": 0-d fp32 tensor, "exp_avg": T, "exp_avg_sq": T}},
"param_groups": [{lr, betas, ..., "params": [i, ...]}]}`` with parameters numbered in param-group
order, as ``torch.optim.Optimizer.state_dict`` numbers them. It holds no master weights: a plain
AdamW updates the model's weights themselves. ``consolidate_state_dict`` adds one more top-level
key, ``"shardopt"``, which ``torch.optim.AdamW.load_state_dict`` ignores: the fp32 master weights
of 16-bit parameters (by parameter number) and the loss scaler, so that a resume through this
format is as exact as one through ``save_checkpoint``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from shardopt.checkpoint._files import agree
from shardopt.checkpoint._hyper import restore_group
from shardopt.checkpoint._resume import resume
from shardopt.checkpoint._torch_state import ParamStateView
from shardopt.comm._messages import enter
from shardopt.core._layout import Range

if TYPE_CHECKING:
    from shardopt.checkpoint._sharded_optimizer import ShardedOptimizer
    from shardopt.comm._collectives import Comm
    from shardopt.group._flat_group import FlatGroup


def adamw_defaults() -> dict[str, Any]:
    return dict(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults)


def settle(opt: ShardedOptimizer, call: str, timeout: float | None = None) -> None:
    """Check that every rank is in ``call`` (``_messages.enter``, waiting ``timeout`` seconds
    for them: by default the optimizer's timeout, else ``ENTRY_TIMEOUT``), wait for weight
    all-gathers that ``step`` left in flight (``overlap_param_gather``) and take weights written
    into the model from outside as master weights; refuse an optimizer whose ranks fell out of
    step. Every rank."""
    rounds = opt.internals.rounds
    rounds.settle()  # see _rounds [Note: a round that did not end]
    rounds.join.send()  # inside a Join, a joined rank then meets this call and raises with it
    if timeout is None:
        timeout = opt.config.timeout
    try:
        enter(opt.internals.comm, call, lost_round=rounds.lost_round, deadline=timeout)
    except (RuntimeError, TimeoutError) as e:
        rounds.fail(str(e))
        raise
    opt.finish_param_gather()
    # writes into opt.state first: a checkpoint or a load reads the state (unless opt.state was
    # replaced by another object, which torch.optim code may assign)
    state = opt.state
    opt.internals.checks.take_outside_writes(state.take_writes() if isinstance(state, ParamStateView) else [])


def _locations(opt: ShardedOptimizer) -> dict[int, tuple[FlatGroup, int]]:
    # the model's parameter (core._dtensor)
    return {id(r.leaf): (b, r.index) for b in opt.internals.buffers for r in b.records}


def _param_pieces(b: FlatGroup, i: int) -> list[Range]:
    """Each rank's piece of parameter ``i`` of buffer ``b``, as ranges within the flattened parameter."""
    span = b.layout.params[i].global_range
    pieces = b.layout.bucket_shard_ranges(b.records[i].bucket.index)
    return [span.intersect(p).relative_to(span.start) if span.intersect(p).size else Range(0, 0) for p in pieces]


def _keeps_master(opt: ShardedOptimizer, b: FlatGroup) -> bool:
    """Whether buffer ``b`` holds master weights that its 16-bit weights do not already encode."""
    return b.dtype != torch.float32 and opt.config.master_weights in ("fp32", "remainder")


def full_state_dict(opt: ShardedOptimizer, *, to: int = 0, extras: bool = False, call: str = "full_state_dict") -> dict[str, Any]:
    """``opt``'s state in ``torch.optim.AdamW``'s format, on rank ``to`` (``{}`` on other ranks);
    with ``extras``, also the ``"shardopt"`` entry (master weights of 16-bit parameters, loss scaler).
    ``call``: the name the ranks agree on and messages use (``consolidate_state_dict`` gathers so).

    Every rank must call it. Gathered one parameter at a time: besides the result on rank ``to``
    (on the CPU, fp32), each rank holds at most three fp32 copies of the largest parameter.
    Parameters with ``requires_grad=False`` get no state, as in AdamW."""
    with opt.internals.comm.during(f"{call}()"):
        settle(opt, call)
        return _gather_state(opt, to, extras)


def _gather_state(opt: ShardedOptimizer, to: int, extras: bool) -> dict[str, Any]:
    """``full_state_dict`` once every rank is in the call. Every rank."""
    comm = opt.internals.comm
    keep = comm.rank == to
    where, defaults = _locations(opt), adamw_defaults()
    state: dict[int, dict[str, Tensor]] = {}
    masters: dict[int, Tensor] = {}
    shards = {id(b): b.master.fp32() for b in opt.internals.buffers if extras and _keeps_master(opt, b)}
    # fp32, whatever the moments mode; a Muon buffer's one moment is its momentum buffer
    decoded = {id(b): b.moments.fp32()[:1] if b.rule == "muon" else b.moments.fp32() for b in opt.internals.buffers}
    groups, index = [], 0
    for g in opt.param_groups:
        ids = []
        for p in g["params"]:
            if id(p) in where:
                b, i = where[id(p)]
                moments = [_gather(b, i, t, b.comm) for t in decoded[id(b)]]  # over the buffer's own group
                shape = b.layout.params[i].shape
                if id(b) in shards:
                    master = _gather(b, i, shards[id(b)], b.comm)
                    if keep:
                        masters[index] = master.view(shape).cpu()
                steps = opt.internals.progress.step - b.records[i].lag
                if keep and steps > 0 and b.rule == "muon":  # torch.optim.Muon's state
                    state[index] = {"momentum_buffer": moments[0].view(shape).cpu()}
                elif keep and steps > 0:  # AdamW has no state for a parameter it never updated
                    state[index] = {"step": torch.tensor(float(steps), dtype=torch.float32),
                                    "exp_avg": moments[0].view(shape).cpu(), "exp_avg_sq": moments[1].view(shape).cpu()}
                    if len(moments) > 2 and g.get("amsgrad"):  # torch keeps it for amsgrad groups only
                        state[index]["max_exp_avg_sq"] = moments[2].view(shape).cpu()
            ids.append(index)
            index += 1
        muon = g.get("use_muon", False) is not False  # a ShardedMuon's Muon group: torch.optim.Muon's keys
        groups.append({**({} if muon else defaults), **{k: v for k, v in g.items() if k not in ("params", "process_group")},
                       "params": ids})
    if not keep:
        return {}
    out: dict[str, Any] = {"state": state, "param_groups": groups}
    if extras:
        out["shardopt"] = {"master": masters, "loss_scaler": opt.internals.scaler.state_dict(),
                           "skipped_steps": opt.skipped_steps, "seed": opt.config.seed}
    return out


def _gather(b: FlatGroup, i: int, shard: Tensor, comm: Comm) -> Tensor:
    """Parameter ``i``'s slice of the flat fp32 state ``shard`` (this rank's shard), whole on every rank."""
    span = b.layout.params[i].global_range
    pieces = _param_pieces(b, i)
    out = torch.zeros(span.size, dtype=torch.float32, device=shard.device)
    mine, local = pieces[comm.shard_rank], b.records[i].local
    if local is not None:
        out[mine.as_slice()] = shard[local.as_slice()]
    comm.all_gather_inplace(out, pieces).wait()
    return out


def _header(sd: dict[str, Any]) -> dict[str, Any]:
    """The structure of an AdamW state dict (no tensor data), validated."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("expected a torch.optim.AdamW state dict with 'state' and 'param_groups' on rank 0, got "
                         f"{type(sd).__name__} with keys {sorted(sd) if isinstance(sd, dict) else '-'}")
    groups = [dict(g) for g in sd["param_groups"]]
    state: dict[int, tuple[tuple, tuple, float | None, bool]] = {}
    for idx, s in sd["state"].items():
        if not isinstance(idx, int) and not (isinstance(idx, str) and idx.isdigit()):
            continue  # an entry under another key (opt.state["my_key"]): not a parameter's
        if "momentum_buffer" in s:  # torch.optim.Muon's state (ShardedMuon); no step count
            state[int(idx)] = (tuple(s["momentum_buffer"].shape), tuple(s["momentum_buffer"].shape), None, False)
            continue
        missing = {"exp_avg", "exp_avg_sq", "step"} - set(s)
        if missing:
            raise ValueError(f"state of parameter #{idx} lacks {sorted(missing)}")
        state[int(idx)] = (tuple(s["exp_avg"].shape), tuple(s["exp_avg_sq"].shape), float(s["step"]),
                           "max_exp_avg_sq" in s)
    extra = sd.get("shardopt") or {}
    masters = {int(k): tuple(v.shape) for k, v in (extra.get("master") or {}).items()}
    return {"param_groups": groups, "state": state, "master": masters,
            "loss_scaler": extra.get("loss_scaler"), "skipped_steps": int(extra.get("skipped_steps", 0)),
            "seed": extra.get("seed")}


def load_full_state_dict(opt: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    """Load a ``torch.optim.AdamW``-format state dict (``full_state_dict``'s output, or a plain
    AdamW's) into ``opt`` at any world size.

    Every rank must call it; rank 0's ``state_dict`` is used (others may pass ``{}``) and sent one
    parameter at a time. Restores both moments, the step (the largest per-parameter step) and the
    param-group hyperparameters; parameters without state start with zero moments. AdamW keeps no
    master weights, so the master weights are set from the model's current weights (load those
    on every rank, before or after), except where the dict carries ``consolidate_state_dict``'s
    ``"shardopt"`` entry: its fp32 master weights and loss scaler are restored exactly."""
    with opt.internals.comm.during("load_full_state_dict()"):
        settle(opt, "load_full_state_dict")
        load_settled(opt, state_dict)


def load_settled(opt: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    """``load_full_state_dict`` once every rank is in the call (``settle``: its own, or
    ``load_state_dict``'s). Every rank."""
    if opt.internals.parts:
        raise ValueError("loading a torch.optim.AdamW-format state dict (load_full_state_dict, load_state_dict) "
                         "hands rank 0's dict to every rank, but this optimizer's ranks hold different parts of the "
                         "model (model_parallel_group, DTensor parameters or a param group's own process_group), which "
                         "one dict cannot describe; use "
                         "shardopt.save_checkpoint and shardopt.load_checkpoint, which keep each part apart")
    comm = opt.internals.comm
    header, error = None, None
    if comm.rank == 0:
        try:
            header = _header(state_dict)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            error = ValueError(str(e))
    header = agree(comm, error, header)[0]
    where = _locations(opt)
    numbered = [p for g in opt.param_groups for p in g["params"]]
    try:
        _check_structure(opt, header, numbered)
        error = None
    except ValueError as e:
        error = e
    agree(comm, error)
    with torch.no_grad():
        # fp32 moments to fill (the stored ones for fp32 moments), encoded at the end
        moments = {id(b): tuple(torch.zeros(b.layout.shard_numel, dtype=torch.float32, device=b.flat.device)
                                for _ in range(3 if b.amsgrad else 2)) for b in opt.internals.buffers}
        masters = {id(b): b.shard.float() for b in opt.internals.buffers}  # from the weights
        for idx in sorted(set(header["state"]) | set(header["master"])):
            p = numbered[idx]
            if id(p) not in where:
                continue  # frozen here: AdamW state for it is ignored
            b, i = where[id(p)]
            keys: tuple[str, ...] = ("momentum_buffer",) if b.rule == "muon" else ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
            saved_max = idx in header["state"] and header["state"][idx][3]
            # amsgrad here but not in the dict: the running maximum starts at the loaded exp_avg_sq
            keys = keys if b.amsgrad and saved_max else keys[:2] + ("exp_avg_sq",) if b.amsgrad else keys[:2]
            names = list(zip(keys, moments[id(b)])) if idx in header["state"] else []
            if idx in header["master"] and b.dtype != torch.float32:
                names.append(("master", masters[id(b)]))
            for name, shard in names:
                full = torch.empty(b.layout.params[i].numel, dtype=torch.float32, device=shard.device)
                if comm.rank == 0:
                    src = state_dict["shardopt"]["master"][idx] if name == "master" else state_dict["state"][idx][name]
                    full.copy_(src.reshape(-1))
                comm.broadcast(full, src=0).wait()
                local = b.records[i].local
                if local is not None:
                    in_param = _param_pieces(b, i)[comm.shard_rank]
                    shard[local.as_slice()] = full[in_param.as_slice()]
        for b in opt.internals.buffers:
            b.moments.load_(*moments[id(b)])
            b.load_master({"master": masters[id(b)]})
        for pending in [b.gather_params() for b in opt.internals.buffers]:
            pending.wait()
    ours, adamw_only = set(opt.defaults) | {k for g in opt.param_groups for k in g}, set(adamw_defaults())
    for g, saved in zip(opt.param_groups, header["param_groups"]):
        restore_group(g, saved, keys={k for k in saved if k in ours or k not in adamw_only})
    steps = [s for _, _, s, _ in header["state"].values() if s is not None]
    step = int(max(steps)) if steps else 0
    step_of = {id(numbered[idx]): int(s) for idx, (_, _, s, _) in header["state"].items() if s is not None}
    scaler = header["loss_scaler"]
    # a parameter's own step count, as AdamW keeps it (0 without state; Muon keeps none)
    resume(opt, step=step, lag_of=lambda b, r: 0 if b.rule == "muon" else step - step_of.get(id(r.leaf), 0),
                skipped_steps=header["skipped_steps"] if scaler is not None else None, seed=header["seed"],
                loss_scaler=scaler)


def _check_structure(opt: ShardedOptimizer, header: dict[str, Any], numbered: list[Tensor]) -> None:
    groups = header["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"state dict has {len(groups)} param groups, this optimizer {len(opt.param_groups)}")
    for gi, (g, mine) in enumerate(zip(groups, opt.param_groups)):
        if len(g["params"]) != len(mine["params"]):
            raise ValueError(f"param group {gi} has {len(g['params'])} parameters in the state dict, "
                             f"{len(mine['params'])} in this optimizer")
    for idx, shape in sorted(header["master"].items()):
        if not 0 <= idx < len(numbered) or tuple(numbered[idx].shape) != shape:
            raise ValueError(f"state dict has master weights of shape {shape} for parameter #{idx}, which this "
                             "optimizer does not have; was it saved for another model?")
    rule = {id(r.leaf): b.rule for b in opt.internals.buffers for r in b.records}
    for idx, (shape, shape_sq, step, _) in sorted(header["state"].items()):
        if not 0 <= idx < len(numbered):
            raise ValueError(f"state dict has state for parameter #{idx}; this optimizer has {len(numbered)}")
        saved_rule, ours = "adamw" if step is not None else "muon", rule.get(id(numbered[idx]))
        if ours is not None and saved_rule != ours:
            raise ValueError(f"state dict has {'Muon' if saved_rule == 'muon' else 'AdamW'} state for parameter #{idx}, "
                             f"which this optimizer updates with {'Muon' if ours == 'muon' else 'AdamW'}; give "
                             "each param group the rule it was saved with (\"use_muon\")")
        want = tuple(numbered[idx].shape)
        if shape != want or shape_sq != want:
            raise ValueError(f"state of parameter #{idx} has shape {shape}, this optimizer's parameter #{idx} has "
                             f"shape {want}; was it saved for another model or other param groups?")
