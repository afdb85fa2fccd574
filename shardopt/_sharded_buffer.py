"""One flat buffer of same-dtype parameters with everything this rank keeps for it.

Ties together the layout, the flat parameters, the gradient reducer, the master-weight strategy
and the Adam moments of this rank's shard. Holds no math of its own.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from shardopt._collectives import Comm, Pending
from shardopt._config import ShardConfig
from shardopt._flat import FlatParams
from shardopt._layout import build_layout
from shardopt._reducer import MAX_INFLIGHT, GradReducer
from shardopt.kernels import make_scalars, select
from shardopt.master import make_master
from shardopt.memory import MemoryReport, predict_bytes


class ShardedBuffer:
    """Parameters of one (dtype, device), their flat buffer, and this rank's optimizer state."""

    exp_avg: Tensor  # 1D fp32, this rank's shard
    exp_avg_sq: Tensor  # 1D fp32, this rank's shard

    def __init__(self, params: Sequence[torch.nn.Parameter], group_of: Sequence[int], comm: Comm,
                 config: ShardConfig) -> None:
        self.comm, self.config = comm, config
        element_size = params[0].element_size()
        self.layout = build_layout([p.shape for p in params], comm.world_size, alignment=config.alignment,
                                   bucket_numel=config.bucket_numel(element_size))
        self.group_of = list(group_of)  # param-group index of each parameter, in buffer order
        self.flat = FlatParams(params, self.layout)
        comm.broadcast(self.flat.data, src=0).wait()  # every rank starts from rank 0's weights
        self.shard_range = self.layout.shard_range(comm.rank)
        self.segments = self.layout.segments(comm.rank, self.group_of)
        self.master = make_master(config.master_weights, self.flat.slice(self.shard_range),
                                  global_offset=self.shard_range.start, kernels=select(), seed=config.seed)
        n = self.layout.shard_numel
        self.exp_avg = torch.zeros(n, dtype=torch.float32, device=self.flat.device)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.float32, device=self.flat.device)
        self.reducer = GradReducer(self.flat, comm, config.stage, config.accumulate_dtype, config.reduce_dtype)
        # Per bucket, each rank's global range of it: the pieces its all-gather assembles.
        self._gather_pieces = [self.layout.bucket_shard_ranges(b.index) for b in self.layout.buckets]
        self.bucket_of_param = {id(p): self.reducer.bucket_of(i) for i, p in enumerate(self.flat.params)}

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    def update(self, step: int, grad_scale: float, param_groups: Sequence[dict]) -> None:
        """AdamW on this rank's shard, one call per param-group segment. Local; no communication."""
        grad = self.reducer.local_grad()
        for g, r in self.segments:
            hp = param_groups[g]
            beta1, beta2 = hp["betas"]
            s = r.as_slice()
            scalars = make_scalars(lr=float(hp["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(hp["eps"]),
                                   weight_decay=float(hp["weight_decay"]), step=step, grad_scale=grad_scale,
                                   device=self.flat.device)
            self.master.update_(r, grad[s], self.exp_avg[s], self.exp_avg_sq[s], scalars, step)

    def gather_buckets(self) -> list[tuple[int, Pending]]:
        """Start the all-gather of every rank's updated shard into the flat buffer (the model's
        weights), one bucket at a time in the order the forward pass uses them. Every rank."""
        return [(b, self.comm.all_gather_inplace(self.flat.data, self._gather_pieces[b]))
                for b in self.reducer.forward_order]

    def gather_params(self) -> Pending:
        """All buckets' all-gathers as one handle. Every rank."""
        parts = [p for _, p in self.gather_buckets()]
        return Pending([w for p in parts for w in p.works], keep_alive=[self.flat.data], stats=self.comm.stats)

    def _staging_buckets(self) -> int:
        """Buckets' worth of communication buffers at the worst moment: MAX_INFLIGHT + 1 reductions in
        flight, each with a receive buffer of up to world_size x this rank's piece (gloo's all-to-all;
        none on NCCL), and in stage 2 their staging plus one bucket filling."""
        in_flight = MAX_INFLIGHT + 1
        recv = 0 if self.comm.backend == "nccl" else in_flight * self.comm.world_size
        return recv if self.config.stage == 1 else recv + in_flight + 1

    def memory_report(self) -> MemoryReport:
        """Bytes held on this rank for this buffer, measured from the tensors, and predicted."""
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        return MemoryReport(
            params=self.flat.nbytes, grads=self.reducer.grad_bytes, master=self.master.master_bytes,
            exp_avg=nbytes(self.exp_avg), exp_avg_sq=nbytes(self.exp_avg_sq), extra=self.master.extra_bytes,
            buffers=self.reducer.staging_peak_bytes,
            predicted=predict_bytes(self.layout.param_numel, self.comm.world_size, stage=self.config.stage,
                                    param_dtype=self.dtype, master_weights=self.master.name,
                                    bucket_cap_bytes=self.config.bucket_cap_mb * 2**20,
                                    staging_buckets=self._staging_buckets()),
            num_params=self.layout.param_numel, world_size=self.comm.world_size, rank=self.comm.rank,
            stage=self.config.stage)
