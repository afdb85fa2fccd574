"""Tier 1: the Muon reference math against torch.optim.Muon, bit for bit, no process group."""
from __future__ import annotations

import re

import pytest
import torch

from shardopt.kernels.muon_reference import adjusted_lr, muon_step_, orthogonalize

SHAPES = [(64, 64), (128, 32), (32, 128), (96, 48)]  # square, tall, wide, tall 2:1
STEPS = 5


def _gradients(shape: tuple[int, int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Magnitudes that change from step to step, so the momentum and the normalisation both matter.
    return [torch.randn(shape, generator=g) * (0.1 + 0.5 * k) for k in range(STEPS)]


def _run_torch(w0: torch.Tensor, grads: list[torch.Tensor], **hp) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Muon([p], **hp)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt.state[p]["momentum_buffer"]


def _run_ours(w0: torch.Tensor, grads: list[torch.Tensor], **hp) -> tuple[torch.Tensor, torch.Tensor]:
    w, buf = w0.clone(), torch.zeros_like(w0)
    for g in grads:
        muon_step_(w, g.clone(), buf, **hp)
    return w, buf


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_five_steps_equal_torch_muon_bit_for_bit(shape, nesterov, adjust_lr_fn, weight_decay):
    torch.manual_seed(0)
    w0 = torch.randn(shape) * 0.02
    grads = _gradients(shape, seed=shape[0] * 1000 + shape[1])
    hp = dict(lr=0.02, weight_decay=weight_decay, momentum=0.95, nesterov=nesterov,
              ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=adjust_lr_fn)
    w_ref, buf_ref = _run_torch(w0, grads, **hp)
    w, buf = _run_ours(w0, grads, **hp)
    assert torch.equal(buf, buf_ref)
    assert torch.equal(w, w_ref)
    assert not torch.equal(w, w0)  # the update did something


def test_other_hyperparameters_and_torch_defaults_match():
    # Non-default coefficients, steps, eps and momentum; and muon_step_'s defaults against torch's.
    w0, grads = torch.randn(48, 80) * 0.02, _gradients((48, 80), seed=7)
    hp = dict(lr=0.05, weight_decay=0.01, momentum=0.9, nesterov=True, ns_coefficients=(3.0, -3.2, 1.2),
              eps=1e-5, ns_steps=3, adjust_lr_fn="match_rms_adamw")
    for a, b in zip(_run_ours(w0, grads, **hp), _run_torch(w0, grads, **hp)):
        assert torch.equal(a, b)
    for a, b in zip(_run_ours(w0, grads, lr=1e-3), _run_torch(w0, grads)):
        assert torch.equal(a, b)


def test_zero_gradients_take_the_eps_floor():
    w0 = torch.randn(40, 24)
    grads = [torch.zeros(40, 24)] * 3
    for a, b in zip(_run_ours(w0, grads, lr=0.1), _run_torch(w0, grads, lr=0.1)):
        assert torch.equal(a, b)
    assert torch.equal(orthogonalize(torch.zeros(8, 16)), torch.zeros(8, 16, dtype=torch.bfloat16))


def test_orthogonalize_returns_bf16_near_orthogonal_and_leaves_its_input_alone():
    x = torch.randn(96, 32, dtype=torch.bfloat16)
    before = x.clone()
    o = orthogonalize(x)
    assert o.dtype == torch.bfloat16 and o.shape == (96, 32)
    assert torch.equal(x, before)
    s = torch.linalg.svdvals(o.float())
    assert s.min() > 0.5 and s.max() < 1.5, s


def test_adjusted_lr():
    assert adjusted_lr(0.02, None, (128, 32)) == 0.02 * 2.0
    assert adjusted_lr(0.02, "original", (32, 128)) == 0.02
    assert adjusted_lr(0.02, "match_rms_adamw", (32, 128)) == 0.02 * (0.2 * 128 ** 0.5)
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        adjusted_lr(0.02, "spectral", (4, 4))


@pytest.mark.parametrize("shape", [(64,), (4, 4, 4), ()])
def test_non_matrix_raises_naming_the_shape(shape):
    t = torch.zeros(shape)
    with pytest.raises(ValueError, match=re.escape(f"param has shape {tuple(shape)}")):
        muon_step_(t, t.clone(), t.clone(), lr=0.1)
    with pytest.raises(ValueError, match="2-D"):
        orthogonalize(t)


def test_mismatched_shapes_and_dtypes_raise():
    w = torch.zeros(8, 4)
    with pytest.raises(ValueError, match=r"grad \(4, 8\)"):
        muon_step_(w, torch.zeros(4, 8), torch.zeros(8, 4), lr=0.1)
    with pytest.raises(ValueError, match="momentum_buffer is torch.bfloat16"):
        muon_step_(w, torch.zeros(8, 4), torch.zeros(8, 4, dtype=torch.bfloat16), lr=0.1)
