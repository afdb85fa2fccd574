"""``sync_module_states``: every rank takes one rank's parameters and buffers, as DDP does at construction.

``ShardedAdamW`` makes the parameters it is given equal to rank 0's at construction; it never sees
a module's buffers (BatchNorm running statistics) or parameters left out of the optimizer. A
model initialised with rank-dependent seeds needs this call (or equal seeds on every rank).
"""
from __future__ import annotations

import itertools

import torch

from shardopt.comm._collectives import Comm, ProcessGroup


def sync_module_states(module: torch.nn.Module, *, src: int = 0, process_group: ProcessGroup = None) -> None:
    """Copy group rank ``src``'s parameters and buffers of ``module`` to every rank, in place: one
    broadcast per (dtype, device). Every rank of the group; a module whose tensors differ in
    number, shape or dtype across ranks raises ValueError on every rank."""
    comm = Comm(process_group)
    if not 0 <= src < comm.world_size:
        raise ValueError(f"src must be a rank of the group, got {src=} with world_size={comm.world_size}")
    seen: set[int] = set()
    tensors = []
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) not in seen and t.numel() > 0:
            seen.add(id(t))
            tensors.append(t)
    desc = [(tuple(t.shape), str(t.dtype)) for t in tensors]
    if not comm.same_everywhere(desc):
        raise ValueError(f"sync_module_states: the module's parameters and buffers differ across ranks in number, "
                         f"shape or dtype (this rank has {len(desc)}); build the same model on every rank")
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for ts in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            comm.broadcast(flat, src=src).wait()
            offset = 0
            for t in ts:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
