"""Tier 2: bad input gets a precise exception on every rank, never a hang.

Catches validation that is missing, messages that do not name the offending value, and local
errors on one rank that would leave the other ranks waiting in a collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import shardopt
from models import make_model
from usage_reference import error_of


def bad_arguments_case() -> dict:
    params = lambda: make_model().parameters()  # noqa: E731
    A = shardopt.ShardedAdamW
    cases = {
        "master": lambda: A(params(), master_weights="bogus"),
        "stage": lambda: A(params(), stage=3),
        "lr": lambda: A(params(), lr=-1.0),
        "betas": lambda: A(params(), betas=(0.9, 1.5)),
        "eps": lambda: A(params(), eps=-1e-8),
        "wd": lambda: A(params(), weight_decay=-0.1),
        "group_lr": lambda: A([{"params": list(params()), "lr": float("nan")}]),
        "empty": lambda: A([]),
        "frozen_only": lambda: A([nn.Parameter(torch.ones(2), requires_grad=False)]),
        "non_leaf": lambda: A([nn.Parameter(torch.ones(3)) * 2]),
        "loss_scale_str": lambda: A(params(), loss_scale="huge"),
        "loss_scale_neg": lambda: A(params(), loss_scale=-4.0),
        "fp64": lambda: A([nn.Parameter(torch.ones(3, dtype=torch.float64))]),
        "devices": lambda: A([nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3, device="meta"))]),
        "bucket": lambda: A(params(), bucket_cap_mb=0),
        "accum": lambda: A(params(), accumulate_dtype=torch.int8),
    }
    return {k: error_of(f) for k, f in cases.items()}


def test_bad_arguments_name_the_value(pools):
    expected = {
        "master": ("ValueError", "'bogus'"), "stage": ("ValueError", "stage=3"), "lr": ("ValueError", "lr=-1.0"),
        "betas": ("ValueError", "1.5"), "eps": ("ValueError", "eps=-1e-08"), "wd": ("ValueError", "weight_decay=-0.1"),
        "group_lr": ("ValueError", "lr=nan"), "empty": ("ValueError", "empty parameter list"),
        "frozen_only": ("ValueError", "requires_grad=True"), "non_leaf": ("ValueError", "non-leaf tensor of shape (3,)"),
        "loss_scale_str": ("ValueError", "'huge'"), "loss_scale_neg": ("ValueError", "scale=-4.0"),
        "fp64": ("TypeError", "torch.float64"), "devices": ("ValueError", "meta"),
        "bucket": ("ValueError", "bucket_cap_mb"), "accum": ("ValueError", "torch.int8"),
    }
    for rank_result in pools(2).run(bad_arguments_case):
        for key, (kind, needle) in expected.items():
            got = rank_result[key]
            assert got is not None, f"{key}: no exception"
            assert got[0] == kind and needle in got[1], (key, got)


def mismatch_case(kind: str) -> tuple[str, str] | None:
    rank = dist.get_rank()
    if kind == "shape":
        model = make_model(dim=17 if rank == 0 else 19)
        params = model.parameters()
    elif kind == "count":
        model = make_model()
        params = list(model.parameters()) + ([nn.Parameter(torch.ones(2))] if rank == 1 else [])
    elif kind == "dtype":
        model = make_model(dtype=torch.bfloat16 if rank == 1 else torch.float32)
        params = model.parameters()
    else:  # an error on one rank only must reach the other rank too
        params = [nn.Parameter(torch.ones(3, dtype=torch.float64 if rank == 1 else torch.float32))]
    return error_of(lambda: shardopt.ShardedAdamW(params))


def test_parameter_sets_that_differ_across_ranks(pools):
    pool = pools(2)
    for kind, needle in [("shape", "#"), ("count", "rank 1 has"), ("dtype", "bfloat16"), ("local", "float64")]:
        results = pool.run(mismatch_case, kind, timeout=60)
        for got in results:
            assert got is not None and needle in got[1], (kind, got)
        assert results[0][0] == results[1][0]


def sparse_case() -> tuple[str, str] | None:
    emb = nn.Embedding(10, 4, sparse=True)
    opt = shardopt.ShardedAdamW(emb.parameters())
    return error_of(lambda: opt.backward(emb(torch.tensor([1, 2])).sum()))


def test_sparse_gradient_is_refused(pools):
    for got in pools(2).run(sparse_case, timeout=60):
        assert got is not None and got[0] == "TypeError" and "sparse" in got[1], got
