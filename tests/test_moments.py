"""Low-precision Adam moments (``moments="bf16" | "8bit"``): codecs, kernels, bytes, invariance.

Tier 1 (no process group): the fused kernels against the reference for every master-weight mode
with each moments mode, on gradients with zeros, subnormals, huge and tiny values; the 8-bit
codec's error and bias; the clamp that keeps a block whose ``sqrt(v)`` rounded to zero from
taking ``m / eps`` steps; blocks that never straddle two parameters or a shard boundary.
Tier 2 (real gloo ranks): the bytes each mode holds, counted from every live tensor; weights
bit-identical at 1, 2 and 4 ranks on identical data; checkpoints between modes and world sizes;
a short training run per mode close to fp32 moments'.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

import shardopt
from models import batch, make_model
from shardopt.core._layout import Range, build_layout
from shardopt.checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from shardopt.kernels import codecs, make_scalars, reference, select
from shardopt.kernels.reference import MOMENT_BLOCK
from shardopt.master import make_master
from shardopt.moments import make_moments

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from live_tensors import LiveTensors  # noqa: E402

MOMENTS = ("fp32", "bf16", "8bit")


def _hard_gradient(n: int, step: int) -> torch.Tensor:
    """Gaussian, with runs of zeros, subnormals, huge (1e15) and tiny (1e-30) values, per block."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(step)) * 3
    g[5::97] = 0.0
    g[7::131] = 1e-40  # subnormal in fp32
    g[11::257] = 1e15
    g[13::89] = 1e-30
    g[: min(n, 64)] = 0.0  # a whole block without gradient
    return g


def _run(master: str, moments: str, n: int, impl: str, steps: int = 3) -> dict:
    torch.manual_seed(1)
    w0 = torch.randn(n) * 0.5
    kernels = select(impl, dtype=torch.bfloat16, master=master, moments=moments)
    strategy = make_master(master, w0.to(torch.bfloat16), kernels=kernels, seed=7, logical=lambda local: 1024 + local)
    strategy.load_state_tensors({"master": w0})
    mom = make_moments(moments, n, torch.device("cpu"))
    for step in range(1, steps + 1):
        g = _hard_gradient(n, step).to(torch.bfloat16)
        s = make_scalars(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, step=step, grad_scale=0.25)
        strategy.update_(Range(0, n), g, *mom.prepare(Range(0, n), g, s, strategy.kernels), s, step)
    assert strategy.kernels.name == impl  # a fused kernel that failed to compile would fall back
    return {"param": strategy.param_shard.clone(), "mom": {k: t.clone() for k, t in mom.tensors().items()},
            "decoded": mom.fp32()}


FUSED_CASES = [(ma, mo) for mo in ("bf16", "8bit") for ma in ("fp32", "remainder", "stochastic", "none")]


@pytest.mark.parametrize("master,moments", FUSED_CASES, ids=[f"{a}-{b}" for a, b in FUSED_CASES])
def test_fused_matches_reference_with_low_precision_moments(master, moments):
    """Bit for bit, the weights and every stored moment tensor, against the reference run with a
    correctly rounded sqrt, as the compiled kernels take it (the update's denominator, the 8-bit
    code and scale of exp_avg_sq). With eager's own sqrt, which can be an ulp off (MKL's, see
    tests/correct_sqrt.py), a value next to a rounding boundary may round to the neighbour, and
    under stochastic rounding a weight near zero can carry that ulp into several."""
    from correct_sqrt import correctly_rounded_sqrt

    for n in (4160,):  # 65 blocks, the first without gradient
        with correctly_rounded_sqrt():
            ref = _run(master, moments, n, "reference")
        fused = _run(master, moments, n, "fused")
        assert torch.equal(ref["param"], fused["param"]), (master, moments, n)
        for k, a in ref["mom"].items():
            assert torch.equal(a, fused["mom"][k]), (k, n)
        for a, b in zip(ref["decoded"], fused["decoded"]):
            assert bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())


def test_fused_step_allocates_no_full_length_temporaries(monkeypatch):
    """What the compiled steps allocate beyond the state they update, recorded as inductor's
    generated code allocates it: a low-precision moments mode must not take back, in fp32
    temporaries, the bytes it saves (an 8-bit step written as one graph held three full-length
    fp32 buffers, 12 B/element; a scan whose operands had unrelated dynamic sizes, one). Both the
    kernel compiled for one length and the one compiled for any length (what an optimizer with
    several segment lengths runs) are checked."""
    import torch._C._dynamo.guards as guards

    seen: list[int] = []
    allocate = guards._empty_strided_cpu

    def recording(size, stride, dtype):  # noqa: ANN001, ANN202
        seen.append(math.prod(size))
        return allocate(size, stride, dtype)

    monkeypatch.setattr(guards, "_empty_strided_cpu", recording)  # bound when generated code loads
    torch._dynamo.reset()
    checked = 0
    with torch._inductor.config.patch(force_disable_caches=True):
        for moments in ("bf16", "8bit"):
            for n in (64 * 4099, 64 * 5003):  # the second length compiles the dynamic-shape kernel
                kernels = select("fused", dtype=torch.bfloat16, master="fp32", moments=moments)
                strategy = make_master("fp32", torch.randn(n).to(torch.bfloat16), kernels=kernels)
                mom = make_moments(moments, n, torch.device("cpu"))
                g = torch.randn(n).to(torch.bfloat16)
                s = make_scalars(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, grad_scale=1.0)
                seen.clear()
                strategy.update_(Range(0, n), g, *mom.prepare(Range(0, n), g, s, strategy.kernels), s, 1)
                assert strategy.kernels.name == "fused"
                assert all(size <= n // MOMENT_BLOCK for size in seen), (moments, n, seen)  # per block at most
                checked += len(seen)
    assert checked >= 4  # the 8-bit scans' per-block maxima: the recorder sees the generated code's buffers


def test_8bit_codec_error_and_bias():
    """Nearest: within half a code of each block's scale; stochastic: within one code, unbiased."""
    n = 64 * 512
    g = torch.Generator().manual_seed(0)
    m = torch.randn(n, generator=g) * torch.logspace(-6, 2, n // 64).repeat_interleave(64)
    v = m.square() * torch.rand(n, generator=g) * 4
    (mq, ms), (vq, vs) = reference.encode_moment8(m, v, None)
    dm, dv = reference.decode_moment8(mq, ms, vq, vs)
    m_step = (ms / 127).repeat_interleave(64)
    r_step = (vs / 255).repeat_interleave(64)
    assert bool(((dm - m).abs() <= 0.5 * m_step * (1 + 1e-5)).all())
    assert bool(((dv.sqrt() - v.sqrt()).abs() <= 0.5 * r_step * (1 + 1e-5) + 1e-30).all())
    assert torch.equal(ms, m.view(-1, 64).abs().amax(1)) and torch.equal(vs, v.sqrt().view(-1, 64).amax(1))
    # Stochastic: the mean over many keys is the value (in the code's domain: m and sqrt(v)).
    x = torch.full((64,), 0.3)
    x[0] = 1.0  # the block's maximum: 0.3 sits between codes 38 and 39
    decoded = [reference.decode_moment8(*(c for pair in reference.encode_moment8(
        x, x.square(), codecs.make_key(1, k, 0)) for c in pair)) for k in range(4000)]
    draws = torch.stack([m for m, _ in decoded])[:, 1:]
    step = 1 / 127
    assert set(torch.unique(torch.round(draws / step)).tolist()) <= {38.0, 39.0}
    assert abs(float(draws.double().mean()) - 0.3) < 6 * 0.5 * step / math.sqrt(draws.numel())
    # exp_avg_sq is coded through sqrt(v) = 0.3, between codes 76 and 77 of 255, and rounded so
    # that v itself (not its square root) is unbiased.
    vs = torch.stack([v for _, v in decoded])[:, 1:]
    spread = (77**2 - 76**2) / 255**2
    assert set(torch.unique(torch.round(vs.sqrt() * 255)).tolist()) <= {76.0, 77.0}
    assert abs(float(vs.double().mean()) - 0.09) < 6 * 0.5 * spread / math.sqrt(vs.numel())
    # Between codes 0 and 1 the difference is plain: sqrt(v) = 0.5 code rounded without bias would
    # give v = 0.5 code^2, twice the value.
    r = torch.full((64,), 0.5 / 255)
    r[0] = 1.0
    small = torch.stack([reference.decode_moment8(*(c for pair in reference.encode_moment8(
        torch.zeros(64), r.square(), codecs.make_key(2, k, 0)) for c in pair))[1][1:]
        for k in range(2000)])
    assert abs(float(small.double().mean()) / (0.5 / 255) ** 2 - 1) < 0.03


def test_8bit_clamp_keeps_a_zero_sqrt_v_from_taking_an_m_over_eps_step():
    """A block whose sqrt(v) code is 0 while m's is not (stochastic rounding can do that) gives no
    update larger than exact Adam ever could; without the clamp it would move by lr * m / eps."""
    n = 64
    mom = make_moments("8bit", n, torch.device("cpu"))
    mom.m_codes.fill_(5)
    mom.m_scales.fill_(1.0)
    mom.v_codes.fill_(0)
    mom.v_codes[0] = 255
    mom.v_scales.fill_(1.0)
    w = torch.zeros(n)
    s = make_scalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=10, grad_scale=1.0)
    key = codecs.make_key(0, 10, 0)
    reference.step_fp32(w, torch.zeros(n), *mom.operands(Range(0, n)), s, None, key)
    assert float(w[1:].abs().max()) == 0.0  # m clamped to 0 where sqrt(v) is 0
    bound = reference.moment_ratio_bound(0.9, 0.999)
    assert 7.2 < bound < 7.5  # (1 - b1) / sqrt((1 - b2)(1 - b1^2 / b2)) for (0.9, 0.999), +1%


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_8bit_blocks_never_straddle_parameters_or_shards(world_size):
    shapes = [(17,), (3, 5), (64,), (1,), (129, 2), (7, 7, 7), (65,)]
    layout = build_layout(shapes, world_size, alignment=math.lcm(8, MOMENT_BLOCK), bucket_numel=300)
    assert layout.shard_numel % MOMENT_BLOCK == 0
    for span in layout.params:
        assert span.global_range.start % MOMENT_BLOCK == 0
    for p, q in zip(layout.params, layout.params[1:]):  # the block holding p's last element ends before q
        last_block_end = -(-p.global_range.end // MOMENT_BLOCK) * MOMENT_BLOCK
        assert last_block_end <= q.global_range.start
    seg = layout.segments(0, [0] * len(shapes))
    assert all(r.start % MOMENT_BLOCK == 0 and r.size % MOMENT_BLOCK == 0 for _, r in seg)


def test_bf16_moments_decay_after_a_spike_only_when_rounded_stochastically():
    """exp_avg_sq = 1 after a spike, then tiny gradients: 0.999 * v rounds back to v in bf16."""
    n, steps = 1024, 700
    v_sr = torch.ones(n, dtype=torch.bfloat16)
    v_rne = torch.ones(n, dtype=torch.bfloat16)
    exact = 0.999 ** steps
    for step in range(steps):
        bits = codecs.random_bits16(codecs.make_key(0, step, 0), n, 2)
        v_sr.copy_(codecs.stochastic_round(v_sr.float() * 0.999, torch.bfloat16, bits))
        v_rne.copy_(v_rne.float() * 0.999)
    assert float(v_rne.float().mean()) == 1.0  # never decays
    assert abs(float(v_sr.float().mean()) / exact - 1) < 0.02


# -- tier 2: real gloo ranks ---------------------------------------------------------------------------
_GROUPS: dict[int, object] = {}


def _group(world_size: int) -> object:
    if world_size not in _GROUPS:
        _GROUPS[world_size] = dist.new_group(list(range(world_size)))
    return _GROUPS[world_size] if dist.get_rank() < world_size else None


def bytes_case(moments: str) -> dict | None:
    """Bytes the optimizer's tensors hold, counted from every live tensor, and its report."""
    group = _group(2)
    if group is None:
        return None
    with LiveTensors(graph=False) as live:
        model = make_model(seed=1, dtype=torch.bfloat16, dim=64, hidden=128)
        base = live.bytes()
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, moments=moments, master_weights="remainder",
                                    loss_scale=None, process_group=group)
        held = live.bytes() - base
    rep = opt.memory_report()
    shard = opt.inspect().buffers[0].shard_numel
    return {"held": held, "exp_avg": rep.exp_avg, "exp_avg_sq": rep.exp_avg_sq, "shard": shard,
            "params": rep.params, "grads": rep.grads, "extra": rep.extra, "master": rep.master,
            "predicted": rep.predicted}


def test_moment_bytes_per_mode_counted_from_the_tensors_held(pools):
    pool = pools(4)
    got = {m: pool.run(bytes_case, m)[:2] for m in MOMENTS}
    expected = {"fp32": lambda n: 8 * n, "bf16": lambda n: 4 * n, "8bit": lambda n: 2 * n + 8 * n // 64}
    for rank in range(2):
        r = {m: got[m][rank] for m in MOMENTS}
        n = r["fp32"]["shard"]
        assert r["8bit"]["shard"] % 64 == 0 and r["8bit"]["shard"] >= n
        for m in MOMENTS:
            x, nm = r[m], r[m]["shard"]
            assert x["exp_avg"] + x["exp_avg_sq"] == expected[m](nm), m  # the report
            # Every byte the optimizer allocated, counted from the live tensors: the modes differ
            # by their moments and by the 64-aligned layout of 8-bit moments (bf16 weights over 2
            # ranks: 4 B of weights, 2 of gradient shard and 2 of remainder per shard element).
            assert x["held"] - r["fp32"]["held"] == expected[m](nm) - expected["fp32"](n) + 8 * (nm - n), m
            assert abs(x["predicted"]["exp_avg"] - x["exp_avg"]) <= 0.02 * x["exp_avg"], (m, x["predicted"])


def invariance_case(world_size: int, stage: int, moments: str, master: str) -> list[torch.Tensor] | None:
    """Identical data on every rank, bf16 weights averaged in fp32 (exact): weights after 4 steps."""
    group = _group(world_size)
    if group is None:
        return None
    model = make_model(seed=3, dtype=torch.bfloat16, dim=40, hidden=72)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, stage=stage,
                                moments=moments, master_weights=master, loss_scale=None, seed=5,
                                reduce_dtype=torch.float32, bucket_cap_mb=0.004, process_group=group)
    for step in range(4):
        model(batch(0, step, n=8)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()] if dist.get_rank() == 0 else None


INVARIANCE = [(1, "fp32"), (2, "stochastic"), (2, "remainder")]


@pytest.mark.parametrize("moments", MOMENTS)
def test_weights_bit_identical_at_1_2_and_4_ranks(pools, moments):
    pool = pools(4)
    for stage, master in INVARIANCE:
        runs = {ws: pool.run(invariance_case, ws, stage, moments, master)[0] for ws in (1, 2, 4)}
        for ws in (2, 4):
            for i, (a, b) in enumerate(zip(runs[1], runs[ws])):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (moments, stage, master, ws, i)
        start = make_model(seed=3, dtype=torch.bfloat16, dim=40, hidden=72)
        assert any(not torch.equal(a, p.detach()) for a, p in zip(runs[1], start.parameters()))  # it trained


def save_case(path: str, moments: str) -> dict | None:
    group = _group(2)
    if group is None:
        return None
    model = make_model(seed=4, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, moments=moments, master_weights="remainder",
                                loss_scale=None, process_group=group)
    for step in range(3):
        model(batch(dist.get_rank(), step)).backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(path, model, opt)
    return full_state_dict(opt)


def load_case(path: str, world_size: int, moments: str) -> dict | None:
    group = _group(world_size)
    if group is None:
        return None
    model = make_model(seed=9, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, moments=moments, master_weights="remainder",
                                loss_scale=None, process_group=group)
    load_checkpoint(path, model, opt)
    fsd = full_state_dict(opt)
    model(batch(dist.get_rank(), 3)).backward()  # and it trains on
    opt.step()
    return fsd


def test_checkpoints_move_between_moments_modes_and_world_sizes(pools, tmp_path):
    pool = pools(4)
    for saved_mode in ("8bit", "fp32"):
        path = str(tmp_path / f"ckpt-{saved_mode}")
        saved = pool.run(save_case, path, saved_mode)[0]
        for load_mode, world in (("fp32", 1), ("bf16", 4), ("8bit", 3)):
            got = pool.run(load_case, path, world, load_mode)[0]
            for idx, s in saved["state"].items():
                for k in ("exp_avg", "exp_avg_sq"):
                    a, b = s[k], got["state"][idx][k]
                    if load_mode == "fp32":
                        tol = 0.0  # fp32 keeps the saved (decoded) values
                    elif load_mode == saved_mode == "8bit":
                        tol = 1e-6 * float(a.abs().max())  # its own decoding, encoded again
                    elif load_mode == "bf16":
                        tol = float(a.abs().max()) * 2**-8
                    elif k == "exp_avg":  # 8-bit from fp32, nearest: half a code of the block scale
                        tol = 0.5 * float(a.abs().max()) / 127 * (1 + 1e-5)
                    else:  # through sqrt(v): |r'^2 - r^2| <= e (2 r + e), e half a code
                        e = 0.5 * float(a.sqrt().max()) / 255 * (1 + 1e-5)
                        tol = e * (2 * float(a.sqrt().max()) + e)
                    assert float((a - b).abs().max()) <= tol, (saved_mode, load_mode, idx, k)
                assert float(got["state"][idx]["step"]) == float(s["step"])


def train_case(moments: str) -> float | None:
    group = _group(2)
    if group is None:
        return None
    model = make_model(seed=6, dtype=torch.bfloat16, dim=48, hidden=96)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=3e-3, moments=moments, master_weights="remainder",
                                loss_scale=None, process_group=group)
    losses = []
    for step in range(60):
        loss = model(batch(dist.get_rank(), step % 8, n=16))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return sum(losses[-8:]) / 8


def test_a_short_run_per_mode_ends_close_to_fp32_moments(pools):
    pool = pools(4)
    final = {m: pool.run(train_case, m)[0] for m in MOMENTS}
    start = pool.run(train_case, "fp32")[0]
    assert start == final["fp32"]  # deterministic
    for m in ("bf16", "8bit"):
        assert abs(final[m] - final["fp32"]) <= 0.03 * final["fp32"], final
