"""What every rank must build and call alike, and how a difference is reported.

The construction check gathers one description per rank (an error, or the settings followed by
the parameters); ``raise_first_difference`` turns the first difference into a ValueError that
names it with rank 0's and the other rank's values, raised on every rank alike.
"""
from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Protocol, Sequence

import torch

from shardopt.comm._collectives import global_rank, group_ranks
from shardopt.comm._messages import digest_code, digests_agree
from shardopt.core._config import trainable_params
from shardopt.step._loss_scale import make_scaler

if TYPE_CHECKING:
    from shardopt.comm._collectives import Comm
    from shardopt.comm._model_parts import ModelParts
    from shardopt.core._config import ShardConfig

    class _Built(Protocol):
        """What construction's agreement reads of the ShardedAdamW being built (a floor up: named by use)."""

        config: ShardConfig
        param_groups: list[dict[str, Any]]

def settings(opt: _Built, comm: Comm, parts: ModelParts, loss_scale: object,
             dtypes: set[torch.dtype]) -> dict[str, object]:
    """What must be equal on every rank besides the parameters: the sharding settings, the model's
    axes (``parts``), every group's hyperparameters and the loss scaler (each shapes the collectives
    or the math). Local."""
    c = opt.config
    scaler = make_scaler(loss_scale, dtypes)
    return {"stage": c.stage, "master_weights": c.master_weights, "moments": c.moments, "bucket_cap_mb": c.bucket_cap_mb,
            "accumulate_dtype": str(c.accumulate_dtype), "reduce_dtype": str(c.reduce_dtype),
            "overlap_param_gather": c.overlap_param_gather, "seed": c.seed, "timeout": c.timeout,
            "max_consecutive_skips": c.max_consecutive_skips,
            "mesh (replicas, shard size)": (comm.replicas, comm.shard_size),
            "model_parallel_group": tuple((a.name, a.size) for a in parts.axes.axes if a.name in parts.user_axes),
            "DTensor meshes": tuple((a.name, a.size) for a in parts.axes.axes if a.name in parts.dtensor_axes),
            "loss_scale": (type(scaler).__name__, scaler.state_dict()),
            **{f"param group {gi} {k}": v if k != "process_group" else f"a group of {len(group_ranks(v))} ranks"
               for gi, g in enumerate(opt.param_groups) for k, v in sorted(g.items()) if k not in ("params", "param_names")}}


def agree_on_params(opt: _Built, comm: Comm, parts: ModelParts, names: dict[int, str], loss_scale: object,
                    check: Callable[[], None] = lambda: None) -> list[tuple[torch.nn.Parameter, int]]:
    """(parameter, param-group index) of ``opt``'s trainable parameters, validated on every rank and
    compared across ranks with one small collective; any problem, local or a mismatch, raises on
    every rank (never a hang). ``parts``: the optimizer's ``ModelParts``, whose axes are compared
    too. ``check``: the update rule's own check of the param groups (raises TypeError or
    ValueError), run first. Parameters are compared by (group, shape, dtype) and,
    when named parameters were given, by name; two same-shape parameters swapped on one rank
    without names cannot be told apart. Every rank, at construction."""
    try:
        check()
        trainable, error = trainable_params(opt.param_groups, type(opt).__name__), None
        named = any(g.get("param_names") for g in opt.param_groups)
        desc: list = [(gi, tuple(p.shape), str(p.dtype)) + ((names[id(p)],) if named else ()) for p, gi in trainable]
        own = settings(opt, comm, parts, loss_scale, {p.dtype for p, _ in trainable})
        desc.insert(0, ("settings", sorted(own.items())))
        tracked = {id(p) for p, _ in trainable}
        frozen = [(gi, tuple(p.shape), str(p.dtype)) for gi, g in enumerate(opt.param_groups)
                  for p in g["params"] if id(p) not in tracked]
        desc.append(("frozen", frozen))  # broadcast at construction: must match too
    except (TypeError, ValueError) as e:
        trainable, error, desc = [], e, [("error", type(e).__name__, str(e))]
    if comm.same_everywhere(desc) and error is None:
        return trainable
    raise_first_difference(comm.all_gather_objects(desc), comm.rank, type(opt).__name__)


def agree_on_building(error: TypeError | ValueError | None, comm: Comm, parts: ModelParts) -> None:
    """Raise on every rank of the job when some rank met ``error`` (this rank's, or None) building
    its part of the optimizer, after the data-parallel ranks agreed on the settings and the
    parameters: the ranks of a model axis build from their own pieces (a tensor-parallel split
    gives each position pieces of its own sizes, an uneven one an empty piece), which the
    data-parallel ranks' agreement does not compare, so a problem found with its own pieces may be
    one rank's. That rank raises its error, every other rank the same kind naming the first rank
    that met one (``on rank …: …``), rather than meeting that rank's absence at the next
    collective. One small all-reduce over the data-parallel group and each model axis; the
    messages travel (an all-gather over each) only when some rank failed. Every rank of the job."""
    flag = torch.tensor([1, (1 << 40) - global_rank()] if error is not None else [0, 0], dtype=torch.int64)
    comm.control_all_reduce(flag, "max").wait()
    parts.axes.reduce(flag, "max")
    if not flag[0]:
        return
    mine = [] if error is None else [(global_rank(), type(error).__name__, str(error))]
    found = [e for theirs in comm.all_gather_objects(mine) for e in theirs]
    for axis in parts.axes.axes:
        found = [e for theirs in axis.connected().all_gather_objects(found) for e in theirs]
    if error is not None:
        raise error
    first = (1 << 40) - int(flag[1])
    rank, kind, message = next(e for e in found if e[0] == first)
    raise (TypeError if kind == "TypeError" else ValueError)(f"on rank {rank}: {message}")


def raise_first_difference(every: list[list], rank: int, who: str = "ShardedAdamW") -> NoReturn:
    """Raise, on every rank alike, the first difference between rank 0's description and another
    rank's (``every``: each rank's ``[("settings", items), params..., ("frozen", params)]``, or
    ``[("error", kind, message)]``); ``who``: the optimizer's class name."""
    for r, other in enumerate(every):
        if other and other[0][0] == "error":
            kind = TypeError if other[0][1] == "TypeError" else ValueError
            raise kind(other[0][2] if r == rank else f"on rank {r}: {other[0][2]}")
    for r, other in enumerate(every):
        ours, theirs = dict(every[0][0][1]), dict(other[0][1])
        for key in sorted(set(ours) | set(theirs)):
            if ours.get(key) == theirs.get(key):
                continue
            if key == "model_parallel_group" and not (ours[key] and theirs[key]):
                given, without = (0, r) if ours[key] else (r, 0)
                raise ValueError(f"{who} settings differ across ranks: rank {given} passed model_parallel_group "
                                 f"(axes {dict(ours[key] or theirs[key])}), rank {without} did not; pass the same "
                                 "model_parallel_group (the ranks that hold the other parts of the model) on every "
                                 "rank")
            raise ValueError(f"{who} settings differ across ranks: {key} is {ours.get(key)!r} on rank 0 "
                             f"but {theirs.get(key)!r} on rank {r}; build the optimizer with the same "
                             "arguments on every rank")
    every = [other[1:] for other in every]
    ref = every[0]
    for r, other in enumerate(every):
        if other == ref:
            continue
        for which, mine, their in (("trainable", ref[:-1], other[:-1]), ("frozen", ref[-1][1], other[-1][1])):
            for i, (a, b) in enumerate(zip(mine, their)):
                if a != b:
                    raise ValueError(
                        f"parameter sets differ across ranks: {which} parameter #{i} is (group, shape, dtype"
                        f"{', name' if len(a) > 3 else ''})={a} on rank 0 but {b} on rank {r}; build the same model "
                        "and pass the same parameters in the same order, with the same requires_grad, on every rank")
            if len(mine) != len(their):
                raise ValueError(f"parameter sets differ across ranks: rank 0 has {len(mine)} {which} parameters, "
                                 f"rank {r} has {len(their)}; build the same model on every rank")
    raise AssertionError("unreachable: descriptions differ but no difference found")


# [Note: hyperparameters that differ across ranks]
# A hyperparameter changed on one rank only (``ReduceLROnPlateau.step(local_val_loss)``, a
# schedule driven by a rank-local count) trains each shard with its own value: the replicas stay
# equal, so nothing downstream can see it. The step's all-reduce therefore also carries a 32-bit
# digest of every group's lr, betas, eps and weight_decay (and the flags and Muon keys the update
# reads), cut into 4-bit chunks d (values 0..15), each sent as (d, d*d) when summed and (d, -d)
# when maxed. Summed over n ranks, a chunk is equal on every rank exactly when
# n * sum(d*d) == sum(d)**2 (Cauchy-Schwarz; exact in doubles from sums that stay below 2**24,
# exact in fp32, up to 74,000 ranks); maxed, when max(d) == -max(-d). The test reads the reduced
# message alone, so a rank with no digest of its own (a rank shadowing the others inside a Join,
# which adds zeros and is not counted in n) sees a difference exactly as the others do. The ranks
# then exchange their values (only on that error path) to name the group, the key and both values.
HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "momentum", "nesterov",
              "ns_coefficients", "ns_steps", "adjust_lr_fn")  # AdamW's, then Muon's
def hyperparameters(param_groups: list[dict[str, Any]]) -> list[tuple[int, str, Any]]:
    """(group index, key, value as plain floats) of every hyperparameter the update reads. Local."""
    def plain(v: Any) -> Any:
        if isinstance(v, (tuple, list)):
            return tuple(plain(x) for x in v)
        return repr(v) if v is None or isinstance(v, str) else float(v)  # adjust_lr_fn is a name or None
    return [(gi, k, plain(g[k])) for gi, g in enumerate(param_groups) for k in HYPER_KEYS if k in g]


def hyper_code(values: list[tuple[int, str, Any]], maxed: bool) -> list[float]:
    """This rank's ``StepMessage.hyper`` (see [Note: hyperparameters that differ across ranks])."""
    return digest_code(zlib.crc32(repr(values).encode()), maxed)


def hyperparameters_agree(reduced: Sequence[float], ranks: int, maxed: bool) -> bool:
    """Whether ``reduced`` (``ranks`` ranks' ``hyper_code``, summed or maxed) shows the same digest
    from every one of them. A question, from the reduced message alone."""
    return digests_agree(reduced, ranks, maxed)


def check_unchanged_since_compared(compared: object, param_groups: list[dict[str, Any]]) -> None:
    """Beside torchft: raise RuntimeError when the hyperparameters this step uses are not the ones
    the replica groups compared before the last round (``compared``; None: nothing compared, or a
    load since), as an lr written between backward and ``step()`` would be (see comm._replicas
    [Note: replicas through torchft]). Every rank of the group alike (its ranks agree on them)."""
    if compared is not None and compared != hyperparameters(param_groups):
        raise RuntimeError(
            "a hyperparameter (learning rate, weight decay, betas) changed between this step's backward pass "
            "and step(): the replica groups under torchft compared the values of the backward pass, so the "
            "new ones may differ between groups and part their states. Set hyperparameters before the "
            "backward pass (an lr scheduler in a step post hook: "
            "optimizer.register_step_post_hook(lambda *_: scheduler.step())); this group applies nothing "
            "and restarts from a live group")


def check_hyperparameters_agree(reduced: Sequence[float], values: list[tuple[int, str, Any]] | None, comm: Comm,
                                maxed: bool, joined: int = 0) -> None:
    """Raise ValueError, on every rank alike, when ``reduced`` (every rank's ``hyper_code``, summed
    or maxed) shows a hyperparameter that differs across ranks, naming the first one. ``joined``
    ranks (``values`` None there) added no digest. Every rank."""
    if hyperparameters_agree(reduced, 1 if maxed else comm.world_size - joined, maxed):
        return
    every = [(r, v) for r, v in enumerate(comm.all_gather_objects(values)) if v is not None]
    first_rank, first = every[0]
    for r, theirs in every:
        for (gi, key, ours), (_, _, other) in zip(first, theirs):
            if ours != other:
                raise ValueError(
                    f"hyperparameters differ across ranks at this step: param group {gi} {key} is {ours!r} on rank "
                    f"{first_rank} but {other!r} on rank {r}, so each rank would update its shard with its own value. "
                    "Change hyperparameters alike on every rank (e.g. give ReduceLROnPlateau.step a metric averaged "
                    "over ranks with torch.distributed.all_reduce)")
    raise ValueError("hyperparameters differ across ranks at this step (the param groups differ in number)")


def adopt_hyperparameters(param_groups: list[dict[str, Any]], values: list[tuple[int, str, Any]] | None,
                          comm: Comm) -> None:
    """Inside a Join, at every step while some rank is joined: every rank sends its hyperparameters
    (a joined rank None) and a joined rank takes the first other rank's into its param groups (its
    scheduler stopped with its inputs, the others' went on), so that it updates its shard as they
    update theirs. Every rank."""
    every = [v for v in comm.all_gather_objects(values) if v is not None]
    if values is not None or not every:
        return
    for gi, key, value in every[0]:
        g = param_groups[gi]
        if isinstance(g.get(key), torch.Tensor):
            g[key].fill_(value)
        elif key in ("betas", "ns_coefficients"):
            g[key] = tuple(value)
        elif key == "adjust_lr_fn":
            g[key] = None if value == "None" else value.strip("'")
        else:
            g[key] = type(g[key])(value) if isinstance(g.get(key), (bool, int)) else value
