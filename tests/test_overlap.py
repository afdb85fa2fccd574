"""Tier 2: bucketed, asynchronous communication on gloo ranks.

Catches bucket boundaries that change results (a lost or doubled gradient at a boundary, tied or
unused parameters mishandled), overlapped parameter gathers that let a module run on stale
weights, an fp32 reduction option that does not reduce in fp32, and communication counters that
do not add up to the bytes actually moved. With overlapped gathers also: a model that no longer
pickles or whose deep copy waits for the original's gathers, a fullgraph compile that fails
without saying what to do, TorchScript blocks that cannot run or run on stale weights, a landing
whose cost grows with the number of buckets, and a dropped optimizer kept alive by its gathers.
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import gc
import io
import os
import pickle
import threading
import time
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist

import shardopt
from models import batch, make_model, param_groups

ONE_ELEMENT_MB = 4 / 2**20  # one fp32 element's worth: every parameter in a bucket of its own


def bucket_case(stage: int, bucket_cap_mb: float, steps: int = 4) -> list[torch.Tensor]:
    rank = dist.get_rank()
    model = make_model(seed=11)
    opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, stage=stage, bucket_cap_mb=bucket_cap_mb)
    for step in range(steps):
        opt.zero_grad()
        opt.backward(model(batch(rank, step)))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_bucketed_equals_unbucketed_bit_for_bit(pools):
    for world in (2, 3):
        pool = pools(world)
        for stage in (1, 2):
            whole = pool.run(bucket_case, stage, 1e3)  # one bucket larger than the model
            for cap in (ONE_ELEMENT_MB, 1e-3, 4e-3):
                got = pool.run(bucket_case, stage, cap)
                for a, b in zip(whole, got):
                    assert all(torch.equal(x, y) for x, y in zip(a, b)), (world, stage, cap)


def overlap_case(overlap: bool, stage: int) -> dict:
    rank = dist.get_rank()
    model = make_model(seed=12)
    opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, stage=stage, bucket_cap_mb=ONE_ELEMENT_MB,
                                overlap_param_gather=overlap)
    stale_reads, pending_at_start, losses = [], [], []

    def check(module, args):  # registered after the optimizer's hook: runs once it has waited
        pending = set(opt.pending_param_buckets())
        if module is model:
            pending_at_start.append(len(pending))
        for p in module.parameters(recurse=False):
            if opt.bucket_of(p) in pending:
                stale_reads.append(type(module).__name__)

    handles = [m.register_forward_pre_hook(check) for m in model.modules()]
    for step in range(4):
        opt.zero_grad()
        loss = model(batch(rank, step))
        losses.append(loss.item())
        opt.backward(loss)
        opt.step()
    opt.finish_param_gather()
    for h in handles:
        h.remove()
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "stale": stale_reads, "pending_at_start": pending_at_start}


def test_overlapped_gather_same_results_and_never_stale(pools):
    pool = pools(2)
    for stage in (1, 2):
        plain = pool.run(overlap_case, False, stage)
        over = pool.run(overlap_case, True, stage)
        for a, b in zip(plain, over):
            assert a["losses"] == b["losses"]
            assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
            assert b["stale"] == []  # no module ran before the gather of its own weights was waited
            # After the first step, the next forward starts with gathers still in flight: real overlap.
            assert all(n > 0 for n in b["pending_at_start"][1:]), b["pending_at_start"]
            assert all(n == 0 for n in a["pending_at_start"])


def state_dict_after_step_case() -> tuple:
    """model.state_dict() right after an overlapped step (to save weights): the gathers are waited
    for first, so what it returns is the updated weights, not half-gathered ones."""
    model = make_model(seed=4)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, overlap_param_gather=True, bucket_cap_mb=ONE_ELEMENT_MB)
    for step in range(2):
        opt.zero_grad()
        opt.backward(model(batch(dist.get_rank(), step)))
        opt.step()
    pending_before = len(opt.pending_param_buckets())
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    pending_after = len(opt.pending_param_buckets())
    opt.finish_param_gather()
    settled = model.state_dict()
    return pending_before, pending_after, all(torch.equal(saved[k], settled[k]) for k in saved)


def test_state_dict_right_after_an_overlapped_step_is_up_to_date(pools):
    for before, after, equal in pools(2).run(state_dict_after_step_case):
        assert before > 0 and after == 0 and equal, (before, after, equal)


def reduce_dtype_case(reduce_fp32: bool) -> bool:
    """Stage 1, bf16: p.grad after backward equals the fp32 average of the ranks' bf16 gradients,
    rounded once (compared with an all_reduce done here in fp32)."""
    rank = dist.get_rank()
    model = make_model(seed=13, dtype=torch.bfloat16)
    ref = make_model(seed=13, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), stage=1, bucket_cap_mb=1e-4,
                                reduce_dtype=torch.float32 if reduce_fp32 else None)
    opt.backward(model(batch(rank, 0)))
    ref(batch(rank, 0)).backward()
    same = True
    for p, q in zip(model.parameters(), ref.parameters()):
        if not p.requires_grad:
            continue
        g = (q.grad if q.grad is not None else torch.zeros_like(q)).float()
        dist.all_reduce(g, op=dist.ReduceOp.AVG)
        same &= torch.equal(p.grad, g.to(torch.bfloat16))
    return same


def test_reduce_in_fp32(pools):
    """Three ranks: a bf16 sum of three values rounds, an fp32 one does not. On gloo the rank-order
    sum always runs in fp32 (at no cost on the wire), so both settings match the fp32 average."""
    pool = pools(3)
    assert all(pool.run(reduce_dtype_case, True))
    assert all(pool.run(reduce_dtype_case, False))


def counters_case(stage: int) -> dict:
    rank = dist.get_rank()
    model = make_model(seed=14, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(model.parameters(), stage=stage, bucket_cap_mb=1e-4)
    for step in range(2):
        opt.zero_grad()
        opt.backward(model(batch(rank, step)))
        opt.step()
    c = opt.last_step_comm
    return {"reduce": c.reduce_bytes, "gather": c.gather_bytes, "collectives": c.collectives,
            "wait": c.wait_seconds, "numel": opt.inspect().buffers[0].numel}


def test_comm_counters_add_up(pools):
    for stage in (1, 2):
        for r in pools(2).run(counters_case, stage):
            padded_bytes = r["numel"] * 2  # bf16: the whole padded buffer is reduced once and gathered once,
            # and stage 1's gradient all-reduce gathers the averaged gradient pieces too
            assert r["reduce"] == padded_bytes, r
            assert r["gather"] == padded_bytes * (2 if stage == 1 else 1), r
            assert r["collectives"] > 2 and r["wait"] >= 0.0


def test_a_handle_is_waited_once():
    from shardopt.comm._collectives import Pending

    kept = torch.ones(3)
    p = Pending([], keep_alive=[kept])
    p.wait()
    assert p.keep_alive == []  # buffers are released only once the collective has completed
    with pytest.raises(AssertionError, match="waited twice"):
        p.wait()


def test_tensors_whose_memory_cannot_be_seen_wait_for_every_gather_in_flight(one_rank_group):
    """The read guard's look at a tensor's memory: a view of a flat buffer waits for the buckets it
    overlaps, another tensor for none, and a tensor whose memory torch does not show (no storage:
    sparse, a vmap batched tensor; for its whole storage, a wrapper subclass too) for all of them."""
    from shardopt.group._grad_placeholder import GradPlaceholder

    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    opt = shardopt.ShardedAdamW(model.parameters(), lr=0.1, bucket_cap_mb=64 * 64 * 4 / 2**20)  # a bucket each
    group, gathers = opt._buffers[0], opt._gathers
    first, second = group.buckets
    flat = group.flat.data
    inside = flat[second.global_range.start + 5:second.global_range.start + 7]
    group.start_gather(first)  # in flight, without the read guard (no overlap_param_gather)
    group.start_gather(second)
    both = [first, second]
    assert gathers.touching(inside) == [second] and gathers.touching(torch.zeros(8)) == []
    assert gathers.touching_storage(inside) == both and gathers.touching_storage(torch.zeros(8)) == []
    sparse = torch.ones(2, 2).to_sparse()
    assert gathers.touching(sparse) == both and gathers.touching_storage(sparse) == both
    seen = []
    torch.vmap(lambda x: seen.append((gathers.touching(x), gathers.touching_storage(x))) or x)(torch.ones(2, 3))
    assert seen == [(both, both)], seen
    assert gathers.touching_storage(GradPlaceholder(torch.ones(3))) == both
    opt.finish_param_gather()
    assert not gathers
    opt.close()


# -- weights read right after an overlapped step ------------------------------------------------------
# [Note: reads right after an overlapped step] (tests) Each case trains with overlap_param_gather=True
# and reads the weights in some way right after step(), while the gathers are still in flight, then
# compares what it read, bit for bit, with the same run without overlap. The model is large enough
# (about 0.6M weights in buckets of 0.25 MB) that on gloo the last buckets are still landing when
# step() returns, so a read that does not wait sees half-gathered weights.
class ReadModel(torch.nn.Module):
    """An LM-shaped model whose output ``head`` is its last module. ``tied``: the input embedding is
    ``head.weight`` read functionally at the start of the forward, before ``head`` runs."""

    def __init__(self, tied: bool, vocab: int = 2048, dim: int = 192) -> None:
        super().__init__()
        self.tied = tied
        self.emb = torch.nn.Embedding(vocab, dim) if not tied else None
        self.body = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU(), torch.nn.Linear(dim, dim))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.embedding(idx, self.head.weight) if self.tied else self.emb(idx)
        x = x + self.body(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), idx.roll(1, dims=-1).view(-1))


def _lerp(avg: list[torch.Tensor], now: list[torch.Tensor]) -> None:
    with torch.no_grad():
        torch._foreach_lerp_(avg, now, 0.1)


def read_case(overlap: bool, read: str, steps: int = 3) -> dict:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    rank = dist.get_rank()
    torch.manual_seed(21)
    model = ReadModel(tied=read in ("tied", "compile", "compile_in_place"))
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.25, overlap_param_gather=overlap)
    forward = torch.compile(model, backend="aot_eager") if read == "compile" else model
    if read == "compile_in_place":  # its hooks run traced
        model.compile(backend="aot_eager")
    ema = [p.detach().clone() for p in model.parameters()]
    views = [p.detach() for p in model.parameters()]  # aliases of the weights taken before any step
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    lerp = torch.compile(_lerp, backend="aot_eager")
    got: list = []
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = forward(batch(rank, step, vocab=2048, n=8, t=16))
        losses.append(loss.item())
        opt.backward(loss)
        with slow_sender() if read == "storage" else contextlib.nullcontext():
            opt.step()
        # right after step(), the gathers still in flight:
        if read == "ema":  # by hand, in place
            with torch.no_grad():
                for e, p in zip(ema, model.parameters()):
                    e.mul_(0.9).add_(p, alpha=0.1)
        elif read == "averaged":
            averaged.update_parameters(model)
        elif read == "snapshot":
            got.append({n: p.detach().clone() for n, p in model.named_parameters()})
        elif read == "eval":  # a weight read functionally, outside its module
            with torch.inference_mode():
                got.append(torch.nn.functional.linear(torch.ones(4, 192), model.head.weight))
            with torch.no_grad():
                got.append(model.body[2].weight @ torch.ones(192))
        elif read in ("compile", "compile_in_place"):  # a compiled function reading the weights
            lerp(ema, list(model.parameters()))
        elif read == "data":
            got.append([p.data.clone() for p in model.parameters()])
        elif read == "tolist":
            got.append(torch.tensor(model.head.weight.tolist()))
        elif read == "numpy":  # through an alias taken before step()
            got.append([torch.from_numpy(v.numpy().copy()) for v in views])
        elif read == "deepcopy":
            got.append([p.detach() for p in copy.deepcopy(model).parameters()])
        elif read == "save":
            buf = io.BytesIO()
            torch.save(list(model.parameters()), buf)
            got.append([p.detach() for p in torch.load(io.BytesIO(buf.getvalue()))])
        elif read == "storage":  # the whole flat buffer, through the first weight: its storage, and saving it
            first = next(iter(model.parameters()))
            whole = _raw_bytes(first.untyped_storage())  # as bytes(storage) reads it, without a torch call
            buf = io.BytesIO()
            torch.save(first, buf)
            got.append([whole, _raw_bytes(torch.load(io.BytesIO(buf.getvalue())).untyped_storage())])
        elif read == "write":  # in place, through the parameters: kept, and trained from at the next step
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        elif read == "thread":  # state_dict() in another thread while this one reads the weights
            snap: dict = {}
            other = threading.Thread(target=lambda: snap.update({k: v.clone() for k, v in model.state_dict().items()}))
            other.start()
            with torch.no_grad():
                for e, p in zip(ema, model.parameters()):
                    e.mul_(0.9).add_(p, alpha=0.1)
            other.join()
            got.append(snap)
    opt.finish_param_gather()
    if read == "averaged":
        got = [p.detach().clone() for p in averaged.parameters()]
    elif read in ("ema", "compile", "compile_in_place", "thread"):
        got = [ema, got]
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()], "read": got}


def _raw_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The bytes of ``storage`` read straight from memory, as ``bytes(storage)`` or NumPy would."""
    import ctypes

    return torch.frombuffer(bytearray(ctypes.string_at(storage.data_ptr(), storage.nbytes())), dtype=torch.uint8)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("read", ["ema", "averaged", "snapshot", "eval", "tied", "compile", "compile_in_place",
                                  "data", "tolist", "numpy", "deepcopy", "save", "storage", "write", "thread"])
def test_weights_read_right_after_an_overlapped_step_are_the_stepped_ones(pools, read):
    pool = pools(2)
    plain = pool.run(read_case, False, read)
    over = pool.run(read_case, True, read)
    for rank, (a, b) in enumerate(zip(plain, over)):
        assert a["losses"] == b["losses"], (read, rank, a["losses"], b["losses"])
        assert _same(a["params"], b["params"]), (read, rank)
        assert _same(a["read"], b["read"]), (read, rank)


def _guards() -> list[str]:
    """The classes of this thread's torch function modes, bottom first."""
    return [type(torch._C._get_function_stack_at(i)).__name__ for i in range(torch._C._len_torch_function_stack())]


class Counting(torch.overrides.TorchFunctionMode):
    """A user's own mode: counts the calls it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def modes_case(overlap: bool) -> dict:
    """Modes the user pushed beside the read guard: a ``torch.device`` block and a mode of their own
    both entered before ``step()`` and left while its gathers are in flight, ``FlopCounterMode``
    around the forward; what the stack holds after step(), after the forward and at the end."""
    from torch.utils.flop_counter import FlopCounterMode

    rank = dist.get_rank()
    torch.manual_seed(21)
    model = ReadModel(tied=True)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.25, overlap_param_gather=overlap)
    stacks: dict = {"after_step": [], "after_forward": [], "in_blocks": []}
    flops, losses, ema = [], [], [p.detach().clone() for p in model.parameters()]
    user = Counting()
    for step in range(3):
        opt.zero_grad()
        counter = FlopCounterMode(display=False)
        with counter:
            loss = model(batch(rank, step, vocab=2048, n=8, t=16))
        flops.append(counter.get_total_flops())
        stacks["after_forward"].append(_guards())
        losses.append(loss.item())
        opt.backward(loss)
        with torch.device("cpu"), user:  # both left with the gathers in flight
            opt.step()
            stacks["in_blocks"].append(_guards())
        stacks["after_step"].append(_guards())
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.lerp_(p, 0.1)
    opt.finish_param_gather()
    stacks["end"] = _guards()
    return {"losses": losses, "flops": flops, "ema": ema, "stacks": stacks, "user_calls": user.calls,
            "params": [p.detach().clone() for p in model.parameters()]}


def test_the_read_guard_beside_the_users_modes_and_gone_once_the_gathers_landed(pools):
    pool = pools(2)
    plain = pool.run(modes_case, False)
    over = pool.run(modes_case, True)
    for a, b in zip(plain, over):
        assert a["losses"] == b["losses"] and a["flops"] == b["flops"]
        assert _same(a["ema"], b["ema"]) and _same(a["params"], b["params"])
        assert b["user_calls"] > 0  # the user's mode, above the guard, saw the step's calls
        s = b["stacks"]
        # beneath the user's modes, so each leaves as its own (a mode's exit pops the top one)
        assert s["in_blocks"] == [["InFlightReads", "DeviceContext", "Counting"]] * 3, s
        assert s["after_step"] == [["InFlightReads"]] * 3, s  # the weights are still landing
        assert s["after_forward"] == [[]] * 3, s  # every gather waited: gone, so the rest pays nothing
        assert s["end"] == [], s
        assert all(st == [] for st in a["stacks"]["after_step"]), a["stacks"]


class Broken(RuntimeError):
    pass


def step_raises_case(where: str) -> dict:
    """step() raising before it started any gather, or after starting some (the update of a later
    flat buffer raising): the guard is there exactly while gathers are in flight."""
    rank = dist.get_rank()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64).to(torch.bfloat16))
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, overlap_param_gather=True, bucket_cap_mb=ONE_ELEMENT_MB)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    opt.backward(model[1](model[0](x).to(torch.bfloat16)).float().square().mean())
    if where == "before":
        opt._agreement.exchange = lambda *a, **k: (_ for _ in ()).throw(Broken("agreement"))
    else:
        buffers = opt._buffers
        buffers[-1].update = lambda *a, **k: (_ for _ in ()).throw(Broken("update"))
    try:
        opt.step()
    except Broken:
        pass
    out = {"after": _guards(), "pending": len(opt.pending_param_buckets())}
    opt.finish_param_gather()
    out["end"] = _guards()
    return out


def test_a_step_that_raises_leaves_no_guard_behind(pools):
    pool = pools(2)
    for r in pool.run(step_raises_case, "before"):
        assert r == {"after": [], "pending": 0, "end": []}, r
    for r in pool.run(step_raises_case, "after_some_gathers"):
        assert r["pending"] > 0 and r["after"] == ["InFlightReads"] and r["end"] == [], r


def dropped_case() -> tuple[list[str], list[str]]:
    """An optimizer dropped right after an overlapped step (a local of a function that returned):
    collecting it waits for its gathers, and the next module call takes its guard away."""
    rank = dist.get_rank()
    torch.manual_seed(21)
    model = ReadModel(tied=False)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.25, overlap_param_gather=True)
    opt.backward(model(batch(rank, 0, vocab=2048, n=8, t=16)))
    opt.step()
    after_step = _guards()
    del opt
    gc.collect()
    with torch.no_grad():
        model(batch(rank, 1, vocab=2048, n=8, t=16))
    return after_step, _guards()


def test_the_guard_of_a_dropped_optimizer_goes_at_the_next_module_call(pools):
    for after_step, after in pools(2).run(dropped_case):
        assert after_step == ["InFlightReads"] and after == [], (after_step, after)


@contextlib.contextmanager
def slow_sender(seconds: float = 0.02, rank: int = 1):
    """Rank ``rank`` sleeps before each asynchronous broadcast it sends (step()'s weight gathers on
    gloo), so that on the other ranks step() returns with its pieces of every bucket still on their
    way: whatever does not wait for them reads the weights before the step."""
    send = dist.broadcast

    def slow(tensor, src=None, group=None, async_op=False, **kwargs):
        if async_op and src == dist.get_rank() == rank:
            time.sleep(seconds)
        return send(tensor, src=src, group=group, async_op=async_op, **kwargs)

    dist.broadcast = slow
    try:
        yield
    finally:
        dist.broadcast = send


# -- the model pickled and copied --------------------------------------------------------------------
def pickle_case(overlap: bool) -> dict:
    """``torch.save(model)`` and ``copy.deepcopy(model)`` of the whole module right after an
    overlapped step and after ``finish_param_gather()``, once forwards have run; the copy's forward
    and ``state_dict()`` right after the next step, and what they wait for."""
    rank = dist.get_rank()
    torch.manual_seed(21)
    model = ReadModel(tied=False)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.25, overlap_param_gather=overlap)
    x = batch(rank, 9, vocab=2048, n=8, t=16)
    out: dict = {"saved": [], "copy_loss": [], "copy_state": [], "pending": [], "shardopt_in_pickle": []}
    copied = None
    for step in range(3):
        opt.zero_grad()
        opt.backward(model(batch(rank, step, vocab=2048, n=8, t=16)))
        with slow_sender():
            opt.step()
        if copied is not None:  # a copy made at the last step: none of its calls waits for this step's gathers
            before = len(opt.pending_param_buckets())
            with torch.no_grad():
                out["copy_loss"].append(copied(x))
            out["copy_state"].append({k: v.clone() for k, v in copied.state_dict().items()})
            out["pending"].append((before, len(opt.pending_param_buckets())))
        buf = io.BytesIO()
        torch.save(model, buf)  # right after step(), the gathers in flight
        blob = buf.getvalue()
        out["shardopt_in_pickle"].append(b"shardopt" in blob)  # a saved model loads without shardopt
        loaded = torch.load(io.BytesIO(blob), weights_only=False)
        with torch.no_grad():
            out["saved"].append([loaded(x), loaded.state_dict()])
        copied = copy.deepcopy(model)
    opt.finish_param_gather()
    blob = pickle.dumps(model)  # once the gathers landed
    out["shardopt_in_pickle"].append(b"shardopt" in blob)
    with torch.no_grad():
        out["saved"].append(pickle.loads(blob)(x))
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_a_model_pickles_and_deep_copies_with_overlapped_gathers(pools):
    pool = pools(2)
    plain = pool.run(pickle_case, False)
    over = pool.run(pickle_case, True)
    for rank, (a, b) in enumerate(zip(plain, over)):
        for key in ("saved", "copy_loss", "copy_state", "params"):
            assert _same(a[key], b[key]), (rank, key)
        assert b["shardopt_in_pickle"] == [False] * 4, b["shardopt_in_pickle"]
        assert all(before == after for before, after in b["pending"]), b["pending"]
        if rank == 0:  # the slow sender's pieces are still on their way: the copy's calls did not wait for them
            assert all(before > 0 for before, _ in b["pending"]), b["pending"]


# -- fullgraph compiles -------------------------------------------------------------------------------
def fullgraph_case(overlap: bool, how: str) -> dict:
    """A model compiled with ``fullgraph=True``: in place (``model.compile``), then with
    ``opt.finish_param_gather()`` before each forward (what the error says to do), or wrapped
    (``torch.compile(model)``, whose wrapper waits eagerly); a compiled EMA after finish_param_gather()."""
    torch._dynamo.reset()  # a fresh recompile budget: each case compiles new modules
    rank = dist.get_rank()
    torch.manual_seed(21)
    model = ReadModel(tied=False)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.25, overlap_param_gather=overlap)
    forward = torch.compile(model, backend="aot_eager", fullgraph=True) if how == "wrapper" else model
    if how.startswith("in_place"):
        model.compile(backend="aot_eager", fullgraph=True)
    lerp = torch.compile(_lerp, backend="aot_eager", fullgraph=True)
    ema = [p.detach().clone() for p in model.parameters()]
    losses = []
    try:
        for step in range(3):
            opt.zero_grad()
            if how == "in_place_finished":
                opt.finish_param_gather()
            loss = forward(batch(rank, step, vocab=2048, n=8, t=16))
            losses.append(loss.detach())
            opt.backward(loss)
            opt.step()
            if how == "ema":
                opt.finish_param_gather()
                lerp(ema, list(model.parameters()))
    except RuntimeError as e:  # dynamo's errors are RuntimeErrors
        opt.finish_param_gather()
        return {"error": f"{type(e).__name__}: {e}"}
    opt.finish_param_gather()
    return {"losses": losses, "ema": ema, "params": [p.detach().clone() for p in model.parameters()]}


def test_fullgraph_compiles_with_overlapped_gathers(pools):
    pool = pools(2)
    for r in pool.run(fullgraph_case, True, "in_place"):  # nothing can wait inside: a clear error
        assert "error" in r and "opt.finish_param_gather() before calling" in r["error"] \
            and "torch.compile(model, fullgraph=True)" in r["error"] and "a module runs inside" in r["error"], r
    for how in ("in_place_finished", "wrapper", "ema"):
        plain = pool.run(fullgraph_case, False, how)
        over = pool.run(fullgraph_case, True, how)
        for a, b in zip(plain, over):
            assert "error" not in a and "error" not in b, (how, a, b)
            assert _same(a["losses"], b["losses"]) and _same(a["params"], b["params"]), how
            assert _same(a["ema"], b["ema"]), how



def _augment(idx: torch.Tensor) -> torch.Tensor:
    return (idx * 3 + 1) % 2048


def compiled_reads_case(overlap: bool) -> dict:
    """Right after each step(): a function compiled with ``fullgraph=True`` that reads no weight
    (an augmentation of the integer batch), then, after the loop, one that reads them (an EMA)."""
    torch._dynamo.reset()
    rank = dist.get_rank()
    torch.manual_seed(21)
    model = ReadModel(tied=False)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.25, overlap_param_gather=overlap)
    augment = torch.compile(_augment, backend="aot_eager", fullgraph=True)
    lerp = torch.compile(_lerp, backend="aot_eager", fullgraph=True)
    ema = [p.detach().clone() for p in model.parameters()]
    losses, pending = [], []
    idx = batch(rank, 0, vocab=2048, n=8, t=16)
    for step in range(3):
        opt.zero_grad()
        loss = model(idx)
        losses.append(loss.detach())
        opt.backward(loss)
        with slow_sender():
            opt.step()
        pending.append(len(opt._gathers.handles()))
        idx = augment(batch(rank, step + 1, vocab=2048, n=8, t=16))  # the gathers still in flight
    try:
        lerp(ema, list(model.parameters()))
        error = ""
    except RuntimeError as e:  # dynamo's errors are RuntimeErrors
        error = f"{type(e).__name__}: {e}"
    opt.finish_param_gather()
    return {"losses": losses, "pending": pending, "error": error,
            "params": [p.detach().clone() for p in model.parameters()]}


def test_a_fullgraph_function_reading_no_weight_runs_right_after_an_overlapped_step(pools):
    pool = pools(2)
    plain = pool.run(compiled_reads_case, False)
    over = pool.run(compiled_reads_case, True)
    for rank, (a, b) in enumerate(zip(plain, over)):
        assert a["error"] == "", a["error"]
        assert _same(a["losses"], b["losses"]) and _same(a["params"], b["params"])
        if rank == 0:  # the slow sender's pieces were on their way when the augmentation ran
            assert all(n > 0 for n in b["pending"]), b["pending"]
        # the one that reads the weights is refused, saying so
        assert "takes a tensor of the weights' dtype" in b["error"] and "opt.finish_param_gather()" in b["error"], \
            b["error"]


def compiled_part_case(overlap: bool, how: str) -> dict:
    """A compiled part of the training: the body compiled apart (``torch.compile(model.body)``, with
    or without ``fullgraph=True``) while the embedding and the head stay eager; or the whole model
    compiled with ``fullgraph=True`` beside another model whose optimizer's gathers are in flight
    when it runs."""
    torch._dynamo.reset()
    rank = dist.get_rank()
    torch.manual_seed(21)
    model = ReadModel(tied=False)
    torch.manual_seed(22)
    other = ReadModel(tied=False)
    if how.startswith("body"):
        model.body = torch.compile(model.body, backend="aot_eager", fullgraph=how == "body_fullgraph")
    forward = torch.compile(model, backend="aot_eager", fullgraph=True) if how == "beside_another" else model
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.25, overlap_param_gather=overlap)
    other_opt = shardopt.ShardedAdamW(other.parameters(), lr=1e-2, bucket_cap_mb=0.25, overlap_param_gather=overlap)
    losses = []
    for step in range(3):
        opt.zero_grad()
        other_opt.zero_grad()
        loss = forward(batch(rank, step, vocab=2048, n=8, t=16))
        opt.backward(loss)
        other_loss = other(batch(rank, step + 50, vocab=2048, n=8, t=16))
        other_opt.backward(other_loss)
        with slow_sender():
            opt.step()
            other_opt.step()
        losses += [loss.detach(), other_loss.detach()]
    opt.finish_param_gather()
    other_opt.finish_param_gather()
    return {"losses": losses, "params": [p.detach().clone() for p in [*model.parameters(), *other.parameters()]]}


def test_a_compiled_part_of_the_model_trains_with_overlapped_gathers(pools):
    pool = pools(2)
    for how in ("body", "body_fullgraph", "beside_another"):
        plain = pool.run(compiled_part_case, False, how)
        over = pool.run(compiled_part_case, True, how)
        for a, b in zip(plain, over):
            assert _same(a["losses"], b["losses"]) and _same(a["params"], b["params"]), how


def second_optimizer_case(overlap_first: bool) -> dict:
    """Two models, each with its optimizer, stepped one after the other (``for opt in optimizers:
    opt.step()``): the second, not overlapped, compiles its fused kernels while the first one's
    gathers are in flight."""
    kernel = os.environ.get("SHARDOPT_KERNEL")
    os.environ["SHARDOPT_KERNEL"] = "auto"  # the default: fused kernels, compiled
    try:
        rank = dist.get_rank()
        torch.manual_seed(21)
        first = ReadModel(tied=False)
        torch.manual_seed(22)
        second = torch.nn.Sequential(torch.nn.Linear(24, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24))
        first_opt = shardopt.ShardedAdamW(first.parameters(), lr=1e-2, bucket_cap_mb=0.25,
                                          overlap_param_gather=overlap_first)
        second_opt = shardopt.ShardedAdamW(second.parameters(), lr=1e-2)
        x = torch.randn(8, 24, generator=torch.Generator().manual_seed(rank))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                first_opt.zero_grad()
                second_opt.zero_grad()
                first_opt.backward(first(batch(rank, step, vocab=2048, n=8, t=16)))
                second_opt.backward(second(x).square().mean())
                with slow_sender():
                    first_opt.step()
                second_opt.clip_grad_norm_(1.0)
                second_opt.step()
        first_opt.finish_param_gather()
    finally:
        if kernel is None:
            del os.environ["SHARDOPT_KERNEL"]
        else:
            os.environ["SHARDOPT_KERNEL"] = kernel
    return {"kernels": sorted({b.kernels.name for b in second_opt._buffers}),
            "warnings": [str(w.message) for w in caught if "shardopt" in str(w.message)],
            "params": [p.detach().clone() for p in second.parameters()]}


def test_a_second_optimizer_keeps_its_compiled_update_beside_an_overlapped_one(pools):
    pool = pools(2)
    plain = pool.run(second_optimizer_case, False)
    over = pool.run(second_optimizer_case, True)
    for a, b in zip(plain, over):
        assert a["kernels"] == ["fused"] and a["warnings"] == [], a
        assert b["kernels"] == ["fused"] and b["warnings"] == [], b
        assert _same(a["params"], b["params"])


def exit_hooks_case(overlap: bool) -> int:
    """The callbacks at interpreter exit added by building (and stepping) ten optimizers, each
    superseding the last."""
    rank = dist.get_rank()
    before = atexit._ncallbacks()
    model = torch.nn.Linear(8, 8)
    for _ in range(10):
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, overlap_param_gather=overlap)
        opt.backward(model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).square().mean())
        opt.step()
    opt.finish_param_gather()
    return atexit._ncallbacks() - before


def test_overlapped_optimizers_add_one_exit_callback_in_all(pools):
    pool = pools(2)
    plain = pool.run(exit_hooks_case, False)
    over = pool.run(exit_hooks_case, True)
    for a, b in zip(plain, over):
        assert b <= a + 1, (a, b)

# -- TorchScript blocks -------------------------------------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class ScriptedBlocks(torch.nn.Module):
    """ReadModel's shape with its body made of TorchScript blocks, whose inner modules no Python
    hook sees."""

    def __init__(self, vocab: int = 2048, dim: int = 192) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList([torch.jit.script(Block(dim)) for _ in range(3)])
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), idx.roll(1, dims=-1).view(-1))


def scripted_case(overlap: bool) -> dict:
    """Training a model with TorchScript blocks, and a block called on its own right after step()."""
    rank = dist.get_rank()
    torch.manual_seed(21)
    with torch.jit.optimized_execution(False):  # the same kernels in both runs (no profiling executor's fusions)
        model = ScriptedBlocks()
        opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.25, overlap_param_gather=overlap)
        losses, read = [], []
        for step in range(3):
            opt.zero_grad()
            loss = model(batch(rank, step, vocab=2048, n=8, t=16))
            losses.append(loss.detach())
            opt.backward(loss)
            with slow_sender():
                opt.step()
            with torch.no_grad():
                read.append(model.blocks[1](torch.ones(2, 192)))
        opt.finish_param_gather()
    return {"losses": losses, "read": read, "params": [p.detach().clone() for p in model.parameters()]}


def test_a_model_with_torchscript_blocks_trains_with_overlapped_gathers(pools):
    pool = pools(2)
    plain = pool.run(scripted_case, False)
    over = pool.run(scripted_case, True)
    for a, b in zip(plain, over):
        for key in ("losses", "read", "params"):
            assert _same(a[key], b[key]), key


# -- the cost of a landing ----------------------------------------------------------------------------
def landing_cost_case(overlap: bool) -> dict:
    """The forward right after step() with every parameter in a bucket of its own: which torch calls
    a mode of the user's sees, and how many parameter versions the landings read (each landing
    checks its own parameters for writes that raced it, see step._usage_checks)."""
    import shardopt.group._binding as binding

    rank = dist.get_rank()
    torch.manual_seed(5)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(12)])
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=ONE_ELEMENT_MB,
                                overlap_param_gather=overlap)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    opt.backward(model(x).square().mean())
    opt.step()
    reads = []
    read = binding.version
    binding.version = lambda t: reads.append(1) or read(t)
    user = Counting()
    try:
        with user:
            y = model(x)
    finally:
        binding.version = read
    opt.finish_param_gather()
    return {"y": y.detach(), "calls": user.calls, "versions": len(reads),
            "params": len(list(model.parameters()))}


def test_a_landing_costs_its_own_parameters_and_no_users_mode_sees_it(pools):
    pool = pools(2)
    for a, b in zip(pool.run(landing_cost_case, False), pool.run(landing_cost_case, True)):
        assert _same(a["y"], b["y"])
        assert b["calls"] == a["calls"], (a["calls"], b["calls"])  # the same calls as without overlap
        assert a["versions"] == 0 and b["versions"] == b["params"], (a["versions"], b["versions"])


# -- an optimizer dropped with gathers in flight ------------------------------------------------------
def dropped_in_flight_case(overlap: bool) -> dict:
    """``del opt`` right after step(), its gathers in flight: the weights are the stepped ones, and
    its buffers are freed at once, before any module call."""
    rank = dist.get_rank()
    torch.manual_seed(21)
    model = ReadModel(tied=False)
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-2, bucket_cap_mb=0.25, overlap_param_gather=overlap)
    opt.backward(model(batch(rank, 0, vocab=2048, n=8, t=16)))
    with slow_sender():
        opt.step()
    buffer = weakref.ref(opt._buffers[0])
    del opt
    gc.collect()
    freed = buffer() is None
    weights = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model(batch(rank, 1, vocab=2048, n=8, t=16))  # the guard left by the dropped optimizer goes here
    return {"freed": freed, "weights": weights, "guards": _guards()}


def test_an_optimizer_dropped_with_gathers_in_flight_is_freed_at_once(pools):
    pool = pools(2)
    for a, b in zip(pool.run(dropped_in_flight_case, False), pool.run(dropped_in_flight_case, True)):
        assert _same(a["weights"], b["weights"])
        assert a["freed"] and b["freed"] and b["guards"] == [], (a, b)


def test_writes_racing_gathers_of_two_flat_groups_are_named_in_the_order_their_gathers_landed(one_rank_group):
    """Another thread writes two weights of two flat buffers (fp32 and bf16) while their overlapped
    gathers are in flight; the forward then waits bucket by bucket in module order. The next step
    refuses and names the write whose gather landed first (the bf16 layer, the second of the
    fp32 buffer's layout order), as it names the first of problems found in any order."""
    torch.manual_seed(0)
    a, b, c = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16), torch.nn.Linear(8, 8)
    model = torch.nn.ModuleDict({"a": a, "b": b, "c": c})

    def forward(x: torch.Tensor) -> torch.Tensor:
        return c(b(a(x).to(torch.bfloat16)).float())

    opt = shardopt.ShardedAdamW(model.parameters(), lr=0.1, overlap_param_gather=True, bucket_cap_mb=1e-5)
    assert len(opt._buffers) == 2
    x = torch.ones(4, 8)
    forward(x).sum().backward()
    opt.step()  # every bucket's gather in flight
    def write() -> None:
        with torch.no_grad():
            c.weight.add_(1.0)
            b.weight.add_(1.0)

    writer = threading.Thread(target=write)
    writer.start()
    writer.join()
    forward(x).sum().backward()  # waits for a's, b's, then c's buckets: b's write is found first
    with pytest.raises(RuntimeError, match=r"parameter #2 \(param group 0, shape \(8, 8\)\) was written .* still gathering"):
        opt.step()
    opt.close()
