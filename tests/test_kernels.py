"""Tier 1: the update math and the master-weight codecs, no process group (one tier-2 case at the
end: a rank whose kernels fail to compile, beside one whose kernels do not).

Catches a fused kernel that drifts from the reference, a remainder codec that is not bit-exact,
a bf16 cast that differs from round-to-nearest elsewhere than on ties, stochastic rounding that is
biased or depends on how the buffer is split, a reference that drifts from torch.optim.AdamW, and
compiled kernels that meet dynamo's recompile limit or take a failure to compile for one of the
compiled code.
"""
from __future__ import annotations

import contextlib
import inspect
import re
import os
import warnings

import pytest
import torch

from shardopt.core._layout import Range
from shardopt.kernels import codecs, make_scalars, reference, select
from shardopt.master import make_master

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units of the last place between two 16-bit tensors of the same sign pattern."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)  # sign-magnitude -> monotone integers
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def _torch_adamw_and(step_fp32, n: int, steps: int = 6, torch_context=contextlib.nullcontext):  # noqa: ANN001
    """(torch.optim.AdamW's (weight, exp_avg, exp_avg_sq), ``step_fp32``'s) after ``steps`` steps
    on the same n-element weight and gradients; torch's steps run inside ``torch_context()``."""
    torch.manual_seed(n)
    w = torch.randn(n)
    ref = w.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for step in range(1, steps + 1):
        g = torch.randn(n)
        ref.grad = g.clone()
        with torch_context():
            opt.step()
        s = make_scalars(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step, grad_scale=1.0)
        step_fp32(w, g, m, v, s, None)
    return (ref.detach(), opt.state[ref]["exp_avg"], opt.state[ref]["exp_avg_sq"]), (w, m, v)


def test_reference_matches_torch_adamw_bit_for_bit():
    """Weights and both moments, on sizes with and without a vector tail: exp_avg_sq rounded once
    as torch's addcmul_ rounds it (a fused multiply-add on AVX2 and AVX-512)."""
    for n in (1, 17, 257, 1001, 4099):
        want, got = _torch_adamw_and(reference.step_fp32, n)
        for name, a, b in zip(("weight", "exp_avg", "exp_avg_sq"), want, got):
            assert torch.equal(a, b), (n, name)


def test_fused_step_is_torch_adamw_with_a_correctly_rounded_sqrt():
    """The fused step equals torch.optim.AdamW's CPU step bit for bit, weights included, when
    torch's sqrt is correctly rounded (as the fused kernel's is; eager's need not be, see
    tests/correct_sqrt.py); the moments equal torch's as they are, whatever its sqrt."""
    from correct_sqrt import correctly_rounded_sqrt  # imported here: this file also runs as a script

    fused = select("fused", dtype=torch.float32, master="fp32", moments="fp32")
    for n in (1, 17, 257, 4099):
        want, got = _torch_adamw_and(fused.step_fp32, n, torch_context=correctly_rounded_sqrt)
        for name, a, b in zip(("weight", "exp_avg", "exp_avg_sq"), want, got):
            assert torch.equal(a, b), (n, name)
    assert fused.name == "fused"


def _run(mode: str, dtype: torch.dtype, n: int, impl: str, steps: int = 3) -> dict:
    """A few steps of one master-weight mode over an n-element shard with the ``impl`` kernels."""
    return _run_with(select(impl, dtype=dtype, master=mode, moments="fp32"), mode, dtype, n, steps)


def _run_with(kernels, mode: str, dtype: torch.dtype, n: int, steps: int = 3) -> dict:  # noqa: ANN001
    torch.manual_seed(1)
    w0 = torch.randn(n) * 0.5
    m, v = torch.zeros(n), torch.zeros(n)
    strategy = make_master(mode, w0.to(dtype), kernels=kernels, seed=7, logical=lambda local: 1000 + local)
    strategy.load_state_tensors({"master": w0})  # every mode starts from the same fp32 weights
    for step in range(1, steps + 1):
        g = (torch.randn(n, generator=torch.Generator().manual_seed(step)) * 4).to(dtype)
        s = make_scalars(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, step=step, grad_scale=0.25)
        strategy.update_(Range(0, n), g, m, v, s, step)
    out = {"m": m, "v": v, "param": strategy.param_shard}
    if mode == "fp32":
        out["master"] = strategy.fp32()
    if mode == "remainder":
        out["rem"] = strategy.remainder
    return out


CASES = [("fp32", d) for d in DTYPES] + [(m, d) for m in ("remainder", "stochastic", "none")
                                          for d in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("mode,dtype", CASES, ids=[f"{m}-{str(d)[6:]}" for m, d in CASES])
def test_fused_matches_reference(mode, dtype):
    """Bit for bit against the reference run with a correctly rounded sqrt, as the compiled kernels
    take it. Against the reference with eager's own sqrt, which can be an ulp off (MKL's, see
    tests/correct_sqrt.py), the stated tolerance: fp32 weights agree to a couple of ulps of O(1)
    numbers, 16-bit weights within one ulp; the moments stay equal (the test below)."""
    from correct_sqrt import correctly_rounded_sqrt  # imported here: this file also runs as a script

    for n in (1, 17, 4099):
        kernels = select("fused", dtype=dtype, master=mode, moments="fp32")
        ref, fused = _run(mode, dtype, n, "reference"), _run_with(kernels, mode, dtype, n)
        assert torch.allclose(ref["m"], fused["m"], rtol=1e-6, atol=1e-7)
        assert torch.allclose(ref["v"], fused["v"], rtol=1e-6, atol=1e-9)
        if "master" in ref:
            assert torch.allclose(ref["master"], fused["master"], rtol=1e-6, atol=2.5e-7)
        if ref["param"] is not None and dtype != torch.float32:
            assert _ulps(ref["param"], fused["param"]) <= 1, (mode, dtype, n)
        if "rem" in ref:  # the decoded masters agree as closely as the fp32 path's
            decode = codecs.decode_bf16 if dtype == torch.bfloat16 else codecs.decode_fp16
            a, b = decode(ref["param"], ref["rem"]), decode(fused["param"], fused["rem"])
            assert torch.allclose(a, b, rtol=1e-6, atol=2.5e-7), (mode, dtype, n)
        with correctly_rounded_sqrt():
            exact = _run(mode, dtype, n, "reference")
        if kernels.name == "reference":  # the self-check found a codec this torch folds (tests/torch_releases.py)
            exact = ref
        for key, a in exact.items():
            b = fused[key]
            a, b = (codecs.join_remainder(a), codecs.join_remainder(b)) if key == "rem" else (a, b)
            assert (a is None and b is None) or torch.equal(a, b), (mode, dtype, n, key)


@pytest.mark.parametrize("moments", ["fp32", "bf16", "8bit"])
def test_fused_moments_are_the_reference_bit_for_bit(moments):
    """exp_avg (lerp) and exp_avg_sq (fma((1 - beta2) g, g, beta2 v)) come out of the fused step
    with the reference's bits in every master-weight mode, on sizes with and without a vector tail
    (see _cpu_codegen [Note: fused multiply-add]). 8-bit moments are compared where they are still
    fp32, in the scan's per-block maxima of the new moments: encoding them takes a sqrt (see
    test_fused_matches_reference)."""
    from shardopt.moments import make_moments

    for n in (1, 17, 257, 4099):
        if moments == "8bit":
            n *= reference.MOMENT_BLOCK
            mom = make_moments(moments, n, torch.device("cpu"))
            for step in range(1, 4):
                mom.load_(torch.randn(n) * 0.1, torch.rand(n) * 0.01)
                g = torch.randn(n).to(torch.bfloat16)
                s = make_scalars(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, step=step,
                                 grad_scale=0.25)
                m, v = mom.operands(Range(0, n))
                fused = select("fused", dtype=torch.bfloat16, master="fp32", moments="8bit")
                want, got = reference.moment8_scan(g, m, v, s), fused.moment8_scan(g, m, v, s)
                assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), (n, step)
            continue
        for mode, dtype in [("fp32", torch.float32)] + [(m, torch.bfloat16) for m in
                                                         ("fp32", "remainder", "stochastic", "none")]:
            stored = {}
            for impl in ("reference", "fused"):
                kernels = select(impl, dtype=dtype, master=mode, moments=moments)
                torch.manual_seed(n)
                strategy = make_master(mode, torch.randn(n).to(dtype), kernels=kernels, seed=7, logical=lambda local: 1000 + local)
                mom = make_moments(moments, n, torch.device("cpu"))
                mom.load_(torch.randn(n) * 0.1, torch.rand(n) * 0.01)
                for step in range(1, 4):
                    g = (torch.randn(n, generator=torch.Generator().manual_seed(step)) * 4).to(dtype)
                    s = make_scalars(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, step=step,
                                     grad_scale=0.25)
                    strategy.update_(Range(0, n), g, *mom.prepare(Range(0, n), g, s, kernels), s, step)
                assert kernels.name == impl
                stored[impl] = mom.tensors()
            for name, a in stored["reference"].items():
                assert torch.equal(a, stored["fused"][name]), (moments, mode, n, name)


def test_amsgrad_and_maximize_are_torch_adamw_in_the_reference_and_the_fused_kernels():
    """torch.optim.AdamW(amsgrad=True, maximize=True) bit for bit in the reference (weights, both
    moments and max_exp_avg_sq), and the fused kernels the reference with a correctly rounded sqrt,
    bit for bit, with the running maximum in fp32 and in bf16 (``moments="bf16"``)."""
    from correct_sqrt import correctly_rounded_sqrt

    for maximize in (False, True):
        torch.manual_seed(4)
        n = 257
        w = torch.randn(n)
        ref = w.clone().requires_grad_(True)
        opt = torch.optim.AdamW([ref], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=True,
                                maximize=maximize, foreach=False)
        m, v, vmax = torch.zeros(n), torch.zeros(n), torch.zeros(n)
        for step in range(1, 7):
            g = torch.randn(n) * (4.0 if step % 3 else 0.1)  # large then small gradients: the maximum holds
            ref.grad = g.clone()
            opt.step()
            s = make_scalars(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step,
                             grad_scale=-1.0 if maximize else 1.0)
            reference.step_fp32(w, g, m, v, s, None, vmax=vmax)
        state = opt.state[ref]
        for name, a, b in (("weight", ref.detach(), w), ("exp_avg", state["exp_avg"], m),
                           ("exp_avg_sq", state["exp_avg_sq"], v), ("max_exp_avg_sq", state["max_exp_avg_sq"], vmax)):
            assert torch.equal(a, b), (maximize, name)
    for mode, dtype, vdtype in (("fp32", torch.float32, torch.float32), ("remainder", torch.bfloat16, torch.bfloat16)):
        runs = {}
        for impl in ("reference", "fused"):
            kernels = select(impl, dtype=dtype, master=mode, moments="fp32" if vdtype == torch.float32 else "bf16")
            torch.manual_seed(5)
            strategy = make_master(mode, torch.randn(4099).to(dtype), kernels=kernels, seed=7, logical=lambda local: 64 + local)
            m, v, vmax = (torch.zeros(4099, dtype=vdtype) for _ in range(3))
            for step in range(1, 5):
                g = (torch.randn(4099, generator=torch.Generator().manual_seed(step)) * 4).to(dtype)
                s = make_scalars(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, step=step,
                                 grad_scale=-0.25)
                with correctly_rounded_sqrt() if impl == "reference" else contextlib.nullcontext():
                    strategy.update_(Range(0, 4099), g, m, v, s, step, vmax)
            runs[impl] = (strategy.param_shard.clone(), m, v, vmax)
        assert kernels.name == "fused"
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), runs["reference"], runs["fused"]):
            assert torch.equal(a, b), (mode, name)


def _interesting_fp32(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = x[torch.isfinite(x)]
    ties = (torch.randint(0, 2**16, (4096,), generator=g, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.4028235e38, -3.4028235e38, 1.1754944e-38, 1e-45, -1e-45,
                            2.0**-126, 65504.0, 2.0**-16, 2.0**-24])
    return torch.cat([x, ties[torch.isfinite(ties)], special])


def test_bf16_remainder_round_trip_is_bit_exact():
    x = _interesting_fp32(4_000_000)
    hi, lo = codecs.encode_bf16(x)
    assert torch.equal(codecs.decode_bf16(hi, lo).view(torch.int32), x.view(torch.int32))
    # The weight the model sees is round-to-nearest-even except on exact ties (one ulp away there).
    rne = x.to(torch.bfloat16)
    tie = (x.view(torch.int32) & 0xFFFF) == 0x8000
    differs = hi.view(torch.int16) != rne.view(torch.int16)
    assert not bool((differs & ~tie).any())


def test_fp16_remainder_round_trip_in_range():
    x = _interesting_fp32(4_000_000)
    x = x[x.abs() <= 65504]
    p, q = codecs.encode_fp16(x)
    assert torch.equal(p, x.to(torch.float16))  # the weight is round-to-nearest-even
    assert int(q.abs().max()) <= 2**14
    back = codecs.decode_fp16(p, q)
    exact = (x.abs() >= 2.0**-16) | (x == 0)
    assert torch.equal(back[exact].view(torch.int32), x[exact].view(torch.int32))
    assert float((back[~exact] - x[~exact]).abs().max()) <= 2.0**-40


def test_random_bits_do_not_depend_on_how_the_buffer_is_split():
    def bits(step, offset, n, stream):
        return codecs.random_bits16(codecs.make_key(5, step, offset), n, stream)
    for stream in (0, 1, 2):
        whole = bits(9, 100, 1000, stream)
        parts = torch.cat([bits(9, 100 + a, b - a, stream) for a, b in [(0, 7), (7, 513), (513, 1000)]])
        assert torch.equal(whole, parts)
        assert int(whole.min()) >= 0 and int(whole.max()) < 2**16
        assert (whole != bits(10, 100, 1000, stream)).float().mean() > 0.99  # another step
    assert (bits(9, 100, 1000, 0) != bits(9, 100, 1000, 1)).float().mean() > 0.99  # other streams
    assert (bits(9, 100, 1000, 0) != bits(9, 100, 1000, 2)).float().mean() > 0.99
    # A global offset past 2**31 (int32 counters wrap) splits the same way.
    big = 2**31 - 300
    assert torch.equal(bits(9, big, 1000, 2), torch.cat([bits(9, big, 300, 2), bits(9, big + 300, 700, 2)]))


def test_random_bits_are_uniform_and_uncorrelated():
    """Each of the 16 bits is set half the time, and neighbouring elements and steps are independent."""
    n = 1 << 18
    words = [codecs.random_bits16(codecs.make_key(0, step, 0), n, 2) for step in (1, 2)]
    x = words[0]
    ones = torch.stack([(x >> k) & 1 for k in range(16)]).float().mean(1)
    assert float((ones - 0.5).abs().max()) < 6 * 0.5 / n**0.5
    u = [(w.double() + 0.5) / 2**16 - 0.5 for w in words]
    for a, b in ((u[0][1:], u[0][:-1]), (u[0], u[1])):  # next element, next step
        corr = float((a * b).mean() / (a * a).mean())
        assert abs(corr) < 6 / n**0.5, corr


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_is_unbiased(dtype):
    n = 1 << 20
    bits = codecs.random_bits16(codecs.make_key(0, 1, 0), n, 0)
    for value in (1.0 + 2.0**-10, -3.0 - 2.0**-12, 0.1, 1000.3):
        x = torch.full((n,), value)
        r = codecs.stochastic_round(x, dtype, bits).float()
        lo, hi = float(r.min()), float(r.max())
        assert lo <= value <= hi and len(torch.unique(r)) <= 2  # only the two neighbours
        spacing = hi - lo if hi > lo else 1.0
        # The mean of 2**20 independent draws is within 6 standard errors of the value.
        assert abs(float(r.double().mean()) - value) <= 6 * 0.5 * spacing / n**0.5, (value, dtype)


STOCHASTIC_EXACT = {  # values whose discarded bits the 16 random bits cover exactly
    torch.bfloat16: (1.0 + 2.0**-10, -3.0 - 2.0**-12, 0.1, 3.0e38, -2.5e-37, 1.7e-38, -3.1e-39, 1e-42, 2.0**-120 * 1.3),
    torch.float16: (1.0 + 2.0**-20, -3.0 - 2.0**-12, 0.1, 1000.3, -60000.7, 6.2e-5),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_averages_to_the_value_over_every_bit_pattern(dtype):
    """Over all 2**16 random words the rounded values average to x exactly (fp64 sums of 16-bit
    values are exact), from fp32's subnormals to its largest values: unbiasedness by counting, with
    no sampling error. Catches an ulp computed wrongly in any exponent range."""
    bits = torch.arange(1 << 16, dtype=torch.int32)
    for value in STOCHASTIC_EXACT[dtype]:
        x = torch.full((1 << 16,), value)
        r = codecs.stochastic_round(x, dtype, bits)
        assert torch.isfinite(r).all(), (value, dtype)
        assert float(r.double().sum()) / (1 << 16) == float(x[0].double()), (value, dtype)


def test_compiled_codecs_are_bit_identical_to_eager():
    """The bitcast-heavy codecs compiled as the fused kernels compile them (see
    shardopt.kernels._cpu_codegen) give the eager bits on every class of fp32 input."""
    from shardopt.kernels import _cpu_codegen

    _cpu_codegen.install()
    x = _interesting_fp32(1 << 16)
    x = torch.cat([x, torch.tensor([float("inf"), -float("inf"), float("nan")]),
                   torch.tensor([0x7FFFFFFF, -1], dtype=torch.int32).view(torch.float32)])  # NaNs with all mantissa bits
    bits = torch.randint(0, 1 << 16, x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.int32)

    def codec_outputs(x, bits):  # the remainder as int32: a conversion to int16 would make the loop scalar
        hi, lo = codecs.encode_bf16_bits(x)
        return (hi, lo, codecs.stochastic_round(x, torch.bfloat16, bits),
                codecs.stochastic_round(x, torch.float16, bits), codecs.stochastic_round_bf16(x, bits))

    options = {**_cpu_codegen.compile_options(), "fx_graph_cache": False}  # generate the code here
    compiled = torch.compile(codec_outputs, fullgraph=True, options=options)
    with _cpu_codegen.fused_kernels():  # generated as shardopt's fused kernels are
        got = compiled(x, bits)
    for name, a, b in zip(("bf16 hi", "remainder", "stochastic bf16", "stochastic fp16", "bf16 moments"),
                          codec_outputs(x, bits), got):
        ints = torch.int16 if a.element_size() == 2 else torch.int32
        same = (a.view(ints) == b.view(ints)) | (a.float().isnan() & b.float().isnan())
        assert bool(same.all()), (name, x[~same][:4])
    nan_in = x.isnan()
    assert bool(codec_outputs(x, bits)[2][nan_in].isnan().all())  # stochastic rounding keeps a NaN a NaN


def test_fused_bitcasts_are_vectorised_and_hashing_loops_widened():
    """A bitcast in a fused CPU kernel is a register reinterpretation, not a per-lane scalar loop
    (which made the remainder step 3x slower); a loop that hashes random bits runs two vectors per
    iteration inside shardopt's fused kernels only (see [Note: wide tiling]), where its element
    counter is a broadcast plus constant lanes (see [Note: counter vector]), with the eager bits."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.utils import run_and_get_code

    from shardopt.kernels import _cpu_codegen

    isa = pick_vec_isa()
    if not isa:
        pytest.skip("inductor finds no vector ISA on this CPU: its kernels are scalar")
    assert _cpu_codegen.install()
    options = {**_cpu_codegen.compile_options(), "fx_graph_cache": False}  # generate the code here
    fn = torch.compile(lambda x: codecs.encode_bf16(x)[0], options=options)
    with _cpu_codegen.fused_kernels():
        _, (code,) = run_and_get_code(fn, torch.randn(4096))
    assert "at::vec::cast<int32_t>" in code and "c10::bit_cast" not in code

    def hashed(x, key):  # fp32 only, so inductor's own choice is one fp32 vector per iteration
        return x * codecs.uniform16(codecs.random_bits16(key, x.numel()))

    def outside(x, key):  # two frames, so that each compiles its own code
        return hashed(x, key)

    def inside(x, key):
        return hashed(x, key)

    lanes = isa.nelements(dtype=torch.float)
    x, key = torch.randn(4099), codecs.make_key(0, 1, 2**31 - 1000)  # a tail; counters wrap past 2**31
    for fn, context, step, counter in ((outside, contextlib.nullcontext(), lanes, False),
                                       (inside, _cpu_codegen.fused_kernels(), 2 * lanes, True)):
        with context:
            out, (code,) = run_and_get_code(torch.compile(fn, options=options), x, key)
        assert f"+=static_cast<int64_t>({step}L)" in code, fn.__name__
        assert ("::arange(0, 1)" in code) == counter, fn.__name__  # [Note: counter vector]
        assert torch.equal(out, hashed(x, key))


def _byte_conversions(r: torch.Tensor, i8: torch.Tensor, u8: torch.Tensor, f: torch.Tensor) -> tuple:
    """Every conversion that [Note: wide bytes] emits its own code for, and 8-bit loads and stores;
    then the forms of [Note: byte planes and the bf16 weight]: each byte of an int32 by a shift,
    and a bf16 conversion of a masked fp32 pattern (NaNs among them)."""
    return (r.to(torch.int8), r.to(torch.uint8), ((r << 24) >> 24).to(torch.int8), (r >> 8).to(torch.int8),
            i8.to(torch.int32) + r, u8.to(torch.int32) - r, f.to(torch.int32), r.float() * 0.5,
            (i8.to(torch.int32) ^ u8.to(torch.int32)).to(torch.uint8), (r >> 16).to(torch.uint8),
            (r >> 24).to(torch.int8), ((r << 24) >> 24).to(torch.uint8), (r >> 7).to(torch.int8),
            ((r + 0x8000) & -65536).view(torch.float32).to(torch.bfloat16),
            (r & 0x7FFF0000).view(torch.float32).to(torch.bfloat16), (r & -256).view(torch.float32).to(torch.bfloat16))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def check_wide_byte_code() -> str:
    """Compile :func:`_byte_conversions` as a fused kernel on this process's vector ISA and compare
    it with eager bit for bit, on full-range int32 values (a C cast wraps them) and every int8 and
    uint8 value, over a length with a tail (a NaN equal to any NaN: eager's scalar tail writes
    another NaN pattern than vector code), and with inductor's own code for the same function
    bit for bit, NaNs included; returns the ISA's name ("" when the ISA has no such code)."""
    from torch._inductor.utils import run_and_get_code

    from shardopt.kernels import _cpu_codegen

    assert _cpu_codegen.install()
    gen = torch.Generator().manual_seed(11)
    n = 4099
    r = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    r[:3] = torch.tensor([-(2**31), 2**31 - 1, 0], dtype=torch.int32)
    i8 = (torch.arange(n) % 256 - 128).to(torch.int8)
    u8 = (torch.arange(n) * 7 % 256).to(torch.uint8)
    f = (torch.rand(n, generator=gen, dtype=torch.float64) * 2**32 - 2**31).float().clamp(-(2**31), 2**31 - 256)
    options = {**_cpu_codegen.compile_options(), "fx_graph_cache": False}  # generate the code here

    def own(*args):  # another frame: compiled outside shardopt's kernels, inductor's own code
        return _byte_conversions(*args)

    with _cpu_codegen.fused_kernels():
        got, (code,) = run_and_get_code(torch.compile(_byte_conversions, options=options), r, i8, u8, f)
    inductors = torch.compile(own, options=options)(r, i8, u8, f)
    for k, (a, b, c) in enumerate(zip(_byte_conversions(r, i8, u8, f), got, inductors)):
        nan = a.isnan() & b.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
        assert a.dtype == b.dtype and bool(((_bits(a) == _bits(b)) | nan).all()), (k, a[a != b][:4], b[a != b][:4])
        assert torch.equal(_bits(b), _bits(c)), (k, b[_bits(b) != _bits(c)][:4], c[_bits(b) != _bits(c)][:4])
    isa = _cpu_codegen._state["bytes"]
    if isa:  # the loop was widened and none of ATen's slow forms is left
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        assert f"+=static_cast<int64_t>({2 * pick_vec_isa().nelements(dtype=torch.float)}L)" in code
        assert "convert<int32_t,2,int8_t,1>" not in code and "convert<int32_t,2,float,2>" not in code
        assert "convert<float,2,int32_t,2>" not in code and "convert<int8_t,1,int32_t,2>" not in code
    if isa == "avx2":  # [Note: byte planes and the bf16 weight]: bytes taken by a shuffle, bf16 as the high halves
        assert "_mm256_shuffle_epi8" in code and "convert<at::BFloat16,1,float,2>" in code  # the last: r & -256
        assert code.count("_mm256_set1_epi32(0xFFFF)") == 4, code.count("_mm256_set1_epi32(0xFFFF)")  # body, tail
    return isa


@pytest.mark.launch
def test_wide_byte_code_is_bit_identical_to_eager():
    """8-bit loads and stores and the conversions around them, in loops of two fp32 vectors (see
    [Note: wide bytes]), give the eager bits; on an AVX-512 machine the AVX2 code is checked too,
    in a process whose inductor generates AVX2."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    isa = check_wide_byte_code()
    if isa == "avx512":
        env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
        script = ("import runpy, sys; t = runpy.run_path(sys.argv[1]); "
                  "assert t['check_wide_byte_code']() == 'avx2', 'inductor did not generate AVX2 code'")
        done = subprocess.run([sys.executable, "-c", script, str(Path(__file__))], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]


def test_small_updates_lost_without_master_kept_with_it():
    """Weights near 1 in bf16: an Adam step of 1e-3 is under half an ulp (2**-9), so rounding back each
    step freezes the weights, while fp32 and remainder masters accumulate the updates, and stochastic
    rounding tracks them in expectation."""
    n, steps = 4096, 40
    results = {}
    for mode in ("fp32", "remainder", "stochastic", "none"):
        strategy = make_master(mode, torch.ones(n, dtype=torch.bfloat16), kernels=select("reference"))
        m, v = torch.zeros(n), torch.zeros(n)
        for step in range(1, steps + 1):
            g = torch.ones(n, dtype=torch.bfloat16)  # a steady push: every update is -lr
            s = make_scalars(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=step, grad_scale=1.0)
            strategy.update_(Range(0, n), g, m, v, s, step)
        results[mode] = (strategy.param_shard.float(), strategy.fp32())
    expected = 1.0 - steps * 1e-3
    assert torch.equal(results["none"][0], torch.ones(n))  # lost: never moved
    assert abs(float(results["fp32"][1][0]) - expected) < 1e-5  # the master kept every update
    assert torch.equal(results["remainder"][1], results["fp32"][1])  # remainder rebuilds it bit for bit
    assert torch.equal(results["remainder"][0], results["fp32"][0])
    assert abs(float(results["stochastic"][0].mean()) - expected) < 2e-3  # unbiased on average


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_gradient_statistics_match_fp64(dtype):
    """The step's inf/NaN test and the clipping norm, compiled, against the same sums in fp64."""
    fused = select("fused", dtype=dtype, master="fp32", moments="fp32")
    gen = torch.Generator().manual_seed(5)
    g = (torch.randn(300_001, generator=gen) * torch.logspace(-6, 2, 300_001)).to(dtype)
    exact = g.double()
    for p in (2.0, 1.5):
        got = float(fused.grad_norm_power(g, p))
        want = float(exact.abs().pow(p).sum())
        assert got == pytest.approx(want, rel=1e-5), (p, got, want)
    assert float(fused.grad_max(g)) == float(exact.abs().max())
    assert float(fused.grad_nonfinite(g)) == 0.0
    for bad in (float("inf"), -float("inf"), float("nan"), -float("nan")):
        h = g.clone()
        h[123_457] = bad
        assert float(fused.grad_nonfinite(h)) == 1.0, bad
        assert float(reference.grad_nonfinite(h)) == 1.0, bad
        assert not torch.isfinite(fused.grad_max(h)), bad
    huge = g.clone()  # finite everywhere, but its fp32 sum is not: not an overflow of the gradient
    huge[:4] = torch.tensor([3.0e38, 3.0e38, -0.0, 1e-40]).to(dtype)
    assert float(fused.grad_nonfinite(huge)) == 0.0 and float(reference.grad_nonfinite(huge)) == 0.0
    assert fused.name == "fused"  # compiled, not fallen back to the reference


_USER_CODE = r"""
import json, os, sys, tempfile
import torch
from torch._inductor.utils import run_and_get_code

def user(x):  # bitcasts, an integer hash, 8-bit conversions, lerp and addcmul: what shardopt's additions touch
    i = x.view(torch.int32)
    h = (i * 1103515245 + 12345) ^ (i >> 7)
    y = (h >> 8).to(torch.int8).to(torch.float32) + (h & 0x3F7FFFFF).view(torch.float32) * 0.5
    return torch.addcmul(torch.lerp(y, x, x[0].abs()), x * 0.1, y)

x = torch.randn(4099, generator=torch.Generator().manual_seed(3))

def code():
    torch._dynamo.reset()
    out, (c,) = run_and_get_code(torch.compile(user, options={"fx_graph_cache": False}), x)
    return "\n".join(line for line in c.splitlines() if not line.startswith("# AOT ID")), out  # a per-process count

before, bits_before = code()
import torch.distributed as dist
import shardopt
from shardopt.kernels import _cpu_codegen
with tempfile.TemporaryDirectory() as d:
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "s"), 1), rank=0, world_size=1)
    for master, moments in (("remainder", "8bit"), ("stochastic", "bf16")):  # every addition compiles
        model = torch.nn.Linear(256, 256).to(torch.bfloat16)
        opt = shardopt.ShardedAdamW(model.parameters(), master_weights=master, moments=moments)
        opt.backward(model(torch.randn(4, 256, dtype=torch.bfloat16)).float().square().mean())
        opt.step()
        opt.close()
    dist.destroy_process_group()
after, bits_after = code()
json.dump({"installed": _cpu_codegen.installed(), "wide": _cpu_codegen._state["wide"],
           "fma": _cpu_codegen._state["fma"], "same": before == after,
           "same bits": torch.equal(bits_before.view(torch.int32), bits_after.view(torch.int32))}, sys.stdout)
"""


@pytest.mark.launch
def test_a_users_compiled_code_is_the_same_with_shardopt_imported():
    """shardopt's additions to inductor's CPU code generator apply to its own fused kernels only
    (see _cpu_codegen [Note: scoped to shardopt's kernels]): a user's function compiled before
    shardopt is imported and after shardopt's kernels compiled and ran gets the same code and
    computes the same bits."""
    import json
    import subprocess
    import sys

    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if not pick_vec_isa():
        pytest.skip("inductor finds no vector ISA on this CPU: its kernels are scalar")
    env = {k: v for k, v in os.environ.items() if k != "SHARDOPT_KERNEL"}
    run = subprocess.run([sys.executable, "-c", _USER_CODE], capture_output=True, text=True, timeout=600,
                         env={**env, "SHARDOPT_KERNEL": "fused", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["installed"] and got["wide"] and got["fma"], got  # in place while the user compiled again
    assert got["same"] and got["same bits"], got


def test_the_codecs_compile_bit_for_bit_on_this_torch():
    """The self-check that guards the fused path (see _self_check [Note: self-check]) passes on
    the pinned torch (compiled and eager codecs agree on every hard case) and finds exactly the
    known folds on the older releases (tests/torch_releases.py)."""
    from shardopt.kernels import _self_check
    from torch_releases import folded  # imported here: this file also runs as a script (see above)

    assert _self_check.differences("cpu") == folded()


def _compiler_that(change):
    """Stands in for ``_self_check._compiled``: a compiler whose codecs are eager's with ``change``
    applied to the list of their outputs (what a compiler that gets one codec wrong returns)."""
    from shardopt.kernels import _self_check

    def compiled():
        def run(x, bits):
            out = list(_self_check.all_codecs(x, bits))
            change(out, bits)
            return tuple(out)
        return run, _self_check.remainders_in_place
    return compiled


def _lose_the_fp16_residual(out, bits):
    """A change for :func:`_compiler_that`: x - float(fp16(x)) folded to zero."""
    out[3] = torch.zeros_like(out[3])


def test_a_compiler_that_drops_the_fp16_residual_gets_the_reference_kernels(monkeypatch):
    """A code generator that folds x - float(fp16(x)) to zero is caught before the first fused
    step: shardopt warns once, naming the codec and the torch version, and steps with the
    reference kernels, bit for bit (with SHARDOPT_KERNEL=fused it raises instead)."""
    from shardopt.kernels import _self_check

    monkeypatch.setattr(_self_check, "_compiled", _compiler_that(_lose_the_fp16_residual))
    _self_check.differences.cache_clear()
    try:
        monkeypatch.setenv("SHARDOPT_KERNEL", "auto")
        got = _run("remainder", torch.float16, 4099, "reference")
        with pytest.warns(RuntimeWarning, match=rf"torch {re.escape(torch.__version__)}.*fp16 residual.*reference kernel"):
            kernels = select(dtype=torch.float16, master="remainder", moments="fp32")
            fell_back = _run_with(kernels, "remainder", torch.float16, 4099)
        assert kernels.name == "reference"
        for key in ("m", "v", "param", "rem"):
            a, b = got[key], fell_back[key]
            a, b = (codecs.join_remainder(a), codecs.join_remainder(b)) if key == "rem" else (a, b)
            assert torch.equal(a, b), key
        monkeypatch.setenv("SHARDOPT_KERNEL", "fused")
        with pytest.raises(RuntimeError, match="fp16 residual"):
            _run_with(select(dtype=torch.float16, master="remainder", moments="fp32"), "remainder", torch.float16, 17)
    finally:
        _self_check.differences.cache_clear()  # the next user checks the real compiler


def test_a_compiler_that_rounds_the_moments_twice_gets_the_reference_kernels(monkeypatch):
    """Where inductor's fused multiply-adds are not in place (see _cpu_codegen [Note: fused
    multiply-add]) the compiled moments round products and sums apart, an ulp off eager now and
    then: the self-check names them, and every mode steps with the reference kernels, bit for bit
    (with SHARDOPT_KERNEL=fused it raises instead)."""
    from shardopt.kernels import _self_check

    def round_exp_avg_sq_twice(out, bits):  # an ulp off in places
        out[7] = torch.where(bits.repeat(2) % 7 == 0, torch.nextafter(out[7], torch.tensor(float("inf"))), out[7])

    monkeypatch.setattr(_self_check, "_compiled", _compiler_that(round_exp_avg_sq_twice))
    _self_check.differences.cache_clear()
    try:
        monkeypatch.setenv("SHARDOPT_KERNEL", "auto")
        for mode, dtype in (("fp32", torch.float32), ("stochastic", torch.bfloat16)):
            got = _run(mode, dtype, 257, "reference")
            with pytest.warns(RuntimeWarning, match=rf"torch {re.escape(torch.__version__)}.*AdamW moments"):
                kernels = select(dtype=dtype, master=mode, moments="fp32")
                fell_back = _run_with(kernels, mode, dtype, 257)
            assert kernels.name == "reference"
            for key in got:
                assert torch.equal(got[key], fell_back[key]), (mode, key)
        monkeypatch.setenv("SHARDOPT_KERNEL", "fused")
        with pytest.raises(RuntimeError, match="AdamW moments"):
            _run_with(select(dtype=torch.bfloat16, master="none", moments="fp32"), "none", torch.bfloat16, 17)
    finally:
        _self_check.differences.cache_clear()


def test_a_compiler_that_folds_the_residual_only_when_written_in_place_is_caught(monkeypatch):
    """Inductor's CPU code on torch 2.10 to 2.12 kept x - float(fp16(x)) exact as a new output but
    folded it to zero when fp16(x) was written into an input, as the fused step writes the weight:
    the self-check runs that form too and names it."""
    from shardopt.kernels import _self_check

    def in_place_folding(weights, delta, rems):
        _self_check.remainders_in_place(weights, delta, rems)
        rems[1].zero_()  # the fp16 residual of the in-place write, lost

    monkeypatch.setattr(_self_check, "_compiled", lambda: (_self_check.all_codecs, in_place_folding))
    _self_check.differences.cache_clear()
    try:
        assert _self_check.differences("cpu") == ("fp16 residual written in place",)
    finally:
        _self_check.differences.cache_clear()


@pytest.mark.parametrize("mode,dtype", [("remainder", torch.bfloat16), ("fp32", torch.float16),
                                        ("stochastic", torch.float16), ("none", torch.float16)],
                         ids=["remainder-bf16", "fp32-fp16", "stochastic-fp16", "none-fp16"])
def test_a_compiler_that_folds_the_fp16_residual_leaves_the_other_modes_fused(monkeypatch, mode, dtype):
    """The fallback is as narrow as the fault: with the fp16 residual folded, the modes that do not
    write it keep the fused kernels (bit for bit what they compute with a clean check) without a
    warning, while the fp16 remainder mode falls back (the test above)."""
    from shardopt.kernels import _self_check

    want = _run(mode, dtype, 4099, "fused")  # the real self-check: nothing differs for these modes
    def in_place_folding(weights, delta, rems):
        _self_check.remainders_in_place(weights, delta, rems)
        rems[1].zero_()

    monkeypatch.setattr(_self_check, "_compiled", lambda: (_self_check.all_codecs, in_place_folding))
    monkeypatch.setenv("SHARDOPT_KERNEL", "auto")
    _self_check.differences.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernels = select(dtype=dtype, master=mode, moments="fp32")
            got = _run_with(kernels, mode, dtype, 4099)
        assert kernels.name == "fused"
        assert not [w for w in caught if "shardopt" in str(w.message)], [str(w.message) for w in caught]
        assert _self_check.differences.cache_info().currsize == 1  # the check ran, and let these modes be
        for key in want:
            a, b = want[key], got[key]
            a, b = (codecs.join_remainder(a), codecs.join_remainder(b)) if key == "rem" else (a, b)
            assert torch.equal(a, b), key
    finally:
        _self_check.differences.cache_clear()


def _codecs_used(reference_fn, args: tuple, kwargs: dict) -> tuple[str, ...]:  # noqa: ANN001
    """The checked codecs (of ``_self_check.NAMES``) that ``reference_fn(*args, **kwargs)`` runs, read
    from its arguments, independently of ``_self_check.codecs_run``'s table: AdamW's moments (every step and the 8-bit scan), the 16-bit weight it writes
    (``param``, or ``param_out`` of the fp32 master) and its stored moments (bf16 ones are stored
    with stochastic rounding). None for the gradient statistics."""
    from shardopt.kernels import _self_check

    if reference_fn.__name__ == "moment8_scan":
        return ("AdamW moments",)
    by_dtype = _self_check._WEIGHT_CODECS.get(reference_fn.__name__)
    if by_dtype is None:
        return ()
    given = inspect.signature(reference_fn).bind(*args, **kwargs).arguments
    weight = given.get("param", given.get("param_out"))
    used = ("AdamW moments", *(by_dtype.get(weight.dtype, ()) if isinstance(weight, torch.Tensor) else ()))
    m = given.get("m")
    if isinstance(m, torch.Tensor) and m.dtype == torch.bfloat16:
        used += ("bf16 moments",)
    return used


def _recording_kernels(seen: set):
    """Kernels that run the reference and add to ``seen`` what _codecs_used finds in each call."""
    import types

    from shardopt.kernels import STEP_NAMES

    def recorded(fn):
        def run(*args, **kwargs):
            seen.update(_codecs_used(fn, args, kwargs))
            return fn(*args, **kwargs)
        return run
    return types.SimpleNamespace(name="reference", **{k: recorded(getattr(reference, k)) for k in STEP_NAMES})


def test_the_codecs_of_a_buffer_are_the_codecs_its_calls_run():
    """_self_check.codecs_run (a table of dtype, master mode and moments format) names exactly the
    codecs that _codecs_used finds in the real strategies' kernel calls, for every combination; a fact
    left out stands for all of its values."""
    from shardopt.core._config import MASTER_MODES, MOMENT_FORMATS
    from shardopt.kernels import _self_check
    from shardopt.moments import make_moments

    n = reference.MOMENT_BLOCK * 3
    found = {}
    for mode in MASTER_MODES:
        for dtype in DTYPES:
            for moments in MOMENT_FORMATS:
                seen: set = set()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # fp32 weights with another mode: the fp32 master, with a warning
                    strategy = make_master(mode, torch.randn(n).to(dtype), kernels=_recording_kernels(seen), seed=1)
                mom = make_moments(moments, n, torch.device("cpu"))
                g = torch.randn(n).to(dtype)
                s = make_scalars(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1, grad_scale=1.0)
                strategy.update_(Range(0, n), g, *mom.prepare(Range(0, n), g, s, strategy.kernels), s, 1)
                found[mode, dtype, moments] = seen
                want = _self_check.codecs_run(mode, dtype, moments)
                assert set(want) == seen and len(want) == len(seen), (mode, dtype, moments, want, seen)
    assert set(_self_check.codecs_run(None, None, None)) == set().union(*found.values()) == set(_self_check.NAMES)
    assert set(_self_check.codecs_run("remainder", None, "fp32")) == set().union(
        *(found["remainder", d, "fp32"] for d in DTYPES))


def test_the_kernels_are_chosen_when_the_buffer_is_built(monkeypatch):
    """A Kernels object holds plain functions from construction on, and the self-check runs then:
    with a compiler that folds the fp16 residual, an fp16 remainder buffer's kernels are the
    reference ones (with the warning) before any step, while a bf16 remainder buffer's stay fused."""
    import types

    from shardopt.kernels import STEP_NAMES, Kernels, _self_check

    assert "__getattr__" not in vars(Kernels)
    monkeypatch.setenv("SHARDOPT_KERNEL", "auto")
    monkeypatch.setattr(_self_check, "_compiled", _compiler_that(_lose_the_fp16_residual))
    _self_check.differences.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kept = select(dtype=torch.bfloat16, master="remainder", moments="bf16")
        assert not [w for w in caught if "shardopt" in str(w.message)], [str(w.message) for w in caught]
        assert kept.name == "fused" and _self_check.differences.cache_info().currsize == 1
        with pytest.warns(RuntimeWarning, match="fp16 residual"):
            fell_back = select(dtype=torch.float16, master="remainder", moments="fp32")
        assert fell_back.name == "reference"
        for name in STEP_NAMES:
            assert type(getattr(kept, name)) is types.FunctionType and name in vars(kept), name
            assert getattr(fell_back, name) is getattr(reference, name), name
            assert getattr(kept, name) is not getattr(reference, name), name
        muon = select(dtype=torch.float16, master="remainder", moments="fp32", rule="muon")
        assert muon.name == "fused" and muon.codecs == ()  # runs no step: only the gradient statistics
    finally:
        _self_check.differences.cache_clear()


def _fresh_compiles(monkeypatch):
    """From here to the end of the test, every fused function compiles anew (a new compiled function
    per variant, over a new code object), as in a process that has not compiled it yet: dynamo
    forgets too which of them it found dynamic in size."""
    import functools

    from shardopt.kernels import fused

    torch._dynamo.reset()
    monkeypatch.setattr(fused, "_compiled", functools.cache(fused._compiled.__wrapped__))


def _inductor_replaced(monkeypatch, compile_graph):
    """Fused functions compiled afresh (see _fresh_compiles) through dynamo as always, with
    ``compile_graph(gm)`` in place of inductor: it returns what runs as the compiled graph (or
    raises, a failure to compile)."""
    import torch._inductor.compile_fx

    _fresh_compiles(monkeypatch)
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", lambda gm, example_inputs, **kw: compile_graph(gm))


def test_a_fused_kernel_that_fails_to_compile_falls_back_to_the_reference(monkeypatch):
    """torch.compile raising at a fused function's first call: one warning, that call and every
    later one runs the reference (the object's functions are the reference ones from then on, and
    a caller that kept the fused one gets the reference too); with SHARDOPT_KERNEL=fused it raises."""
    from shardopt.kernels import STEP_NAMES, fused

    def no_compiler(name, form):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(fused, "_compiled", no_compiler)
    monkeypatch.setenv("SHARDOPT_KERNEL", "auto")
    kernels = select(dtype=torch.float32, master="fp32", moments="fp32")
    assert kernels.name == "fused"
    kept = kernels.step_fp32
    (w, m, v), (w_ref, m_ref, v_ref) = [(torch.ones(8), torch.zeros(8), torch.zeros(8)) for _ in range(2)]
    s = make_scalars(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1, grad_scale=1.0)
    g = torch.full((8,), 0.5)
    with pytest.warns(RuntimeWarning, match=r"torch.compile of the fused update failed \(RuntimeError: no C\+\+"):
        kernels.step_fp32(w, g, m, v, s, None)
    reference.step_fp32(w_ref, g, m_ref, v_ref, s, None)
    assert kernels.name == "reference" and all(getattr(kernels, k) is getattr(reference, k) for k in STEP_NAMES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second compile
        kept(w, g, m, v, s, None)
    reference.step_fp32(w_ref, g, m_ref, v_ref, s, None)
    assert torch.equal(w, w_ref) and torch.equal(m, m_ref) and torch.equal(v, v_ref)
    monkeypatch.setenv("SHARDOPT_KERNEL", "fused")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        select(dtype=torch.float32, master="fp32", moments="fp32").grad_max(g)


def _step_args():
    w, m, v = torch.ones(8), torch.zeros(8), torch.zeros(8)
    s = make_scalars(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1, grad_scale=1.0)
    return w, torch.full((8,), 0.5), m, v, s


def _kernels_compiled_as(monkeypatch, compile_graph):
    """fp32 kernels compiled through dynamo with ``compile_graph`` for inductor (see
    _inductor_replaced), and the step's arguments with the state one reference step leaves (what
    the step must leave, once)."""
    _inductor_replaced(monkeypatch, compile_graph)
    monkeypatch.setenv("SHARDOPT_KERNEL", "auto")
    args = _step_args()
    w_once, g, m_once, v_once, s = _step_args()
    reference.step_fp32(w_once, g, m_once, v_once, s, None)
    return select(dtype=torch.float32, master="fp32", moments="fp32"), args, (w_once, m_once, v_once)


def test_an_error_of_the_compiled_step_propagates_and_the_step_is_not_run_twice(monkeypatch):
    """A compiled step that fails while it runs (out of memory, a fault in the generated code),
    after writing part of its tensors: the error reaches the caller with a note saying the shard
    may be partly written, no warning, the object stays fused, and the reference does not run the
    step again over the written tensors (which would apply it twice)."""
    def half_written_then_oom(gm):
        def graph(*args):
            gm(*args)  # the whole step written once (the graph's in-place writes) ...
            raise torch.OutOfMemoryError("out of memory while running the kernel")  # ... then a fault
        return graph

    kernels, (w, g, m, v, s), (w_once, m_once, v_once) = _kernels_compiled_as(monkeypatch, half_written_then_oom)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        with pytest.raises(torch.OutOfMemoryError) as raised:
            kernels.step_fp32(w, g, m, v, s, None)
    note = " ".join(getattr(raised.value, "__notes__", []))
    assert "step_fp32 while it ran" in note and "partly written" in note and "not run again" in note, note
    assert torch.equal(w, w_once) and torch.equal(m, m_once) and torch.equal(v, v_once)  # one step, not two
    assert kernels.name == "fused" and kernels.step_fp32 is not reference.step_fp32


def test_a_statistic_that_fails_while_running_says_it_wrote_nothing(monkeypatch):
    def failing(gm):
        def graph(*args):
            raise RuntimeError("illegal memory access")
        return graph

    kernels, *_ = _kernels_compiled_as(monkeypatch, failing)
    with pytest.raises(RuntimeError, match="illegal memory access") as raised:
        kernels.grad_max(torch.ones(4))
    assert "writes nothing" in " ".join(raised.value.__notes__)
    assert kernels.name == "fused"


def test_a_compile_error_raised_at_the_first_call_runs_the_reference_once(monkeypatch):
    """torch.compile compiles at the first call and raises (dynamo's BackendCompilerFailed around
    the compiler's error) before the compiled code runs, nothing written: the reference runs the
    call once, with the fallback warning naming the error."""
    def fails_to_compile(gm):
        raise RuntimeError("C++ compile error")

    kernels, (w, g, m, v, s), (w_once, m_once, v_once) = _kernels_compiled_as(monkeypatch, fails_to_compile)
    with pytest.warns(RuntimeWarning, match=r"(?s)fused update failed \(.*C\+\+ compile error.*nothing was written"):
        kernels.step_fp32(w, g, m, v, s, None)
    assert torch.equal(w, w_once) and torch.equal(m, m_once) and torch.equal(v, v_once)
    assert kernels.name == "reference"


def _recompile_limit(limit: int):  # noqa: ANN202 - a config patch (context manager)
    """Dynamo's limit on the graphs of one function, lowered to ``limit`` (named cache_size_limit
    before torch 2.6)."""
    config = torch._dynamo.config
    return config.patch(**{"recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit": limit})


# (master mode, weight dtype, moments, amsgrad, maximize): six variants of step_fp32 alone, with two
# segment sizes each twelve graphs of one reference function, more than dynamo's default limit of 8
VARIANTS = [("fp32", torch.float32, "fp32", False, False), ("fp32", torch.float32, "fp32", True, True),
            ("fp32", torch.bfloat16, "fp32", False, True), ("fp32", torch.bfloat16, "bf16", True, False),
            ("fp32", torch.float16, "fp32", True, False), ("fp32", torch.bfloat16, "8bit", False, False),
            ("remainder", torch.bfloat16, "fp32", True, True), ("remainder", torch.float16, "bf16", False, False),
            ("stochastic", torch.bfloat16, "bf16", False, True), ("none", torch.float16, "fp32", True, False)]


def _variant_steps(kernels, mode: str, dtype: torch.dtype, moments: str, amsgrad: bool, maximize: bool,  # noqa: ANN001
                   sizes: tuple[int, ...] = (64, 320)) -> dict:
    """Three steps of one buffer made of segments of ``sizes`` elements (a param group each), the
    learning rate a tensor on odd steps; the buffer's every tensor after them."""
    from shardopt.moments import make_moments

    n = sum(sizes)
    torch.manual_seed(n)
    strategy = make_master(mode, torch.randn(n).to(dtype), kernels=kernels, seed=7, logical=lambda local: 64 + local)
    mom = make_moments(moments, n, torch.device("cpu"))
    mom.load_(torch.randn(n) * 0.1, torch.rand(n) * 0.01)
    vmax = torch.rand(n).to(torch.float32 if moments == "fp32" else torch.bfloat16) * 0.01 if amsgrad else None
    for step in range(1, 4):
        g = (torch.randn(n, generator=torch.Generator().manual_seed(step)) * 4).to(dtype)
        lr = torch.tensor(1e-2) if step % 2 else 1e-2
        s = make_scalars(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, step=step,
                         grad_scale=-0.25 if maximize else 0.25)
        start = 0
        for size in sizes:
            r = Range(start, start + size)
            strategy.update_(r, g[r.as_slice()], *mom.prepare(r, g[r.as_slice()], s, kernels), s, step,
                             None if vmax is None else vmax[r.as_slice()])
            start += size
    out = {"param": strategy.param_shard, "master": strategy.fp32(), "vmax": vmax, **mom.tensors()}
    if mode == "remainder":
        out["rem"] = strategy.remainder
    return out


def test_more_variants_than_the_recompile_limit_compile_and_step_as_the_reference(monkeypatch):
    """One process stepping many buffers, each a variant of dtype, master mode, moments, amsgrad,
    maximize and tensor learning rate over two segment sizes, with dynamo's limit lowered to 2
    graphs per function (twelve graphs of step_fp32 alone here; the default limit is 8): every
    variant compiles within the limit (see fused [Note: one compile per variant]), nothing falls
    back or warns, and each steps bit for bit as the reference with a correctly rounded sqrt. A
    variant whose codecs this torch's compiler gets wrong (the fp16 residual before torch 2.13, see
    test_a_compiler_that_drops_the_fp16_residual_*) runs the reference by the self-check's choice, not the limit's: left out."""
    from correct_sqrt import correctly_rounded_sqrt

    from shardopt.kernels import _self_check

    exact = [case for case in VARIANTS if not _self_check.failing(_self_check.codecs_run(*case[:3]), "cpu")]
    assert len(exact) >= len(VARIANTS) - 1, exact  # at most the fp16 residual's variant
    _fresh_compiles(monkeypatch)
    monkeypatch.setenv("SHARDOPT_KERNEL", "auto")
    with _recompile_limit(2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mode, dtype, moments, amsgrad, maximize in exact:
            case = (mode, dtype, moments, amsgrad, maximize)
            kernels = select(dtype=dtype, master=mode, moments=moments)
            got = _variant_steps(kernels, *case)
            assert kernels.name == "fused", case
            with correctly_rounded_sqrt():
                want = _variant_steps(select("reference"), *case)
            for key, a in want.items():
                b = got[key]
                assert (a is None and b is None) or torch.equal(a, b), (case, key)
    assert not [w for w in caught if "shardopt" in str(w.message)], [str(w.message) for w in caught]


def test_the_recompile_limit_met_falls_back_to_the_reference_and_says_nothing_was_written(monkeypatch):
    """A variant that needs more graphs than dynamo allows (its limit lowered to 1, a second
    segment size asks for a second graph): dynamo refuses to compile (FailOnRecompileLimitHit,
    which is no TorchDynamoException) before anything ran; that is a failure to compile like any
    other: one warning naming it, the reference runs the call (the segment's tensors are the
    reference's, bit for bit), no error and no note of a partly written shard."""
    from shardopt.kernels import STEP_NAMES

    _fresh_compiles(monkeypatch)
    monkeypatch.setenv("SHARDOPT_KERNEL", "auto")

    def segment(n: int) -> tuple:
        torch.manual_seed(n)
        param, rem = torch.randn(n).to(torch.bfloat16), torch.randint(-(2**15), 2**15, (n,), dtype=torch.int32)
        planes = ((rem & 0xFF).to(torch.int8), (rem >> 8).to(torch.int8))
        g, m, v = torch.randn(n).to(torch.bfloat16), torch.randn(n) * 0.1, torch.rand(n) * 0.01
        s = make_scalars(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, step=3, grad_scale=0.5)
        return param, planes, g, m, v, s, None

    with _recompile_limit(1):
        kernels = select(dtype=torch.bfloat16, master="remainder", moments="fp32")
        kernels.step_remainder(*segment(64))  # compiles this variant's first graph
        assert kernels.name == "fused"
        got, want = segment(320), segment(320)
        with pytest.warns(RuntimeWarning, match=r"(?s)FailOnRecompileLimitHit.*recompile.limit.*nothing was written"):
            kernels.step_remainder(*got)
    reference.step_remainder(*want)
    for a, b in zip(want[:5], got[:5]):
        for x, y in zip(a, b) if isinstance(a, tuple) else ((a, b),):
            assert torch.equal(x, y)
    assert kernels.name == "reference" and all(getattr(kernels, k) is getattr(reference, k) for k in STEP_NAMES)


_WITHOUT_ADDITIONS = r"""
import json, sys
import torch
from shardopt.kernels import _cpu_codegen, _self_check
_cpu_codegen._state["tried"] = True  # as on a torch whose code generator is laid out otherwise
sys.path.insert(0, "tests")
from test_kernels import _run, _ulps
out = {"installed": _cpu_codegen.installed(), "differences": _self_check.differences("cpu")}
for dtype in (torch.bfloat16,):  # the bitcasts the additions vectorise are bf16's
    ref, fused = _run("fp32", dtype, 4099, "reference"), _run("fp32", dtype, 4099, "fused")
    out[str(dtype)] = [_ulps(ref["param"], fused["param"]),  # test_fused_matches_reference's tolerances
                       torch.allclose(ref["master"], fused["master"], rtol=1e-6, atol=2.5e-7),
                       torch.allclose(ref["m"], fused["m"], rtol=1e-6, atol=1e-7),
                       torch.allclose(ref["v"], fused["v"], rtol=1e-6, atol=1e-9)]
json.dump(out, sys.stdout)
"""


@pytest.mark.launch
def test_without_the_code_generator_additions_the_fused_kernels_stay_exact():
    """The fallback for a torch whose inductor is laid out otherwise (see _cpu_codegen): the
    additions are left out, the codecs still compile bit for bit, and the fused step agrees with
    the reference as closely as with the additions (test_fused_matches_reference's tolerances)."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "SHARDOPT_KERNEL": "fused"}  # the cache key names the additions (compile_options)
    run = subprocess.run([sys.executable, "-c", _WITHOUT_ADDITIONS], capture_output=True, text=True, timeout=600,
                         env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["installed"] is False, got
    from torch_releases import folded

    assert got["differences"] == list(folded()), got
    for dtype in ("torch.bfloat16",):
        ulps, *close = got[dtype]
        assert ulps <= 1 and all(close), (dtype, got)


def one_rank_meets_the_recompile_limit_case(steps: int = 4) -> tuple[list[str], float]:
    """ShardedAdamW with the fused kernels on every rank, the same data on every rank, and dynamo's
    limit lowered to 1 graph per function on rank 0 only, so that rank 0's kernels meet it at their
    second segment size: (this rank's shardopt warnings, the largest difference of the weights
    from torch.optim.AdamW's after ``steps`` steps)."""
    import copy
    import functools

    import torch.distributed as dist

    import shardopt
    from models import batch, make_model, param_groups
    from shardopt.kernels import fused

    compiled, kernel = fused._compiled, os.environ.get("SHARDOPT_KERNEL")
    os.environ["SHARDOPT_KERNEL"] = "auto"
    torch._dynamo.reset()
    fused._compiled = functools.cache(compiled.__wrapped__)  # compiled afresh (see _fresh_compiles)
    try:
        with _recompile_limit(1) if dist.get_rank() == 0 else contextlib.nullcontext(), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = make_model(seed=1)
            ref_model = copy.deepcopy(model)
            opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                                        bucket_cap_mb=1e-4)
            ref_opt = torch.optim.AdamW(param_groups(ref_model), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
            for step in range(steps):
                opt.zero_grad()
                opt.backward(model(batch(0, step)))
                opt.step()
                ref_model.zero_grad()
                ref_model(batch(0, step)).backward()
                for p in ref_model.parameters():  # a zero gradient for the unused parameter, as ShardedAdamW's
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
                ref_opt.step()
            opt.close()
    finally:
        fused._compiled = compiled
        os.environ.pop("SHARDOPT_KERNEL", None)
        if kernel is not None:
            os.environ["SHARDOPT_KERNEL"] = kernel
    worst = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(model.parameters(), ref_model.parameters()))
    return [str(w.message) for w in caught if "shardopt" in str(w.message)], worst


def test_a_rank_that_meets_the_recompile_limit_steps_on_with_the_others(pools):
    """At two ranks, rank 0's fused kernels meet dynamo's recompile limit mid-step and rank 1's do
    not: rank 0 warns and steps with the reference, rank 1 stays fused, neither waits for the other
    (each updates its own shard; the gathers go on), and the weights are torch.optim.AdamW's to
    the tolerance of the two kernels (fp32 weights a couple of ulps apart: the eager sqrt)."""
    (warned, worst0), (quiet, worst1) = pools(2).run(one_rank_meets_the_recompile_limit_case, timeout=300)
    assert warned and all("FailOnRecompileLimitHit" in w and "nothing was written" in w for w in warned), warned
    assert not quiet, quiet
    assert max(worst0, worst1) <= 2e-6, (worst0, worst1)
