"""One replica group of a fault-tolerant job: a small byte-level GPT, ShardedAdamW sharded over this
group's ranks and averaged across the groups alive through torchft (``pip install -e '.[ft]'``).

Run one of these per replica group, each its own torchrun job (its own --master-port), beside a
torchft Lighthouse (``TORCHFT_LIGHTHOUSE``); ``examples/ft_punisher.py`` starts the Lighthouse and
the groups, kills a random rank every few seconds and lets torchrun restart its group:

    python examples/ft_punisher.py --groups 2 --ranks 2 --steps 100 --kill-every 8

By hand, for group G of R:

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP=G torchrun --nproc_per_node=2 \
        --master-port=$((29600 + G)) --max-restarts=10 examples/train_ft.py --steps 60

Batches depend on (group, step, rank) only, so a step retried after a failed vote uses the same
ones. Prints one line per committed step on the group's rank 0; at the end each rank writes a
fingerprint of its weights and of its optimizer shard to --out (when given), so the groups can be
compared.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shardopt  # noqa: E402
import shardopt.fault_tolerance  # noqa: E402
from gpt import GPT, GPTConfig, load_bytes  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--step-seconds", type=float, default=0.0, help="pause per step (to watch failures)")
    p.add_argument("--out", default=None, help="folder for each rank's final fingerprint")
    return p.parse_args()


def fingerprint(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    from torchft import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    args = parse_args()
    group = int(os.environ.get("REPLICA_GROUP", "0"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # every group builds the same model (init_sync=False below)
    model = GPT(GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd))
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=None, state_dict=None,
                      min_replica_size=1, replica_id=f"group{group}", init_sync=False,
                      hostname="127.0.0.1", timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=60))
    opt = shardopt.ShardedAdamW(model.parameters(), lr=args.lr, stage=args.stage, replicas=manager)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    opt.register_step_post_hook(lambda *_: sched.step())  # steps with each committed step only
    shardopt.fault_tolerance.register(manager, opt, scheduler=sched, model=model)
    wrapped = OptimizerWrapper(manager, opt)

    data = load_bytes(None, limit=1 << 20)
    start, committed_here = time.perf_counter(), 0
    while manager.current_step() < args.steps:
        step = manager.current_step()
        g = torch.Generator().manual_seed(100_003 * group + 1_009 * step + rank)
        ix = torch.randint(len(data) - args.block_size - 1, (args.batch_size,), generator=g)
        x = torch.stack([data[i:i + args.block_size] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + args.block_size] for i in ix])
        wrapped.zero_grad()
        loss = model(x, y)
        loss.backward()
        wrapped.step()
        if manager.current_step() == step + 1:
            committed_here += 1
            if rank == 0:
                print(f"group {group} step {step:4d} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"groups in quorum {manager.num_participants()}", flush=True)
        time.sleep(args.step_seconds)
    seconds = time.perf_counter() - start
    if args.out:
        from shardopt.checkpoint._rank_state import heal_state_dict  # the shard as healing sends it

        shard = heal_state_dict(opt)
        record = {"group": group, "rank": rank, "ranks": ranks, "step": manager.current_step(),
                  "weights": fingerprint([p for p in model.parameters()]),
                  "shard": fingerprint([t for b in shard["buffers"] for t in b.values() if isinstance(t, torch.Tensor)]),
                  "committed_here": committed_here, "seconds": seconds}
        with open(os.path.join(args.out, f"group{group}-rank{rank}.json"), "w") as f:
            json.dump(record, f)
    dist.barrier()
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
