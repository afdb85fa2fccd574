"""Which of shardopt's modules run while one gradient goes through a step, phase by phase:
``python tools/walk_modules.py [--stage 1|2] [--overlap]``.

One process (a gloo group of one rank, so every collective call is still made), a small MLP,
two warm-up steps, then a traced third: the backward pass (hook, take, reduce-scatter), step()
(checks, update, all-gather), zero_grad(), and the next forward (where overlapped gathers are
waited for). Prints, per phase, the modules whose Python functions ran (``sys.settrace`` call
events), in first-call order, and the union. The modules of the gradient's own path are marked
``*``: those that hold, move or write its values or its bucket (docs/design.md, "The walk of one
gradient").
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

# The gradient's own path: hook -> take -> stage -> reduce-scatter -> land -> update -> gather -> wait.
PATH = {"group/_rounds.py", "group/_intake.py", "group/_grad_store.py", "group/_grad_placeholder.py",
        "comm/_collectives.py", "comm/_bucket_paths.py", "optimizer.py", "group/_flat_group.py", "update/_master.py",
        "update/_moments.py", "kernels/fused.py", "group/_gather_wait.py", "core/_records.py"}


def traced(fn: Callable[[], object], root: str) -> list[str]:
    """The modules under ``root`` whose functions ``fn`` called, in first-call order."""
    seen: dict[str, None] = {}

    def tracer(frame, event, arg):  # noqa: ANN001, ANN202 - sys.settrace's signature
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen.setdefault(os.path.relpath(frame.f_code.co_filename, root), None)

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return list(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2))
    parser.add_argument("--overlap", action="store_true", help="overlap_param_gather=True")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import shardopt

    root = os.path.dirname(shardopt.__file__)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = shardopt.ShardedAdamW(model.parameters(), lr=1e-3, stage=args.stage, overlap_param_gather=args.overlap)
    x = torch.randn(4, 64)
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    loss = model(x).sum()
    phases = {"backward": traced(loss.backward, root), "step": traced(opt.step, root),
              "zero_grad": traced(opt.zero_grad, root), "next forward": traced(lambda: model(x), root)}
    union: dict[str, None] = {}
    for name, modules in phases.items():
        union.update(dict.fromkeys(modules))
        print(f"{name} ({len(modules)}): " + ", ".join(m + ("*" if m in PATH else "") for m in modules))
    on_path = [m for m in union if m in PATH]
    print(f"all phases: {len(union)} modules, {len(on_path)} on the gradient's own path (*), "
          f"{len({m.split('/')[0] for m in on_path if '/' in m})} folders")
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
