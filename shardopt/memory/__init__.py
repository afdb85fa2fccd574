"""Bytes per rank: predicted from the ZeRO formulas and measured from the tensors actually held.

Categories (all in bytes, on one rank):
``params`` 16-bit (or fp32) model weights, replicated; ``grads`` gradient storage (stage 1: full,
stage 2: this rank's shard); ``master`` fp32 master shard (none for fp32 parameters, whose shard
is its own master); ``exp_avg`` / ``exp_avg_sq`` Adam moments, sharded (fp32, bf16, or 8-bit codes
plus their block scales: see ``shardopt.update._moments``; ``exp_avg_sq`` also holds amsgrad's
``max_exp_avg_sq``); ``extra`` other
per-element state of the master-weight mode (e.g. remainders); ``buffers`` communication
buffers: stage-2 staging, gloo's receive buffers, the fp32 sum of no_sync accumulation
(high-water mark). ``peak`` holds each category's high-water mark since the optimizer was built
or ``reset_peak_memory()``: ``grads`` there includes the ``.grad`` tensors autograd holds during
backward until the optimizer takes them.

With ``offload="cpu"`` the categories stay what is held, wherever it is: ``host_state`` bytes of
``master``, ``exp_avg``, ``exp_avg_sq`` and ``extra`` are then in host memory (all of them, or
``offload_fraction`` of them), and ``host`` counts the host bytes (those plus ``host_copies``, the
host copies of the weight and gradient shards, and alignment); ``accelerator`` and
``accelerator_peak`` count the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardopt.kernels.reference import MOMENT_BLOCK

CATEGORIES = ("params", "grads", "master", "exp_avg", "exp_avg_sq", "extra", "buffers")

@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """Bytes held on one rank, by category; ``predicted`` holds the formula's figure per category."""

    params: int = 0
    grads: int = 0
    master: int = 0
    exp_avg: int = 0
    exp_avg_sq: int = 0
    extra: int = 0
    buffers: int = 0
    grads_peak: int = 0  # high-water mark of gradient bytes, .grad tensors held during backward included
    held_peak: int = 0  # high-water mark of gradient plus buffer bytes held at one moment; 0: not tracked
    predicted: dict[str, int] = field(default_factory=dict)
    cuda_max_allocated: int | None = None  # torch.cuda.max_memory_allocated() on this rank's device, bytes
    num_params: int = 0  # trainable parameter elements (each shared tensor counted once)
    world_size: int = 1
    rank: int = 0
    stage: int = 2
    shard_size: int = 0  # ranks the state is sharded over (hybrid sharding: fewer than world_size); 0: world_size
    offload: str | None = None  # "cpu": master, moments and extras (of offload_fraction of them) in host memory
    host: int = 0  # bytes of host memory held for the offloaded state: one buffer per offloaded piece
    host_copies: int = 0  # of which the host copies of the weight and gradient shards
    host_state: int = 0  # bytes of master, exp_avg, exp_avg_sq and extra that are in host memory

    @property
    def accelerator(self) -> int:
        """Bytes held on the parameters' device now: everything but the state offloaded to host memory."""
        return self.total - self.host_state

    @property
    def accelerator_peak(self) -> int:
        """The most bytes held on the parameters' device at one moment (``peak_total`` less the
        offloaded state, which never moves)."""
        return self.peak_total - self.host_state

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in CATEGORIES)

    @property
    def peak(self) -> dict[str, int]:
        """High-water mark per category, bytes (see the module docstring)."""
        return {c: max(self.grads, self.grads_peak) if c == "grads" else getattr(self, c) for c in CATEGORIES}

    @property
    def peak_total(self) -> int:
        """The most bytes held at one moment: weights and optimizer state plus the high-water mark of
        gradients and buffers held together (the sum of their own high-water marks, an upper bound,
        when ``held_peak`` was not tracked)."""
        fixed = self.params + self.optimizer_state
        return fixed + (self.held_peak or self.peak["grads"] + self.buffers)

    @property
    def predicted_total(self) -> int:
        return sum(self.predicted.get(c, 0) for c in CATEGORIES)

    @property
    def optimizer_state(self) -> int:
        """Bytes of master weights, moments and extras: what ZeRO shards in stage 1."""
        return self.master + self.exp_avg + self.exp_avg_sq + self.extra

    def __add__(self, other: MemoryReport) -> MemoryReport:
        merged = {c: getattr(self, c) + getattr(other, c) for c in CATEGORIES}
        pred = {c: self.predicted.get(c, 0) + other.predicted.get(c, 0) for c in CATEGORIES}
        return MemoryReport(**merged, predicted=pred, num_params=self.num_params + other.num_params,
                            grads_peak=max(self.grads, self.grads_peak) + max(other.grads, other.grads_peak),
                            held_peak=self.held_peak + other.held_peak if self.held_peak and other.held_peak else 0,
                            world_size=self.world_size, rank=self.rank, stage=self.stage, shard_size=self.shard_size,
                            cuda_max_allocated=self.cuda_max_allocated, offload=self.offload or other.offload,
                            host=self.host + other.host, host_copies=self.host_copies + other.host_copies,
                            host_state=self.host_state + other.host_state)

    def __str__(self) -> str:
        per = max(self.num_params, 1)
        peak = self.peak
        hybrid = f", sharded over {self.shard_size}" if self.shard_size and self.shard_size != self.world_size else ""
        rows = [f"memory on rank {self.rank} of {self.world_size} (stage {self.stage}{hybrid}, "
                f"{self.num_params:,} parameters)",
                f"| {'category':<10} | {'now':>14} | {'peak':>14} | {'predicted':>14} | {'B/param':>7} |",
                f"|{'-' * 12}|{'-' * 16}|{'-' * 16}|{'-' * 16}|{'-' * 9}|"]
        for c in CATEGORIES + ("total",):
            m = self.total if c == "total" else getattr(self, c)
            top = self.peak_total if c == "total" else peak[c]
            p = self.predicted_total if c == "total" else self.predicted.get(c, 0)
            rows.append(f"| {c:<10} | {m:>14,} | {top:>14,} | {p:>14,} | {m / per:>7.3f} |")
        rows.append("(buffers: high-water mark; peak: since the optimizer was built or reset_peak_memory(); "
                    "peak total: the most held at one moment)")
        if self.offload:
            rows.append(f"offload={self.offload!r}: {self.host_state:,} bytes of master, exp_avg, exp_avg_sq and extra "
                        f"are in host memory; host holds {self.host:,} bytes (with {self.host_copies:,} of weight and "
                        f"gradient copies), the "
                        f"accelerator {self.accelerator:,} now and {self.accelerator_peak:,} at peak "
                        f"({self.accelerator / per:.3f} B/param)")
        if self.cuda_max_allocated is not None:
            rows.append(f"torch.cuda.max_memory_allocated(): {self.cuda_max_allocated:,} bytes (activations included)")
        return "\n".join(rows)


def predict_bytes(
    num_params: int, world_size: int, *, stage: int, param_dtype: torch.dtype, master_weights: str = "fp32",
    moments: str = "fp32", bucket_cap_bytes: float = 0.0, staging_buckets: int = 3, rule: str = "adamw",
    amsgrad: bool = False,
) -> dict[str, int]:
    """The ZeRO formula per category, in bytes on one rank, for ``num_params`` elements of one dtype.

    Sharded figures are ``ceil(bytes / world_size)``; padding (below one alignment per parameter
    and ``world_size * alignment`` per buffer) is not included. Communication buffers (stage 2
    staging and the receive buffers of reductions) hold at most ``staging_buckets`` buckets of
    ``bucket_cap_bytes`` at once; a parameter larger than the cap makes its own, larger bucket.
    ``rule="muon"``: Muon's one momentum buffer (stored as ``moments``, fp32 or bf16) is counted as
    ``exp_avg``, and there is no ``exp_avg_sq``. ``amsgrad``: ``exp_avg_sq`` also holds its running
    maximum (``max_exp_avg_sq``, stored as ``moments``: fp32 or bf16), twice the bytes.
    """
    psize = torch.empty((), dtype=param_dtype).element_size()
    sixteen_bit = psize == 2

    def shard(nbytes_per_elem: int) -> int:
        return -(-num_params * nbytes_per_elem // world_size)

    master = {"fp32": 4, "remainder": 0, "stochastic": 0, "none": 0}[master_weights] if sixteen_bit else 0
    extra = 2 if (sixteen_bit and master_weights == "remainder") else 0

    def moment() -> int:  # one moment: fp32, bf16, or one byte per element plus an fp32 scale per block
        if moments == "8bit":
            n = -(-num_params // world_size)
            return n + 4 * -(-n // MOMENT_BLOCK)
        return shard({"fp32": 4, "bf16": 2}[moments])
    return {
        "params": num_params * psize,
        "grads": num_params * psize if stage == 1 else shard(psize),
        "master": shard(master),
        "exp_avg": moment(),
        "exp_avg_sq": 0 if rule == "muon" else moment() * (2 if amsgrad else 1),
        "extra": shard(extra),
        "buffers": int(min(num_params * psize * (2 if stage == 2 else 1), staging_buckets * bucket_cap_bytes)),
    }

def ddp_adamw_bytes(num_params: int, param_dtype: torch.dtype, amsgrad: bool = False) -> dict[str, int]:
    """Bytes per rank of the same parameters under DDP with a replicated mixed-precision AdamW
    (``amsgrad``: with its fp32 max_exp_avg_sq, counted in ``exp_avg_sq``)."""
    psize = torch.empty((), dtype=param_dtype).element_size()
    return {
        "params": num_params * psize,
        "grads": num_params * psize,
        "master": num_params * 4 if psize == 2 else 0,
        "exp_avg": num_params * 4,
        "exp_avg_sq": num_params * (8 if amsgrad else 4),
        "extra": 0,
        "buffers": 0,
    }
