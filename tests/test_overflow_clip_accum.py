"""Tier 2: fp16 overflow handling, global gradient clipping and gradient accumulation on gloo ranks.

Catches a step that updates on one rank but not the other after an overflow, a loss scale that
does not react or never recovers, a clip norm computed from the local shard only, clipping that
differs from torch's, micro-batches lost under no_sync (stage 2 especially), and 16-bit gradients
accumulated in 16 bits.
"""
from __future__ import annotations

import copy
import math
import warnings

import torch
import torch.distributed as dist

import shardopt
from models import batch, make_model, param_groups


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def overflow_case(stage: int, poison: str) -> dict:
    """Rank 1 alone produces inf (huge loss) or NaN gradients at step 1."""
    rank = dist.get_rank()
    model = make_model(seed=4, dtype=torch.float16)
    auto = shardopt.ShardedAdamW(make_model(dtype=torch.float16).parameters(), loss_scale="auto")
    out = {"initial_scale": auto.loss_scale}
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=stage, bucket_cap_mb=1e-4,
                                loss_scale=shardopt.DynamicScaler(init_scale=2.0**8))
    for step in range(3):
        before = _snapshot(model)
        loss = model(batch(rank, step))
        if step == 1 and rank == 1:
            loss = loss * (1e4 if poison == "inf" else float("nan"))
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        out[step] = (opt.step_was_skipped, changed, opt.loss_scale, opt.step_count)
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return out


def test_one_rank_overflow_skips_everywhere(pools):
    pool = pools(2)
    for stage in (1, 2):
        for poison in ("inf", "nan"):
            results = pool.run(overflow_case, stage, poison, timeout=60)
            for r in results:
                assert r["initial_scale"] == 2.0**16  # "auto" is dynamic for fp16
                assert r[0] == (False, True, 2.0**8, 1)
                assert r[1] == (True, False, 2.0**7, 1), r  # skipped, bit-identical weights, scale halved
                assert r[2] == (False, True, 2.0**7, 2)  # the next clean step updates
                assert r["finite"]


def storm_case() -> dict:
    rank = dist.get_rank()
    model = make_model(seed=5, dtype=torch.float16)
    scaler = shardopt.DynamicScaler(init_scale=16.0, min_scale=2.0, growth_interval=3)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, loss_scale=scaler)
    scales = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(12):
            loss = model(batch(rank, step))
            if step < 8 and rank == 0:
                loss = loss * float("inf")
            opt.zero_grad()
            opt.backward(loss)
            opt.step()
            scales.append(opt.loss_scale)
    at_min = [str(w.message) for w in caught if "minimum" in str(w.message)]
    return {"scales": scales, "warnings": at_min, "skipped": opt.skipped_steps, "steps": opt.step_count,
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def test_overflow_storm_reaches_minimum_warns_once_and_recovers(pools):
    for r in pools(2).run(storm_case, timeout=60):
        assert r["scales"][:8] == [8.0, 4.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
        assert r["scales"][8:] == [2.0, 2.0, 4.0, 4.0]  # grows after growth_interval clean steps
        assert len(r["warnings"]) == 1 and "step 4" in r["warnings"][0], r["warnings"]
        assert r["skipped"] == 8 and r["steps"] == 4 and r["finite"]


def _avg_grads(model, world, step):
    grads = None
    for r in range(world):
        model.zero_grad(set_to_none=True)
        model(batch(r, step)).backward()
        g = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
    return [g / world for g in grads]


def clip_case(stage: int, norm_type: float, max_norms: tuple[float, ...] = (0.05,)) -> tuple[float, float]:
    """Each step clipped with ``opt.clip_grad_norm_`` once per entry of ``max_norms`` (torch clips
    ``p.grad`` in place each time), against torch's clip on the averaged gradient: the worst relative
    difference of the returned norms and the worst weight difference after three steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=6)
    ref = copy.deepcopy(model)
    opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, stage=stage, bucket_cap_mb=1e-4)
    ref_opt = torch.optim.AdamW(param_groups(ref), lr=1e-2)
    worst_norm = 0.0
    for step in range(3):
        opt.zero_grad()
        opt.backward(model(batch(rank, step)))
        norms = [opt.clip_grad_norm_(m, norm_type=norm_type) for m in max_norms]
        opt.step()
        trainable = [p for p in ref.parameters() if p.requires_grad]
        for p, g in zip(ref.parameters(), _avg_grads(ref, world, step)):
            p.grad = g if p.requires_grad else None
        ref_norms = [torch.nn.utils.clip_grad_norm_(trainable, m, norm_type=norm_type) for m in max_norms]
        ref_opt.step()
        for norm, ref_norm in zip(norms, ref_norms):
            worst_norm = max(worst_norm, abs(norm.item() - ref_norm.item()) / ref_norm.item())
    worst = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return worst_norm, worst


def test_clip_grad_norm_matches_torch(pools):
    pool = pools(2)
    for stage in (1, 2):
        for norm_type in (2.0, math.inf):
            for rel_norm, worst in pool.run(clip_case, stage, norm_type):
                assert rel_norm <= 1e-5 and worst <= 2e-6, (stage, norm_type, rel_norm, worst)


def test_clip_grad_norm_twice_before_a_step_clips_the_clipped_gradient_as_torch(pools):
    """A norm read after clipping (``clip_grad_norm_(inf)``, a common way to log it) returns the
    clipped gradient's norm and keeps the clip; a tighter second clip multiplies in: as torch's
    clip_grad_norm_ twice over p.grad."""
    pool = pools(2)
    for stage in (1, 2):
        for max_norms in ((0.05, math.inf), (0.05, 0.02), (math.inf, 0.05, 1e3)):
            for rel_norm, worst in pool.run(clip_case, stage, 2.0, max_norms):
                assert rel_norm <= 1e-5 and worst <= 2e-6, (stage, max_norms, rel_norm, worst)


def clip_then_zeroed_case(stage: int, how: str) -> tuple[float, float, float]:
    """A clip to 0.05, then the gradients zeroed (``how``) and a new backward pass: the step and a
    norm read before it see the new gradient, unclipped, as torch's (its clip scaled the gradient
    that zeroing dropped). Against torch on the new averaged gradient alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=6)
    ref = copy.deepcopy(model)
    opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, stage=stage, bucket_cap_mb=1e-4)
    ref_opt = torch.optim.AdamW(param_groups(ref), lr=1e-2)
    opt.backward(model(batch(rank, 0)))
    clipped = opt.clip_grad_norm_(0.05).item()
    if how == "model.zero_grad()":
        model.zero_grad()
    else:
        for p in model.parameters():
            p.grad = None
    opt.backward(model(batch(rank, 1)))
    norm = opt.clip_grad_norm_(1e9).item()
    opt.step()
    trainable = [p for p in ref.parameters() if p.requires_grad]
    for p, g in zip(ref.parameters(), _avg_grads(ref, world, 1)):
        p.grad = g if p.requires_grad else None
    ref_norm = torch.nn.utils.clip_grad_norm_(trainable, 1e9).item()
    ref_opt.step()
    worst = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return clipped, abs(norm - ref_norm) / ref_norm, worst


def test_a_clip_is_dropped_with_the_gradients_it_scaled(pools):
    """model.zero_grad() or p.grad = None after clip_grad_norm_ drops the gradient the clip scaled:
    the next backward's gradient is stepped unclipped, and a norm read is its own, as in torch."""
    pool = pools(2)
    for stage in (1, 2):
        for how in ("model.zero_grad()", "p.grad = None"):
            for clipped, rel_norm, worst in pool.run(clip_then_zeroed_case, stage, how):
                assert clipped > 0.05 * 2, (stage, how, clipped)  # the clip did scale the first gradient
                assert rel_norm <= 1e-5 and worst <= 2e-6, (stage, how, rel_norm, worst)


def accumulation_case(stage: int, micro: int) -> float:
    """k micro-batches per rank under no_sync == one big batch in one process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=7)
    ref = copy.deepcopy(model)
    opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, stage=stage, bucket_cap_mb=1e-4)
    ref_opt = torch.optim.AdamW(param_groups(ref), lr=1e-2)
    for step in range(3):
        opt.zero_grad()
        for i in range(micro):
            loss = model(batch(rank, 100 * step + i)) / micro
            if i < micro - 1:
                with opt.no_sync():
                    opt.backward(loss)
            else:
                opt.backward(loss)
        opt.step()
        ref.zero_grad(set_to_none=False)
        for r in range(world):
            for i in range(micro):
                (ref(batch(r, 100 * step + i)) / (micro * world)).backward()
        for p in ref.parameters():
            if not p.requires_grad:
                p.grad = None
        ref_opt.step()
    return max((a.detach() - b.detach()).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


def test_no_sync_accumulation_equals_big_batch(pools):
    for world in (2, 3):
        pool = pools(world)
        for stage in (1, 2):
            assert max(pool.run(accumulation_case, stage, 3)) <= 2e-6, (world, stage)


def bf16_accumulation_case(accumulate_dtype_name: str | None) -> tuple[bool, bool]:
    """Stage 1 keeps the averaged gradient in p.grad: compare it bit for bit with an fp32 sum of
    the bf16 micro-batch gradients (and with a bf16 sum) averaged by a plain all_reduce."""
    rank = dist.get_rank()
    dtype = getattr(torch, accumulate_dtype_name) if accumulate_dtype_name else None
    model = make_model(seed=8, dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = shardopt.ShardedAdamW(model.parameters(), stage=1, accumulate_dtype=dtype)
    micro = 8
    for i in range(micro):
        loss = model(batch(rank, i))
        if i < micro - 1:
            with opt.no_sync():
                opt.backward(loss)
        else:
            opt.backward(loss)
    trainable = [(p, q) for p, q in zip(model.parameters(), ref.parameters()) if p.requires_grad]
    sums32 = [torch.zeros_like(q, dtype=torch.float32) for _, q in trainable]
    sums16 = [torch.zeros_like(q) for _, q in trainable]
    for i in range(micro):
        ref.zero_grad(set_to_none=True)
        ref(batch(rank, i)).backward()
        for k, (_, q) in enumerate(trainable):
            g = q.grad if q.grad is not None else torch.zeros_like(q)
            sums32[k] += g.float()
            sums16[k] += g
    same32 = same16 = True
    for (p, _), s32, s16 in zip(trainable, sums32, sums16):
        a, b = s32.to(torch.bfloat16), s16.clone()
        dist.all_reduce(a, op=dist.ReduceOp.AVG)
        dist.all_reduce(b, op=dist.ReduceOp.AVG)
        same32 &= torch.equal(p.grad, a)
        same16 &= torch.equal(p.grad, b)
    return same32, same16


def test_bf16_gradients_accumulate_in_fp32(pools):
    pool = pools(2)
    for same32, same16 in pool.run(bf16_accumulation_case, "float32"):
        assert same32 and not same16  # the bf16 sum really differs, and we match the fp32 sum
    for same32, same16 in pool.run(bf16_accumulation_case, None):
        assert same16 and not same32  # accumulate_dtype=None: autograd's bf16 accumulation


def shard_accumulation_case(accumulate_dtype_name: str | None) -> tuple[bool, bool, int, int]:
    """Stage 2, 8 micro-batches without no_sync: each is reduced, and the averaged micro-batch
    gradients are summed in fp32 in the shard (rounded once) unless ``accumulate_dtype=None``.
    Compares this rank's gradient shard bit for bit with both sums, made with plain collectives,
    and returns the buffer bytes held against the shard's fp32 bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, accumulate_dtype_name) if accumulate_dtype_name else None
    model = make_model(seed=8, dtype=torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = shardopt.ShardedAdamW(model.parameters(), stage=2, accumulate_dtype=dtype, loss_scale=None)
    micro = 8
    for i in range(micro):
        opt.backward(model(batch(rank, i)))
    trainable = {id(p): q for p, q in zip(model.parameters(), ref.parameters()) if p.requires_grad}
    sums32 = {k: torch.zeros_like(q, dtype=torch.float32) for k, q in trainable.items()}
    sums16 = {k: torch.zeros_like(q) for k, q in trainable.items()}
    for i in range(micro):
        ref.zero_grad(set_to_none=True)
        ref(batch(rank, i)).backward()
        for k, q in trainable.items():
            g = (q.grad if q.grad is not None else torch.zeros_like(q)).float()
            dist.all_reduce(g)  # two ranks: a + b, as exact as any order
            avg = (g / world).to(torch.bfloat16)  # one micro-batch, averaged and rounded once
            sums32[k] += avg.float()
            sums16[k] += avg
    buf = opt.inspect().buffers[0]
    shard = buf.local_grad
    same32 = same16 = True
    for piece in buf.layout.shard_pieces(rank):
        key = id(buf.params[piece.param])
        mine = shard[piece.local_range.as_slice()]
        same32 &= torch.equal(mine, sums32[key].reshape(-1)[piece.param_range.as_slice()].to(torch.bfloat16))
        same16 &= torch.equal(mine, sums16[key].reshape(-1)[piece.param_range.as_slice()])
    rep = opt.memory_report()
    return same32, same16, rep.buffers, buf.layout.shard_numel * 4


def test_micro_batches_reduced_one_by_one_sum_in_an_fp32_shard(pools):
    pool = pools(2)
    for same32, same16, buffers, shard32 in pool.run(shard_accumulation_case, "float32"):
        assert same32 and not same16  # the bf16 sum really differs, and we match the fp32 one
        assert buffers >= shard32  # the fp32 sum is counted, and it is a shard, not the whole gradient
    for same32, same16, _, _ in pool.run(shard_accumulation_case, None):
        assert same16 and not same32  # accumulate_dtype=None: summed in the gradient dtype


def clip_then_nan_case(stage: int) -> tuple[bool, bool, bool]:
    """clip_grad_norm_ on finite gradients, then one more backward pass whose gradient is NaN on
    rank 1 only, then step: the step must see the NaN (it used to reuse the clip's verdict)."""
    rank = dist.get_rank()
    model = make_model(seed=12)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, stage=stage, loss_scale=None)
    before = _snapshot(model)
    opt.backward(model(batch(rank, 0)))
    opt.clip_grad_norm_(1.0)
    loss = model(batch(rank, 1))
    opt.backward(loss * float("nan") if rank == 1 else loss)
    opt.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return opt.step_was_skipped, unchanged, finite


def test_a_backward_pass_after_clipping_is_checked_again(pools):
    pool = pools(2)
    for stage in (1, 2):
        for skipped, unchanged, finite in pool.run(clip_then_nan_case, stage):
            assert skipped and unchanged and finite, (stage, skipped, unchanged, finite)
