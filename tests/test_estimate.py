"""Tier 1 and tier 2: ``estimate_memory`` against the ZeRO formulas and against measured bytes.

Tier 1 (no process group) checks the estimate for large world sizes against the bytes-per-
parameter formulas written out here, padding of odd shapes, the communication buffers of a
hand-worked bucket schedule, the communication volumes, argument errors and the command line.
Tier 2 builds ``ShardedAdamW`` for the example GPT on 1, 2 and 4 gloo ranks (groups within one
pool of 4) and compares each rank's measured bytes with the estimate: equal in every category
after the first step, and after the second (buckets reduced in the learned order) equal but for
the buffers, which move by at most one bucket, and within 1% in total. Catches a formula that
drifts from the optimizer: a category no longer sharded, padding that changed, more buffers.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from shardopt.estimate import estimate_memory
from shardopt.estimate.__main__ import main as cli_main
from shardopt.estimate.__main__ import parse_count
from shardopt.memory import CATEGORIES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAP_MIB = 25.0
BIG = 7_000_000_000
MiB = 2**20

# Bytes per parameter on one rank, by hand from the ZeRO paper's accounting (N ranks), without
# staging buffers: (stage, master_weights, weight bytes) -> formula.
FORMULAS = {
    (1, "fp32", 2): lambda n: 2 + 2 + 12 / n,
    (1, "remainder", 2): lambda n: 2 + 2 + 10 / n,
    (1, "stochastic", 2): lambda n: 2 + 2 + 8 / n,
    (1, "none", 2): lambda n: 2 + 2 + 8 / n,
    (2, "fp32", 2): lambda n: 2 + (2 + 12) / n,
    (2, "remainder", 2): lambda n: 2 + (2 + 10) / n,
    (2, "stochastic", 2): lambda n: 2 + (2 + 8) / n,
    (2, "none", 2): lambda n: 2 + (2 + 8) / n,
    (1, "fp32", 4): lambda n: 4 + 4 + 8 / n,  # fp32 weights are their own master
    (2, "fp32", 4): lambda n: 4 + (4 + 8) / n,
}


# -- tier 1 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [8, 64, 1024])
@pytest.mark.parametrize("key", sorted(FORMULAS), ids=lambda k: f"s{k[0]}-{k[1]}-{k[2]}B")
def test_large_world_sizes_follow_zero_formulas(world_size, key):
    stage, mode, wbytes = key
    for dtype in ([torch.bfloat16, torch.float16] if wbytes == 2 else [torch.float32]):
        e = estimate_memory(BIG, world_size, stage, mode, dtype)
        without_staging = (e.total - e.buffers) / e.padded_numel  # per element of the padded buffer
        assert without_staging == pytest.approx(FORMULAS[key](world_size), rel=1e-6), (e, dtype)
        # Each bucket of the cap is padded to a multiple of world_size * 8 elements: under one such
        # unit per bucket (at most 8 * 1024 elements of a 25 MiB bucket: 6.6e-4 at 1024 ranks in bf16).
        buckets = -(-BIG * wbytes // (CAP_MIB * MiB))
        assert e.params == wbytes * e.padded_numel and 0 <= e.padded_numel - BIG < buckets * 8 * world_size
        # stage 2 stages three buckets of the cap (no parameter is larger here); stage 1 none.
        assert e.buffers == (3 * CAP_MIB * MiB if stage == 2 else 0)
        # gloo also receives the other ranks' copies of this rank's piece of each bucket in flight
        # ((world_size - 1) / world_size of a bucket): two in flight, whatever the world size.
        g = estimate_memory(BIG, world_size, stage, mode, dtype, backend="gloo")
        assert g.buffers - e.buffers == 2 * CAP_MIB * MiB * (world_size - 1) // world_size
        assert g.total - g.buffers == e.total - e.buffers
        assert e.ddp_total == 16 * BIG
        ring = (world_size - 1) / world_size * wbytes * e.padded_numel
        assert e.comm_bytes == pytest.approx((3 if stage == 1 else 2) * ring, rel=1e-6)
        assert e.ddp_comm == pytest.approx(2 * ring * BIG / e.padded_numel, rel=1e-6)
        assert e.comm_seconds(50.0) == pytest.approx(e.comm_bytes / 50e9)


def test_fp32_weights_ignore_the_master_mode():
    a = estimate_memory(10**6, 4, 2, "remainder", "fp32")
    b = estimate_memory(10**6, 4, 2, "fp32", torch.float32)
    assert a.master_weights == "fp32" and a.by_category() == b.by_category()
    assert a.master == a.extra == 0


def test_padding_of_odd_shapes_is_exact():
    # Starts at multiples of 8: [0, 17) [24, 25) [32, 803); the buffer rounds up to 3 * 8 = 24: 816.
    e = estimate_memory(None, 3, 2, "fp32", "bf16", param_shapes=[(257, 3), (1,), (17,)])
    assert (e.num_params, e.padded_numel) == (17 + 1 + 771, 816)
    assert (e.params, e.grads, e.master, e.exp_avg) == (816 * 2, 816 * 2 // 3, 816 * 4 // 3, 816 * 4 // 3)
    one = estimate_memory(None, 1, 1, "none", "fp16", param_shapes=[(1,)])
    assert one.padded_numel == 8 and one.total == 8 * (2 + 2 + 8)


SHAPES = [(528,), (800,), (560,), (10, 100), (520,), (600,)]


def test_buffers_replay_the_reducer_in_buffer_order():
    # The 1 KiB cap holds 512 bf16 elements and every parameter is larger, so each gets its own
    # bucket. Shapes are given in model order and the buffer reverses them: buckets of 600, 520,
    # 1000, 560, 800 and 528 elements, each padded to a multiple of 2 * 8: 608, 528, 1008, 560,
    # 800, 528. Three buckets are alive at once (two reductions in flight and the next one).
    kw = dict(param_shapes=SHAPES, bucket_cap_mb=1 / 1024)
    e = estimate_memory(None, 2, 2, "fp32", "bf16", **kw)
    assert e.padded_numel == 608 + 528 + 1008 + 560 + 800 + 528 == 4032
    # NCCL, stage 2: staging only; windows of three: 2144, 2096, 2368, 1888 elements.
    assert e.buffers == 2368 * 2 and e.buffers_slack == 1008 * 2
    assert estimate_memory(None, 2, 1, "fp32", "bf16", **kw).buffers == 0
    # gloo (the rank-order path): each rank owns half of every bucket and receives the other rank's
    # copy of it, half the bucket, in one of the bucket's two all-to-alls (rank 0 in the first, from
    # the rank above, rank 1 in the second), held until the second lands: 304 264 504 280 400 264
    # elements. Three collectives are alive at once (two waited on, one just issued), so a bucket's
    # half is still held when the next bucket's is received: at most 504 + 280 (bucket 560's first
    # all-to-all issued while 1008's second is in flight, on rank 0; 560's second while 1008's
    # second is, on rank 1).
    s1 = {r: estimate_memory(None, 2, 1, "fp32", "bf16", backend="gloo", rank=r, **kw) for r in (0, 1)}
    assert s1[0].buffers == s1[1].buffers == 2 * (504 + 280)
    assert estimate_memory(None, 2, 1, "fp32", "bf16", backend="gloo", rank=1, **kw).rank == 1
    # Stage 2: a bucket's staging lives from its gradient to its second all-to-all's wait.
    s2 = estimate_memory(None, 2, 2, "fp32", "bf16", backend="gloo", rank=1, **kw)
    assert s2.buffers_slack == 2 * (1008 + 504)  # the largest bucket staged, and the half it receives
    # NCCL, reduce_dtype=torch.float32: each reduction reads an fp32 copy of its bucket (4 bytes per
    # element) until it lands. Stage 1 (all-reduce in place, but for the copy): three copies alive
    # at the peak, 1008 + 560 + 800. Stage 2: those buckets staged in bf16 as well.
    w1 = estimate_memory(None, 2, 1, "fp32", "bf16", reduce_dtype=torch.float32, **kw)
    assert w1.buffers == 4 * (1008 + 560 + 800) and w1.buffers_slack == 4 * 1008
    w2 = estimate_memory(None, 2, 2, "fp32", "bf16", reduce_dtype=torch.float32, **kw)
    assert w2.buffers == (2 + 4) * (1008 + 560 + 800) and w2.buffers_slack == (2 + 4) * 1008
    # Without shapes: three buckets of max(cap, largest parameter), never more than the gradient.
    assert estimate_memory(BIG, 8, 2, largest_param=10**8).buffers == 3 * 2 * 10**8
    assert estimate_memory(1000, 8, 2).buffers == 2 * 1024  # the whole (padded) gradient
    assert estimate_memory(1000, 8, 1, backend="gloo").buffers == 2 * 1024 * 7 // 8  # the 7 other ranks' pieces


def test_buffers_follow_the_order_gradients_arrive():
    # Buffer order A(16) D(400) B(600) C(520) F(616) with a 512-element cap: buckets [A, D] = 416,
    # [B] = 600 + 8, [C] = 520 + 8, [F] = 616 + 8 padding (each a multiple of 2 * 8). Shapes are given
    # in optimizer order (reversed).
    shapes = [(8, 77), (520,), (600,), (400,), (16,)]  # F, C, B, D, A
    kw = dict(param_shapes=shapes, bucket_cap_mb=1 / 1024)
    first = estimate_memory(None, 2, 2, "fp32", "bf16", **kw)
    assert first.buffers == 2 * (608 + 528 + 624)  # first pass, buffer order: the last three buckets
    # A arrives first and D last: bucket [A, D] is staged from the start and launched at the end,
    # so all four buckets are staged when F arrives.
    later = estimate_memory(None, 2, 2, "fp32", "bf16", grad_order=[4, 2, 1, 0, 3], **kw)
    assert later.buffers == 2 * (416 + 608 + 528 + 624)
    assert later.buffers - first.buffers <= first.buffers_slack == 2 * 624
    # Arriving in buffer order changes nothing.
    assert estimate_memory(None, 2, 2, "fp32", "bf16", grad_order=[4, 3, 2, 1, 0], **kw).buffers == first.buffers
    with pytest.raises(ValueError, match="permutation"):
        estimate_memory(None, 2, 2, grad_order=[0, 1, 2], **kw)


def test_estimate_counts_amsgrads_running_maximum_as_measured(pools):
    """amsgrad=True keeps max_exp_avg_sq beside exp_avg_sq, stored as the moments are: the estimate
    counts it in exp_avg_sq, byte for byte as the optimizer holds it."""
    pool = pools(4)
    for moments in ("fp32", "bf16"):
        options = {"amsgrad": True, "moments": moments}
        results = pool.run(measure_case, 2, 2, "fp32", "bf16", options)[:2]
        for rank, r in enumerate(results):
            told = estimate_memory(None, 2, 2, "fp32", "bf16", param_shapes=r["shapes"], grad_order=r["grad_order"],
                                   bucket_cap_mb=BUCKET_MB, backend="gloo", rank=rank, moments=moments, amsgrad=True)
            assert r["later"] == told.by_category(), (moments, rank, r["later"], told)
            plain = estimate_memory(None, 2, 2, "fp32", "bf16", param_shapes=r["shapes"], moments=moments)
            assert told.exp_avg_sq == 2 * plain.exp_avg_sq and told.exp_avg == plain.exp_avg
    with pytest.raises(ValueError, match="moments='8bit'"):
        estimate_memory(100, 2, amsgrad=True, moments="8bit")


@pytest.mark.parametrize("kwargs,needle", [
    (dict(num_params=100, world_size=0), "world_size=0"),
    (dict(num_params=100, world_size=2.5), "world_size=2.5"),
    (dict(num_params=-1, world_size=2), "num_params=-1"),
    (dict(num_params=None, world_size=2), "num_params or param_shapes"),
    (dict(num_params=100, world_size=2, stage=3), "stage=3"),
    (dict(num_params=100, world_size=2, master_weights="kahan"), "master_weights='kahan'"),
    (dict(num_params=100, world_size=2, param_dtype="fp8"), "param_dtype='fp8'"),
    (dict(num_params=100, world_size=2, param_dtype=torch.int8), "torch.int8"),
    (dict(num_params=100, world_size=2, bucket_cap_mb=0), "bucket_cap_mb=0"),
    (dict(num_params=5, world_size=2, param_shapes=[(2, 3)]), "6 elements"),
    (dict(num_params=100, world_size=2, backend="mpi"), "backend='mpi'"),
    (dict(num_params=100, world_size=2, rank=2), "rank=2 world_size=2"),
])
def test_bad_arguments_name_the_offending_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        estimate_memory(**kwargs)


def test_cli_prints_the_per_rank_table(capsys):
    assert [parse_count(s) for s in ("7e9", "7B", "1.5b", "350M", "1000")] == \
        [7 * 10**9, 7 * 10**9, 15 * 10**8, 350 * 10**6, 1000]
    assert cli_main(["--params", "7e9", "--world-size", "64"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ")}
    expected = 2 + 14 / 64 + 3 * CAP_MIB * MiB / BIG  # stage 2, fp32 master, with staging
    assert float(rows["stage 2, fp32"][7]) == pytest.approx(expected, abs=0.006)
    assert float(rows["stage 1, none"][7]) == pytest.approx(2 + 2 + 8 / 64, abs=0.006)
    assert float(rows["DDP + AdamW"][7]) == 16.0
    assert len(rows) == 1 + 1 + 8  # header, DDP, 2 stages x 4 modes
    assert cli_main(["--params", "1.5B", "70B", "--world-size", "8", "1024", "--compact", "--gpu-memory", "80"]) == 0
    compact = capsys.readouterr().out
    assert compact.count("| 70B ") == 2 and "*" in compact  # 70B replicated weights never fit in 80 GiB


def test_hybrid_is_a_flat_shard_group_plus_a_cross_replica_all_reduce(capsys):
    flat8 = estimate_memory(BIG, 8, 2, "remainder", largest_param=131e6)
    hyb = estimate_memory(BIG, 64, 2, "remainder", largest_param=131e6, shard_size=8)
    assert (hyb.shard_size, hyb.replicas) == (8, 8)
    assert hyb.by_category() == flat8.by_category()  # a hybrid rank holds what a rank of 8 holds
    assert hyb.comm_inside == flat8.comm_bytes
    nbytes = hyb.padded_numel * 2  # bf16
    assert hyb.comm_cross == 2 * 7 * (nbytes // 8) // 8  # ring all-reduce of this rank's eighth over 8 replicas
    assert estimate_memory(BIG, 64, 2, "remainder", largest_param=131e6).comm_cross == 0
    flat64 = estimate_memory(BIG, 64, 2, "remainder", largest_param=131e6)
    assert flat64.ring_hops(8) == (0, flat64.buckets * 2 * 63)  # every ring spans the nodes
    assert hyb.ring_hops(8) == (hyb.buckets * 2 * 7, hyb.buckets * 2 * 7)
    gloo = estimate_memory(BIG, 64, 2, "remainder", largest_param=131e6, shard_size=8, backend="gloo")
    assert gloo.comm_cross == 2 * hyb.comm_cross  # gloo sums the partial sums in fp32
    fp32 = estimate_memory(BIG, 64, 2, "remainder", largest_param=131e6, shard_size=8, reduce_dtype=torch.float32)
    assert fp32.comm_cross == 2 * hyb.comm_cross  # NCCL with reduce_dtype=torch.float32: the pieces in fp32
    with pytest.raises(ValueError, match="shard_size=3 must divide world_size=64"):
        estimate_memory(BIG, 64, shard_size=3)
    assert cli_main(["--params", "7B", "--world-size", "64", "--shard-size", "8", "--stage", "2",
                     "--master-weights", "remainder"]) == 0
    out = capsys.readouterr().out
    assert "| stage 2, remainder, 8x8 hybrid " in out and "| stage 2, remainder, flat " in out, out
    assert cli_main(["--params", "7B", "--world-size", "8", "1024", "--shard-size", "8", "--compact"]) == 0
    assert "hybrid x8" in capsys.readouterr().out
    assert cli_main(["--params", "7B", "--world-size", "12", "--shard-size", "8"]) == 2


@pytest.mark.launch
def test_module_runs_as_a_command():
    proc = subprocess.run([sys.executable, "-m", "shardopt.estimate", "--params", "7e9", "--world-size", "64",
                           "--stage", "2", "--master-weights", "remainder", "--detail"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "stage 2, remainder" in proc.stdout and "exp_avg_sq" in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr


# -- tier 2 ------------------------------------------------------------------------------------
BUCKET_MB = 0.0625
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CASES = [(s, m, "bf16") for s in (1, 2) for m in ("fp32", "remainder", "stochastic", "none")] + \
        [(2, "remainder", "fp16"), (1, "fp32", "fp32"), (2, "fp32", "fp32")]


_GROUPS: dict[int, object] = {}


def _group(world_size: int) -> object:
    """A process group of the first ``world_size`` ranks of the pool; created once, on every rank."""
    if world_size not in _GROUPS:
        _GROUPS[world_size] = dist.new_group(list(range(world_size)))
    return _GROUPS[world_size]


def measure_case(world_size: int, stage: int, mode: str, dtype: str, options: dict | None = None) -> dict | None:
    """On the first ``world_size`` ranks: build the example GPT and ShardedAdamW (with ``options``,
    e.g. amsgrad), take two steps, and return the measured bytes (other ranks return None)."""
    import shardopt

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT, GPTConfig

    group = _group(world_size)
    if dist.get_rank() >= world_size:
        return None
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=128, n_head=4, block_size=32)).to(DTYPES[dtype])
    groups = model.param_groups(0.1)
    opt = shardopt.ShardedAdamW(groups, lr=1e-3, stage=stage, master_weights=mode, bucket_cap_mb=BUCKET_MB,
                                loss_scale=None, process_group=group, **(options or {}))
    g = torch.Generator().manual_seed(dist.get_rank())
    measured = []
    for _ in range(2):  # the first backward follows rank 0's completions and teaches the second
        x = torch.randint(0, 256, (2, 32), generator=g)
        opt.backward(model(x, x.roll(1, dims=1)))
        opt.step()
        opt.zero_grad()
        rep = opt.memory_report()
        measured.append({c: getattr(rep, c) for c in CATEGORIES})
    in_opt = [p for grp in groups for p in grp["params"]]
    index = {id(p): i for i, p in enumerate(in_opt)}
    return {"first": measured[0], "later": measured[1], "shapes": [tuple(p.shape) for p in in_opt],
            # gradients become ready in roughly the reverse of the model's registration order
            "grad_order": [index[id(p)] for p in reversed(list(model.parameters()))]}


@pytest.mark.filterwarnings("ignore:master_weights")
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_estimate_matches_measured_bytes_per_rank(pools, world_size):
    pool = pools(4)  # one pool for every world size: spawning is the slow part
    for stage, mode, dtype in CASES:
        results = pool.run(measure_case, world_size, stage, mode, dtype)[:world_size]
        for rank, r in enumerate(results):
            where = f"{stage=} {mode=} {dtype=} {world_size=} {rank=}"
            kw = dict(param_shapes=r["shapes"], bucket_cap_mb=BUCKET_MB, backend="gloo", rank=rank)
            # Every backward pass, the first included, reduces a bucket once it is complete: told the
            # order gradients arrive, the estimate is exact for both, buffers included.
            told = estimate_memory(None, world_size, stage, mode, dtype, grad_order=r["grad_order"], **kw)
            assert r["first"] == told.by_category(), (where, r["first"], told)
            assert r["later"] == told.by_category(), (where, r["later"], told)
            assert told.total == pytest.approx(sum(r["later"].values()), rel=0.01)
            # Not told, the estimate is off by at most one bucket's buffers.
            first = estimate_memory(None, world_size, stage, mode, dtype, **kw)
            assert 0 <= r["later"]["buffers"] - first.buffers <= first.buffers_slack, (where, r["later"], first)


def test_cli_with_tensor_and_pipeline_parallelism_counts_one_ranks_part(capsys):
    # a 7B model split over 2 x 2 ranks: each rank holds the figures of a 1.75B model
    assert cli_main(["--params", "7e9", "--world-size", "8", "--tp", "2", "--pp", "2"]) == 0
    split = capsys.readouterr().out
    assert cli_main(["--params", "1.75e9", "--world-size", "8"]) == 0
    part = capsys.readouterr().out
    rows = lambda text: [line for line in text.splitlines() if line.startswith("| stage") or line.startswith("| DDP")]
    assert rows(split) == rows(part) and len(rows(split)) == 9  # DDP, 2 stages x 4 modes
    assert "split over --tp 2 x --pp 2" in split and "1/4 of the parameters" in split
    assert cli_main(["--params", "7e9", "--world-size", "8", "--tp", "2", "--pp", "2", "--compact"]) == 0
    compact = capsys.readouterr().out
    assert cli_main(["--params", "1.75e9", "--world-size", "8", "--compact"]) == 0
    assert compact.splitlines()[2].split("|")[3:] == capsys.readouterr().out.splitlines()[2].split("|")[3:]
