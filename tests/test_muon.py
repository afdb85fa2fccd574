"""ShardedMuon on real gloo ranks against torch.optim.Muon + torch.optim.AdamW in one process.

Every Muon matrix is owned whole by one rank; with the same data on every rank the averaged
gradient is the local one, so the Muon matrices and the AdamW parameters must come out bit for bit
as torch's at any world size and stage. Clipping breaks that for the AdamW parameters by an ulp:
the norm over shards cannot be summed in torch's order.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import shardopt
from models import batch, make_model

STEPS = 5
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW = dict(lr=5e-3, betas=(0.8, 0.99), weight_decay=0.0)


def _split(model):
    mats = [p for p in model.parameters() if p.dim() == 2]
    return mats, [p for p in model.parameters() if p.dim() != 2]


def _reference_grads(model, ranks, step):
    """The gradient averaged over the batches of ``ranks``, computed in this process."""
    grads = None
    for r in ranks:
        model.zero_grad(set_to_none=True)
        model(batch(r, step)).backward()
        g = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
        grads = g if grads is None else [a if a is None else a + b for a, b in zip(grads, g)]
    return [None if g is None else g / len(ranks) for g in grads]


def muon_case(stage: int, nesterov: bool, adjust_lr_fn, same_data: bool, clip: float | None) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=1)
    ref = copy.deepcopy(model)
    mats, rest = _split(model)
    opt = shardopt.ShardedMuon([{"params": mats}, {"params": rest, "use_muon": False, **ADAMW}], **MUON,
                               nesterov=nesterov, adjust_lr_fn=adjust_lr_fn, stage=stage, bucket_cap_mb=1e-4)
    ref_mats, ref_rest = _split(ref)
    ref_muon = torch.optim.Muon(ref_mats, **MUON, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ref_adamw = torch.optim.AdamW(ref_rest, **ADAMW)
    for step in range(STEPS):
        opt.zero_grad()
        opt.backward(model(batch(0 if same_data else rank, step)))
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        grads = _reference_grads(ref, [0] if same_data else range(world), step)
        for p, g in zip(ref.parameters(), grads):
            p.grad = g
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], clip)
        ref_muon.step()
        ref_adamw.step()
    ids = {id(p) for p in mats}
    muon_equal, muon_worst, adamw_worst = True, 0.0, 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        diff = (p.detach() - q.detach()).abs().max().item()
        if id(p) in ids:
            muon_equal &= torch.equal(p.detach(), q.detach())
            muon_worst = max(muon_worst, diff)
        else:
            adamw_worst = max(adamw_worst, diff)
    return muon_equal, muon_worst, adamw_worst


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_muon_matrices_are_torch_muon_bit_for_bit(pools, world_size):
    pool = pools(world_size)
    for stage in (1, 2):
        for nesterov in (True, False):
            for adjust in ("original", "match_rms_adamw"):
                results = pool.run(muon_case, stage, nesterov, adjust, True, None)
                for equal, worst, adamw_worst in results:
                    assert equal, (stage, nesterov, adjust, worst)
                    assert adamw_worst == 0.0, (stage, nesterov, adjust, adamw_worst)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_same_data_with_clipping_is_torch_to_the_clip_coefficients_last_bit(pools, world_size):
    """Measured at 1, 2 and 4 ranks, both stages: the Muon matrices still torch's bit for bit (the
    clip coefficient's last bit vanishes in bf16 Newton-Schulz), the AdamW parameters at most
    6e-8 (an ulp of numbers below 1) from torch's; the bound allows two ulps of O(1) numbers."""
    pool = pools(world_size)
    for stage in (1, 2):
        for _, worst, adamw_worst in pool.run(muon_case, stage, True, "original", True, 0.05):
            assert worst <= 1e-5 and adamw_worst <= 2.5e-7, (stage, worst, adamw_worst)


@pytest.mark.parametrize("world_size", [2, 4])
def test_different_data_per_rank_matches_torch_on_the_averaged_gradient(pools, world_size):
    pool = pools(world_size)
    for stage in (1, 2):
        for _, worst, adamw_worst in pool.run(muon_case, stage, True, None, False, None):
            assert worst <= 1e-5 and adamw_worst <= 2e-6, (stage, worst, adamw_worst)


def test_clipping_clips_the_gradient_before_newton_schulz(pools):
    pool = pools(2)
    for stage in (1, 2):
        for _, worst, adamw_worst in pool.run(muon_case, stage, True, "original", False, 0.05):
            assert worst <= 1e-5 and adamw_worst <= 2e-6, (stage, worst, adamw_worst)


def ownership_case() -> tuple[bool, int, int]:
    """Where the layout puts each Muon matrix: whole inside the shard of the rank the packing names."""
    model = make_model(seed=1)
    mats, rest = _split(model)
    opt = shardopt.ShardedMuon([{"params": mats}, {"params": rest, "use_muon": False}], stage=2)
    view = next(b for b in opt.inspect().buffers if b.rule == "muon")
    packing, layout = view.muon_packing, view.layout
    piece_of = {i: b.piece(packing.owner[i]) for b in layout.buckets for i in b.params}  # the owner's piece
    whole = all(piece_of[i].start <= span.global_range.start and span.global_range.end <= piece_of[i].end
                for i, span in enumerate(layout.params))
    shapes_match = [tuple(p.shape) for p in view.params] == list(packing.shapes)
    return whole and shapes_match, packing.padding_numel, view.numel - view.param_numel


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_matrix_lies_whole_in_its_owners_shard(pools, world_size):
    for whole, padding, layout_padding in pools(world_size).run(ownership_case):
        assert whole and padding == layout_padding, (whole, padding, layout_padding)


def hybrid_case(stage: int) -> tuple:
    """A (2 replicas, 2 shards) mesh, same data everywhere: matrices owned inside each shard group,
    replicated across the groups, and still torch's Muon bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_model(seed=1)
    ref = copy.deepcopy(model)
    mats, rest = _split(model)
    opt = shardopt.ShardedMuon([{"params": mats}, {"params": rest, "use_muon": False, **ADAMW}], **MUON,
                               stage=stage, device_mesh=mesh)
    ref_mats, ref_rest = _split(ref)
    ref_muon, ref_adamw = torch.optim.Muon(ref_mats, **MUON), torch.optim.AdamW(ref_rest, **ADAMW)
    for step in range(STEPS):
        opt.zero_grad()
        opt.backward(model(batch(0, step)))
        opt.step()
        ref_muon.zero_grad()
        ref_adamw.zero_grad()
        ref(batch(0, step)).backward()
        ref_muon.step()
        ref_adamw.step()
    ids = {id(p) for p in mats}
    equal = all(torch.equal(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters())
                if id(p) in ids)
    adamw_worst = max((p.detach() - q.detach()).abs().max().item()
                      for p, q in zip(model.parameters(), ref.parameters()) if id(p) not in ids)
    return equal, adamw_worst


def test_hybrid_mesh_matches_torch_muon(pools):
    pool = pools(4)
    for stage in (1, 2):
        for equal, adamw_worst in pool.run(hybrid_case, stage):
            assert equal and adamw_worst == 0.0, (stage, adamw_worst)


def estimate_case(stage: int) -> tuple[dict, dict]:
    """What this rank holds, by category, against shardopt.estimate_memory for the Muon matrices
    (rule="muon") plus the AdamW parameters, from their shapes alone."""
    model = make_model(seed=1)
    mats, rest = _split(model)
    mats = [p for p in mats if p.requires_grad]
    opt = shardopt.ShardedMuon([{"params": mats}, {"params": rest, "use_muon": False, **ADAMW}], **MUON,
                               stage=stage, bucket_cap_mb=1e-4)
    for step in range(2):
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()
    rep = opt.memory_report()
    keys = ("params", "grads", "master", "exp_avg", "exp_avg_sq", "extra")
    world, rank = dist.get_world_size(), dist.get_rank()
    est = [shardopt.estimate_memory(None, world, stage, "fp32", torch.float32, param_shapes=[tuple(p.shape) for p in ps],
                                    rank=rank, backend="gloo", bucket_cap_mb=1e-4, rule=rule).by_category()
           for ps, rule in ((mats, "muon"), (rest, "adamw"))]
    return {k: getattr(rep, k) for k in keys}, {k: sum(e[k] for e in est) for k in keys}


@pytest.mark.parametrize("world_size", [2, 4])
def test_memory_per_rank_is_the_estimate_to_the_byte(pools, world_size):
    for stage in (1, 2):
        for measured, estimated in pools(world_size).run(estimate_case, stage):
            assert measured == estimated, (stage, measured, estimated)


def bf16_momentum_case(stage: int) -> list:
    model = make_model(seed=1)
    mats, rest = _split(model)
    opt = shardopt.ShardedMuon([{"params": mats}, {"params": rest, "use_muon": False, **ADAMW}], **MUON,
                               moments="bf16", stage=stage, bucket_cap_mb=1e-4)
    for step in range(STEPS):
        opt.zero_grad()
        opt.backward(model(batch(0, step)))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_bf16_moments_do_not_depend_on_the_world_size(pools):
    """Muon's bf16 momentum is rounded elementwise by the matrix's owner, AdamW's bf16 moments with
    random bits keyed by the global element: the same data at 1, 2 and 4 ranks, the same weights."""
    for stage in (1, 2):
        one = pools(1).run(bf16_momentum_case, stage)[0]
        for world_size in (2, 4):
            for weights in pools(world_size).run(bf16_momentum_case, stage):
                assert all(torch.equal(a, b) for a, b in zip(weights, one)), (stage, world_size)


def fed_case(stage: int) -> tuple[bool, int]:
    """Different data per rank. Before each step the owner reads the averaged gradient of each
    matrix it owns out of the optimizer and feeds it to torch.optim.Muon on a copy of the matrix;
    after the step the matrix must equal that copy bit for bit."""
    rank = dist.get_rank()
    model = make_model(seed=1)
    mats, rest = _split(model)
    opt = shardopt.ShardedMuon([{"params": mats}, {"params": rest, "use_muon": False, **ADAMW}], **MUON,
                               stage=stage, bucket_cap_mb=1e-4)
    buf = next(b for b in opt.inspect().buffers if b.rule == "muon")
    runs = buf.shard_runs  # (local, global) of this rank's piece of each bucket

    def local_of(r):  # a global range inside one of this rank's pieces, in the shard's coordinates
        local, glob = next(run for run in runs if run[1].start <= r.start < run[1].end)
        return r.start - glob.start + local.start, r.end - glob.start + local.start

    owned = [(i, span) for i, span in enumerate(buf.layout.params)
             if any(g.start <= span.global_range.start < g.end for _, g in runs) and buf.params[i].requires_grad]
    copies = {i: buf.params[i].detach().clone().requires_grad_() for i, _ in owned}
    ref = torch.optim.Muon(list(copies.values()), **MUON) if copies else None
    equal = True
    for step in range(STEPS):
        opt.zero_grad()
        opt.backward(model(batch(rank, step)))
        grad = buf.local_grad
        for i, span in owned:
            start, end = local_of(span.global_range)
            copies[i].grad = grad[start:end].view(span.shape).clone()
        opt.step()
        if ref is not None:
            ref.step()
        equal &= all(torch.equal(buf.params[i].detach(), copies[i].detach()) for i, _ in owned)
    return equal, len(owned)


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_update_is_torch_muon_fed_the_averaged_gradient_bit_for_bit(pools, world_size):
    for stage in (1, 2):
        results = pools(world_size).run(fed_case, stage)
        assert all(equal for equal, _ in results), (stage, results)
        assert sum(n for _, n in results) == 3, results  # each trainable matrix (emb = head, fc1, fc2) owned once


def named_errors_case() -> dict:
    """Errors of a ShardedMuon, on every rank: at construction over frozen parameters only and with a
    setting that differs across ranks, then a copy and a step once closed; each names ShardedMuon."""
    got = {}
    for key, build in (("frozen", lambda: shardopt.ShardedMuon([torch.zeros(2, 3)])),
                       ("differs", lambda: shardopt.ShardedMuon(_split(make_model(seed=1))[0],
                                                                 seed=dist.get_rank()))):
        try:
            build()
            got[key] = "no error"
        except ValueError as e:
            got[key] = str(e)
    mats = [p for p in make_model(seed=1).parameters() if p.dim() == 2]
    opt = shardopt.ShardedMuon(mats)
    try:
        copy.deepcopy(opt)
    except TypeError as e:
        got["copy"] = str(e)
    opt.close()
    try:
        opt.step()
    except RuntimeError as e:
        got["closed"] = str(e)
    return got


def test_construction_and_lifetime_errors_name_sharded_muon(pools):
    for r, got in enumerate(pools(2).run(named_errors_case)):
        assert "ShardedMuon got 1 parameters ((2, 3) torch.float32) and none with requires_grad" in got["frozen"], got
        assert "ShardedMuon settings differ across ranks: seed is 0 on rank 0 but 1 on rank 1" in got["differs"], got
        assert "a ShardedMuon is not supported" in got["copy"] and "build a new ShardedMuon" in got["copy"], got
        assert "(ShardedMuon) no longer trains, it is closed; build a new ShardedMuon" in got["closed"], got
        assert not any("ShardedAdamW" in m for m in got.values()), (r, got)
