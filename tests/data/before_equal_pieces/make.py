"""Writes this folder's checkpoint, rank state dicts and reference, with the shardopt that is
imported: run once under the version whose shards were one range of the flat buffer (0.1.0 before equal pieces),
``torchrun --nproc_per_node=2 make.py``, from the repository root, with ``tests`` on the path.

A TinyNet in bf16 (fp32 master weights, fp32 moments, stage 2, three buckets), three steps on
the same batches on both ranks, then ``save_checkpoint`` into ``checkpoint/``, each rank's
``opt.state_dict()`` into ``rank{r}.pt``, and rank 0's ``full_state_dict`` and weights into
``reference.pt`` (what the checkpoint holds, read back by the version that wrote it).
"""
import os

import torch
import torch.distributed as dist

import shardopt
from models import batch, make_model, param_groups

HERE = os.path.dirname(os.path.abspath(__file__))
BUCKET_MB = 1 / 1024  # 512 bf16 elements: several buckets


def build(seed: int, group=None):
    model = make_model(seed=seed, dtype=torch.bfloat16)
    opt = shardopt.ShardedAdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, stage=2,
                                master_weights="fp32", bucket_cap_mb=BUCKET_MB, process_group=group)
    return model, opt


def main() -> None:
    dist.init_process_group("gloo")
    model, opt = build(seed=3)
    for step in range(3):
        opt.zero_grad()
        opt.backward(model(batch(0, step)))
        opt.step()
    shardopt.save_checkpoint(os.path.join(HERE, "checkpoint"), model, opt)
    torch.save(opt.state_dict(), os.path.join(HERE, f"rank{dist.get_rank()}.pt"))
    fsd = shardopt.checkpoint.full_state_dict(opt)
    if dist.get_rank() == 0:
        torch.save({"fsd": fsd, "weights": model.state_dict(), "buckets": len(opt.inspect().buffers[0].layout.buckets),
                    "version": shardopt.__version__}, os.path.join(HERE, "reference.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
