"""``offload="cpu"`` on real gloo ranks: the same weights and optimizer state, bit for bit, as
``offload=None``, and checkpoints that move between offloaded and plain runs.

Catches: a host copy of the gradient taken before the last round landed or before several rounds
were summed (accumulation under no_sync and two backward passes per step), a clip coefficient or
loss scale the host update does not see, a skipped step that still moves the host state, host
weights that do not reach the model before the gather, and a checkpoint whose load leaves the host
copies at their initial values (the first step after it would revert the loaded weights)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import shardopt
from models import batch, make_model, param_groups
from shardopt.checkpoint import load_checkpoint, save_checkpoint

POOL = 4  # one pool; smaller worlds are subgroups of its first ranks
CLIP = 0.05  # below the gradient norm of these models: clipping bites at every step
STEPS = 3
_GROUPS: dict[int, object] = {}


def _group(world: int):
    """The process group of the pool's first ``world`` ranks, None outside it (collective)."""
    if world not in _GROUPS:
        _GROUPS[world] = dist.new_group(list(range(world)))
    return _GROUPS[world] if dist.get_rank() < world else None


def _in_group(world: int, fn, *args):
    torch._dynamo.config.recompile_limit = 64  # many modes in one process: keep every kernel compiled
    group = _group(world)
    return None if group is None else fn(group, *args)


def _run(pools, world: int, fn, *args) -> list:
    return pools(POOL).run(_in_group, world, fn, *args)[:world]


def _build(group, cfg: tuple, offload: str | None, seed: int = 3):
    rule, dtype, stage, master, moments, overflow, *fraction = cfg
    model = make_model(seed=seed, dtype=getattr(torch, dtype))
    common = dict(stage=stage, master_weights=master, moments=moments, bucket_cap_mb=1e-4, process_group=group,
                  offload=offload, loss_scale=shardopt.DynamicScaler(init_scale=2.0**8) if overflow else "auto",
                  offload_fraction=fraction[0] if fraction and offload else 1.0)
    if rule == "muon":
        mats = [p for p in model.parameters() if p.dim() == 2 and p.requires_grad]
        rest = [p for p in model.parameters() if p.dim() != 2]
        opt = shardopt.ShardedMuon([{"params": mats}, {"params": rest, "use_muon": False, "lr": 5e-3}],
                                   lr=0.02, **common)
    else:  # "amsgrad": AdamW with its running maximum, a third moment tensor in the host buffer
        opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, weight_decay=0.1, amsgrad=rule == "amsgrad",
                                    **common)
    return model, opt


def _train(model, opt, steps, group, overflow: bool = False, same_data: bool = False) -> list:
    """Each step: a micro-batch under no_sync, then two backward passes that each reduce, a clip
    that bites, the step. With ``overflow`` the last rank's loss overflows fp16 at step 1; with
    ``same_data`` every rank trains on rank 0's batches."""
    rank, last = dist.get_rank(group), dist.get_world_size(group) - 1
    rank = 0 if same_data else rank
    seen = []
    for step in steps:
        opt.zero_grad()
        with opt.no_sync():
            opt.backward(model(batch(rank, 3 * step)))
        opt.backward(model(batch(rank, 3 * step + 1)))
        loss = model(batch(rank, 3 * step + 2))
        opt.backward(loss * 1e4 if overflow and step == 1 and rank == last else loss)
        norm = float(opt.clip_grad_norm_(CLIP))
        opt.step()
        seen.append((opt.step_was_skipped, norm > CLIP or opt.step_was_skipped))
    return seen


def _state(model, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for b in opt.inspect().buffers:
        out.append(b.master_fp32.clone())
        out += [t.clone() for t in b.moment_tensors.values()]
    return out


def pair_case(group, configs: list[tuple], kernel: str) -> dict:
    """For each config, train with and without offload: the bit-identity and what each step saw.
    ``kernel="fused"`` (a compile failure raises): the compiled kernels must run on the host
    buffer's tensors as on any others."""
    os.environ["SHARDOPT_KERNEL"] = kernel
    try:
        return _pairs(group, configs)
    finally:
        os.environ["SHARDOPT_KERNEL"] = "reference"


def _pairs(group, configs: list[tuple]) -> dict:
    out = {}
    for cfg in configs:
        runs = []
        for offload in ("cpu", None):  # offloaded first: its kernels compile for the host buffer's tensors
            model, opt = _build(group, cfg, offload)
            seen = _train(model, opt, range(STEPS), group, overflow=cfg[-1])
            kernels = {m.kernels.name for b in opt._buffers for m in getattr(b.master, "parts", [b.master])}
            report = opt.memory_report()  # with offload_fraction < 1: part of the state, not all, on the host
            share = report.host_state / report.optimizer_state if report.optimizer_state else 1.0
            runs.append((seen, _state(model, opt), opt.step_count, opt.skipped_steps, kernels, share))
        (seen1, state1, *counts1), (seen0, state0, *counts0) = runs
        same = len(state0) == len(state1) and all(torch.equal(a, b) for a, b in zip(state0, state1))
        out[cfg] = (same, seen0, seen1, counts0, counts1)
    return out


# (rule ("adamw", "amsgrad" or "muon"), dtype, stage, master_weights, moments, fp16 overflow at step 1[, offload_fraction])
CONFIGS = {
    1: [("adamw", "bfloat16", 2, "remainder", "8bit", False), ("adamw", "bfloat16", 1, "fp32", "bf16", False),
        ("adamw", "float16", 2, "fp32", "fp32", True), ("muon", "bfloat16", 2, "fp32", "fp32", False),
        ("adamw", "bfloat16", 2, "remainder", "8bit", False, 0.5), ("muon", "bfloat16", 1, "remainder", "bf16", False, 0.5)],
    2: [("adamw", "bfloat16", 1, "remainder", "fp32", False), ("adamw", "bfloat16", 2, "fp32", "8bit", False),
        ("adamw", "float32", 2, "fp32", "bf16", False), ("adamw", "float16", 1, "fp32", "fp32", True),
        ("muon", "bfloat16", 1, "remainder", "bf16", False), ("muon", "float32", 2, "fp32", "fp32", False),
        ("adamw", "float16", 2, "fp32", "fp32", True, 0.5), ("adamw", "bfloat16", 1, "fp32", "fp32", False, 0.3),
        ("amsgrad", "bfloat16", 2, "remainder", "bf16", False, 0.5)],
    4: [("adamw", "bfloat16", 2, "remainder", "bf16", False), ("adamw", "float32", 1, "fp32", "8bit", False),
        ("adamw", "float16", 2, "fp32", "fp32", True), ("muon", "bfloat16", 2, "fp32", "fp32", False)],
}


@pytest.mark.parametrize("world", sorted(CONFIGS))
def test_offload_is_bit_identical_to_no_offload(pools, world):
    shares: dict[tuple, list[float]] = {}
    # One rank compiles the fused kernels for every mode of its list; more ranks run the reference
    # (the same numbers, see tests/test_kernels.py) to spare each of them the compile.
    kernel = "fused" if world == 1 else "reference"
    for rank, results in enumerate(_run(pools, world, pair_case, CONFIGS[world], kernel)):
        for cfg, (same, seen0, seen1, plain, offloaded) in results.items():
            (steps0, skips0, _, _), (steps1, skips1, kernels, host_share) = plain, offloaded
            assert same, f"rank {rank}, {cfg}: offload='cpu' differs from offload=None"
            assert seen0 == seen1 and (steps0, skips0) == (steps1, skips1), (rank, cfg, seen0, seen1, plain, offloaded)
            assert kernels == {kernel}, (rank, cfg, kernels)  # world 1: the offloaded state in compiled kernels
            # all of the state on the host, or with offload_fraction at least one bucket's
            assert (0 < host_share <= 1) if len(cfg) > 6 else host_share == 1, (rank, cfg, host_share)
            shares.setdefault(cfg, []).append(host_share)
            assert all(bites for _, bites in seen0), (cfg, seen0)  # clipping bit at every step taken
            skipped = [s for s, _ in seen0]
            assert skipped == [False, cfg[5], False], (rank, cfg, skipped)  # the overflow skips on every rank
    for cfg, by_rank in shares.items():  # a fraction splits some rank's shard between host and accelerator
        assert len(cfg) == 6 or any(0 < share < 1 for share in by_rank), (cfg, by_rank)


# -- checkpoints between offloaded and plain runs ----------------------------------------------
K = 2  # save after K steps, compare after STEPS
CKPT = {"adamw": ("adamw", "bfloat16", 2, "remainder", "bf16", False),
        "muon": ("muon", "bfloat16", 2, "fp32", "fp32", False),
        "adamw-half-offloaded": ("adamw", "bfloat16", 2, "remainder", "8bit", False, 0.5)}


def save_case(group, root: str, offload: str | None) -> dict:
    """Train K steps, save, go on to STEPS: the uninterrupted run's weights (rank 0's)."""
    out = {}
    for name, cfg in CKPT.items():
        model, opt = _build(group, cfg, offload)
        _train(model, opt, range(K), group, same_data=True)
        save_checkpoint(os.path.join(root, name), model, opt)
        _train(model, opt, range(K, STEPS), group, same_data=True)
        out[name] = [p.detach().clone() for p in model.parameters()]
    return out


def load_case(group, root: str, offload: str | None) -> dict:
    """Load into a model built from other weights, go on to STEPS."""
    out = {}
    for name, cfg in CKPT.items():
        model, opt = _build(group, cfg, offload, seed=4)
        load_checkpoint(os.path.join(root, name), model, opt)
        _train(model, opt, range(K, STEPS), group, same_data=True)
        out[name] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.parametrize("save,load", [((2, "cpu"), (1, None)), ((1, None), (2, "cpu"))])
def test_checkpoint_moves_between_offloaded_and_plain_runs(pools, tmp_path, save, load):
    """Saved at one world size with or without offload, loaded at another the other way: the run
    goes on exactly as the uninterrupted one (every rank trains on the same batches, so the
    world size does not change the averaged gradient)."""
    (save_world, save_offload), (load_world, load_offload) = save, load
    uninterrupted = _run(pools, save_world, save_case, str(tmp_path), save_offload)[0]
    for rank, got in enumerate(_run(pools, load_world, load_case, str(tmp_path), load_offload)):
        for name, weights in uninterrupted.items():
            assert all(torch.equal(a, b) for a, b in zip(weights, got[name])), (rank, name)


# -- where the bytes are -------------------------------------------------------------------------
def memory_case(group) -> dict:
    """What one rank holds with offload, from the tensors themselves, beside the report and the estimate."""
    model = make_model(seed=3, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(param_groups(model), master_weights="remainder", moments="8bit", bucket_cap_mb=1e-4,
                                process_group=group, offload="cpu")
    _train(model, opt, range(1), group)
    report, out = opt.memory_report(), {}
    (buf,) = opt.inspect().buffers
    lo = buf.host_buffer.data_ptr()
    hi = lo + buf.host_buffer.numel()
    state = [buf.master_copy] if buf.master_copy is not None else []
    state += list(buf.moment_tensors.values()) + [opt._buffers[0].master.rem_lo, opt._buffers[0].master.rem_hi]
    views = [t for b in buf.buckets for t in (b.host.weights, b.host.gradient)]
    out["outside"] = [(t.numel(), t.dtype, t.data_ptr() - lo) for t in state + views if t.numel() and not (
        t.device.type == "cpu" and lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi)]
    out["host"], out["held"] = report.host, buf.host_buffer.numel()
    out["state"] = sum(t.numel() * t.element_size() for t in state)
    out["copies"] = report.host_copies
    out["shard"] = buf.shard_numel
    out["report"] = (report.master + report.exp_avg + report.exp_avg_sq + report.extra, report.accelerator,
                     report.total, report.optimizer_state)
    est = shardopt.estimate_memory(None, dist.get_world_size(group), 2, "remainder", torch.bfloat16, moments="8bit",
                                   param_shapes=[tuple(p.shape) for p in model.parameters() if p.requires_grad],
                                   bucket_cap_mb=1e-4, offload="cpu")
    out["estimate"] = (est.host, est.accelerator, est.total)
    return out


def test_offloaded_bytes_are_one_host_buffer_as_reported_and_estimated(pools):
    for rank, got in enumerate(_run(pools, 2, memory_case)):
        assert not got["outside"], (rank, got["outside"])  # state, copies, every bucket's views: one allocation
        assert got["host"] == got["held"]
        # bf16 weights and gradient copies: 2 + 2 bytes per shard element; state: the strategies' own tensors
        assert got["copies"] == 4 * got["shard"]
        assert got["report"][0] == got["state"]
        assert 0 <= got["held"] - got["state"] - got["copies"] <= 64 * 8, got  # alignment room only
        state, accelerator, total, optimizer_state = got["report"]
        assert accelerator == total - optimizer_state
        est_host, est_accelerator, _ = got["estimate"]
        assert est_host == got["state"] + got["copies"], (est_host, got)  # exact, padding aside


@pytest.mark.parametrize("value", ["gpu", "CPU", True, "nvme"])
def test_an_unknown_offload_target_is_refused_naming_the_choices(value):
    with pytest.raises(ValueError, match=r"unknown offload=.*choose None .* or 'cpu'"):
        shardopt.ShardedAdamW(make_model().parameters(), offload=value)
    with pytest.raises(ValueError, match=r"offload must be None or 'cpu'"):
        shardopt.estimate_memory(1000, 2, offload=value)


def consolidated_save_case(group, root: str) -> dict:
    """Offloaded: K steps, ``consolidate_state_dict`` and ``state_dict()`` saved by rank 0 beside
    the weights (as frameworks save), then on to STEPS: the uninterrupted weights."""
    model, opt = _build(group, CKPT["adamw"], "cpu")
    _train(model, opt, range(K), group, same_data=True)
    opt.consolidate_state_dict()
    if dist.get_rank(group) == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, os.path.join(root, "consolidated.pt"))
    _train(model, opt, range(K, STEPS), group, same_data=True)
    return {"end": [p.detach().clone() for p in model.parameters()]}


def consolidated_load_case(group, root: str, offload: str | None) -> dict:
    model, opt = _build(group, CKPT["adamw"], offload, seed=4)
    saved = torch.load(os.path.join(root, "consolidated.pt"), weights_only=True)
    opt.load_state_dict(saved["optim"])
    model.load_state_dict(saved["model"])
    _train(model, opt, range(K, STEPS), group, same_data=True)
    return {"end": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_consolidated_state_dict_of_an_offloaded_run_resumes_elsewhere(pools, tmp_path, offload):
    """Saved from 2 offloaded ranks the way frameworks save (rank 0's consolidated state dict),
    loaded on 1 rank with or without offload: the run goes on as the uninterrupted one."""
    uninterrupted = _run(pools, 2, consolidated_save_case, str(tmp_path))[0]["end"]
    got = _run(pools, 1, consolidated_load_case, str(tmp_path), offload)[0]["end"]
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, got))


def hybrid_case(offload: str | None) -> list[torch.Tensor]:
    """A (2 replicas, 2 shards) device mesh over the pool's 4 ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_model(seed=3, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, master_weights="remainder", bucket_cap_mb=1e-4,
                                device_mesh=mesh, offload=offload)
    _train(model, opt, range(STEPS), None)
    return _state(model, opt)


def test_offload_on_a_hybrid_mesh_is_bit_identical(pools):
    pool = pools(POOL)
    for rank, (plain, offloaded) in enumerate(zip(pool.run(hybrid_case, None), pool.run(hybrid_case, "cpu"))):
        assert all(torch.equal(a, b) for a, b in zip(plain, offloaded)), rank


def rank_state_case(group) -> dict:
    """This rank's own state dict (``opt.state_dict()``, same world size) of a run that offloads half
    of its buckets, loaded into a fresh one: the run goes on as the uninterrupted one."""
    cfg = ("adamw", "bfloat16", 2, "remainder", "8bit", False, 0.5)
    model, opt = _build(group, cfg, "cpu")
    _train(model, opt, range(K), group)
    saved = {"optim": opt.state_dict(), "model": {k: v.clone() for k, v in model.state_dict().items()}}
    _train(model, opt, range(K, STEPS), group)
    resumed, opt2 = _build(group, cfg, "cpu", seed=4)
    opt2.load_state_dict(saved["optim"])
    resumed.load_state_dict(saved["model"])
    _train(resumed, opt2, range(K, STEPS), group)
    return {"same": all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))}


def test_rank_state_dict_of_a_partly_offloaded_run_resumes_exactly(pools):
    assert all(r["same"] for r in _run(pools, 2, rank_state_case))


@pytest.mark.parametrize("kwargs, match", [
    (dict(offload="cpu", offload_fraction=0), r"offload_fraction must be a number in \(0, 1\]"),
    (dict(offload="cpu", offload_fraction=1.5), r"offload_fraction must be a number in \(0, 1\]"),
    (dict(offload="cpu", offload_fraction=True), r"offload_fraction must be a number in \(0, 1\]"),
    (dict(offload_fraction=0.5), r"offload_fraction=0.5 applies with offload='cpu'"),
])
def test_an_offload_fraction_out_of_range_or_without_offload_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        shardopt.ShardedAdamW(make_model().parameters(), **kwargs)


def test_the_estimate_puts_the_state_on_the_host_with_offload(capsys):
    from shardopt.estimate.__main__ import main as cli_main

    assert cli_main(["--params", "7B", "--world-size", "1", "8", "--stage", "2", "--master-weights", "fp32",
                     "--offload"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| stage 2, fp32, offload='cpu'")]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    # columns: scheme, params, grads, master, moments, extra, buffers, accelerator GiB, B/param, host GiB, ...
    for (world, cell) in zip((1, 8), cells):
        gib = 7e9 / world / 2**30
        assert cell[9] == f"{16 * gib:,.2f}"  # master 4 + moments 8 + weight copy 2 + gradient copy 2, sharded
        buffers = float(cell[6])
        assert abs(float(cell[7]) - (7e9 * 2 / 2**30 + 2 * gib + buffers)) < 0.02  # weights + gradient shard


def outside_write_case(group, offload: str | None) -> list[torch.Tensor]:
    """Weights written from outside between steps (``model.load_state_dict``, then an in-place write
    to one parameter): the next steps must start from them, so the host copy has to follow."""
    cfg = ("adamw", "bfloat16", 2, "remainder", "bf16", False, 0.5)
    model, opt = _build(group, cfg, offload)
    _train(model, opt, range(1), group)
    model.load_state_dict(make_model(seed=7, dtype=torch.bfloat16).state_dict())
    _train(model, opt, range(1, 2), group)
    with torch.no_grad():
        model.fc1.weight.mul_(0.5)
    _train(model, opt, range(2, STEPS), group)
    return _state(model, opt)


def test_weights_written_from_outside_reach_the_host_copy(pools):
    plain, offloaded = (_run(pools, 2, outside_write_case, o) for o in (None, "cpu"))
    for rank, (a, b) in enumerate(zip(plain, offloaded)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), rank


def test_the_frameworks_take_offload_as_a_shardopt_option():
    """Lightning's strategy checks its options against ShardedAdamW's keyword-only arguments; the
    Trainer and Accelerate pass theirs through to the converted optimizer in the same way."""
    from shardopt.integrations.lightning import ShardedStrategy

    strategy = ShardedStrategy(stage=2, offload="cpu", offload_fraction=0.5)
    assert strategy.shardopt_options == dict(stage=2, master_weights="fp32", offload="cpu", offload_fraction=0.5)
    with pytest.raises(TypeError, match="unknown options"):
        ShardedStrategy(offload_ratio=0.5)
