"""Where this rank's optimizer state lives: beside the weights, or in host memory (``offload="cpu"``).

[Note: offload]
A placement is the strategy a ``FlatGroup`` holds for where its master weights, moments and
the update run. ``OnDevice`` (``offload=None``) keeps them on the parameters' device and copies
nothing: the master strategy writes the flat buffer's shard in place. ``OnHost`` (``offload="cpu"``)
allocates, once per buffer at construction, one host buffer of the exact size (64-byte aligned
tensors; pinned with ``cudaHostRegister`` when the weights are on CUDA, so no power-of-two
rounding by the caching host allocator) and carves from it:

- a host copy of this rank's weight shard (the ``param_shard`` the master strategy writes);
- the master weights or remainders, and the moments (through the strategies' ``empty``);
- a host copy of the averaged gradient shard (AdamW; Muon's update runs where its gradient is).

Each bucket's views and copy events sit in its ``BucketRecord.host``. A step, bucket by bucket in
forward order: ``begin`` issues every bucket's device-to-host gradient copy on one persistent
side stream (events recorded per bucket); ``grad_of`` waits for one bucket's copy; the update
runs on the host with the CPU kernels; ``publish`` copies the bucket's new weights to the device
on the current stream, so the bucket's all-gather, issued next, follows it, while the host goes
on with the next bucket. Before the host writes a bucket's weights again it waits for the event of
their last copy. On a CPU-only machine the same path runs with host-to-host copies.

The inf/NaN check, the norm and the clip coefficient are computed where the gradient lives (the
accelerator), before any copy, and reach the host kernels as the scalars every update gets; so the
host update computes what the device update computes, bit for bit (the kernels' self-check holds
them to the reference on each device).
"""
from __future__ import annotations

import logging
import mmap
import warnings
import weakref
from typing import Sequence, cast

import torch
from torch import Tensor

from shardopt.core._flat import ShardView, whole
from shardopt.core._layout import Range
from shardopt.core._records import BucketRecord, HostCopy

log = logging.getLogger("shardopt")

ALIGN = 64  # bytes: every tensor carved from a host buffer starts at a multiple of it
MAX_TENSORS = 8  # tensors one buffer carves at most (weights, gradient, 2 master planes, 4 moment tensors)


class HostBuffer:
    """One host allocation of ``nbytes`` bytes (anonymous memory, page-aligned) that tensors are
    carved from in order; pinned (``cudaHostRegister``, released with the buffer) when ``pin``. Local.

    Each carved tensor is a tensor of its own over its bytes (``torch.frombuffer``), not a view of
    ``data``: tensors of several dtypes in one storage would alias in a compiled kernel's eyes, and
    a compiled kernel refuses to write inputs that alias with another dtype."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.memory = mmap.mmap(-1, nbytes)
        self.data = torch.frombuffer(self.memory, dtype=torch.uint8)  # the whole allocation, 1D, bytes
        self.used = 0  # bytes carved so far, alignment padding included
        self.pinned = pin and _register(self.data)
        if self.pinned:
            weakref.finalize(self, _unregister, self.data.data_ptr())

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A 1D tensor of ``numel`` elements of ``dtype`` from the buffer (zeroed at first)."""
        start = -(-self.used // ALIGN) * ALIGN
        end = start + numel * dtype.itemsize
        if end > self.data.numel():
            raise RuntimeError(f"shardopt: the host buffer of {self.data.numel():,} bytes cannot hold {numel:,} more "
                               f"elements of {dtype} ({self.used:,} bytes taken); this is a bug in shardopt's "
                               "offload sizing, please report it")
        self.used = end
        if not numel:
            return torch.empty(0, dtype=dtype)
        with warnings.catch_warnings():  # frombuffer warns that the buffer is writable: it is meant to be
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self.memory, dtype=dtype, count=numel, offset=start)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _register(t: Tensor) -> bool:
    try:
        error = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
        if int(getattr(error, "value", error)) != 0:
            raise RuntimeError(f"cudaHostRegister returned {error}")
        return True
    except Exception as e:  # noqa: BLE001 - no CUDA runtime to call, or a refusal: run unpinned, and say so
        log.warning("shardopt: could not pin the offload buffer (%s): host copies will not overlap", e)
        return False


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except (RuntimeError, AttributeError):
        pass


class OnDevice:
    """``offload=None``: the state lives beside the weights; the master strategy writes the weight
    shard itself and nothing is copied."""

    name: str | None = None
    host_bytes = 0  # bytes of host memory held (the one host buffer)
    copy_bytes = 0  # of which the weight and gradient copies

    def __init__(self, weight_shard: Tensor | ShardView) -> None:
        self.weights = weight_shard  # what the master strategy writes: the flat buffer's shard itself
        self.device = weight_shard.device  # where the state lives and the update runs

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """An uninitialised 1D tensor for the state, where the state lives."""
        return torch.empty(numel, dtype=dtype, device=self.device)

    def begin(self, grad: Tensor | ShardView, buckets: Sequence[BucketRecord]) -> None:
        """Start moving the averaged gradient shard ``grad`` to where the update runs. Local."""

    def grad_of(self, b: BucketRecord, grad: Tensor | ShardView) -> Tensor | ShardView:
        """The gradient shard to update bucket ``b`` from (shard coordinates), once ``b``'s part is there."""
        return grad

    def publish(self, b: BucketRecord) -> None:
        """Bucket ``b``'s updated weights into the flat buffer, ahead of its all-gather. Local."""

    def pull(self, r: Range) -> None:
        """The flat buffer's weights over local range ``r`` were written: bring them to ``weights``."""

    def push(self) -> None:
        """``weights`` was written as a whole (a checkpoint loaded): bring it into the flat buffer."""


class OnHost(OnDevice):
    """``offload="cpu"``: see [Note: offload]."""

    name = "cpu"

    def __init__(self, weight_shard: Tensor | ShardView, grad_dtype: torch.dtype | None, buckets: Sequence[BucketRecord],
                 state_bytes: int) -> None:
        n = weight_shard.numel()
        self.accelerated = weight_shard.device.type == "cuda"
        copies = n * weight_shard.element_size() + (n * grad_dtype.itemsize if grad_dtype is not None else 0)
        self.buffer = HostBuffer(copies + state_bytes + ALIGN * MAX_TENSORS, pin=self.accelerated)
        self.device_weights = weight_shard  # the flat buffer's shard, on the parameters' device
        self.device = torch.device("cpu")
        self.weights = self.empty(n, weight_shard.dtype).copy_(whole(weight_shard))
        self.grad = self.empty(n, grad_dtype) if grad_dtype is not None else None
        self.copy_bytes = copies
        # one persistent side stream for the gradients' copies (a new stream per step grows allocator pools)
        self.stream = torch.cuda.Stream(weight_shard.device) if self.accelerated else None
        event = torch.cuda.Event if self.accelerated else (lambda: None)
        for b in buckets:
            sl = b.local.as_slice()
            b.offloaded(HostCopy(weights=self.weights[sl], device_weights=weight_shard[sl],
                              gradient=None if self.grad is None else self.grad[sl],
                              grad_copied=event(), weights_copied=event()))
        self.buckets = tuple(buckets)

    @property
    def host_bytes(self) -> int:  # type: ignore[override]
        return self.buffer.nbytes

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        return self.buffer.take(numel, dtype)

    def begin(self, grad: Tensor | ShardView, buckets: Sequence[BucketRecord]) -> None:
        if self.stream is None or self.grad is None:  # host to host: each copied when its bucket is updated
            return
        self.stream.wait_stream(torch.cuda.current_stream(grad.device))  # the reductions have landed
        with torch.cuda.stream(self.stream):
            for b in buckets:
                if b.host is None:  # offload_fraction < 1: a bucket beside the weights
                    continue
                # with a gradient copy (self.grad), each bucket's host copy has its gradient part
                cast(Tensor, b.host.gradient).copy_(grad[b.local.as_slice()], non_blocking=True)
                b.host.grad_copied.record()

    def grad_of(self, b: BucketRecord, grad: Tensor | ShardView) -> Tensor | ShardView:
        h = cast(HostCopy, b.host)  # a bucket of this placement: in host memory
        if self.accelerated:
            h.weights_copied.synchronize()  # the last step's copy of these weights to the device has read them
        if self.grad is None:
            return grad
        if self.accelerated:
            h.grad_copied.synchronize()
        else:
            cast(Tensor, h.gradient).copy_(grad[b.local.as_slice()])  # with self.grad, each bucket's too
        return self.grad

    def publish(self, b: BucketRecord) -> None:
        h = cast(HostCopy, b.host)  # a bucket of this placement: in host memory
        h.device_weights.copy_(h.weights, non_blocking=self.accelerated)
        if self.accelerated:
            h.weights_copied.record()

    def _settle(self) -> None:
        if self.accelerated:
            for b in self.buckets:
                cast(HostCopy, b.host).weights_copied.synchronize()  # this placement's buckets are in host memory

    def pull(self, r: Range) -> None:
        self._settle()
        self.weights[r.as_slice()].copy_(self.device_weights[r.as_slice()])

    def push(self) -> None:
        self._settle()
        self.device_weights.copy_(cast(Tensor, self.weights))  # the host copy


def make_placement(offload: str | None, weight_shard: Tensor | ShardView, *, grad_dtype: torch.dtype | None,
                   buckets: Sequence[BucketRecord], state_bytes: int) -> OnDevice:
    """The placement for ``offload`` (see ``core._config.OFFLOAD_TARGETS``) of one buffer's shard:
    ``grad_dtype`` the averaged gradient's dtype to keep a host copy in (None: none), ``state_bytes``
    the bytes the master and moment strategies will take from it. Local."""
    if offload is None:
        return OnDevice(weight_shard)
    return OnHost(weight_shard, grad_dtype, buckets, state_bytes)
