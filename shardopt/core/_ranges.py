"""The names under which shardopt's work shows in a profile (``torch.profiler``, Kineto/Perfetto
traces): one :func:`torch.profiler.record_function` range per bucket and per stage, as FSDP2
names its stages ``FSDP::...``.

[Note: profiler ranges] Each range costs about 5 microseconds of host time while no profiler runs (this CPU),
so they are put around work of a bucket or a whole call, never around work of one parameter:

- ``shardopt::reduce_launch``: a bucket's gradient collectives issued (stage 2: staged, then the
  reduce-scatter; stage 1: the all-reduce), from the gradient hook that completes it;
- ``shardopt::reduce_land``: waiting for one of a bucket's collectives, and writing what landed;
- ``shardopt::finish_round``: the end of a backward pass: the buckets left launched and every
  reduction waited for;
- ``shardopt::step``: the whole ``step()``; inside it ``shardopt::step_agreement`` (the one
  all-reduce of checks, inf/NaN and norm), ``shardopt::update`` per bucket (the update of its
  part of this rank's shard: the kernels it launches fall under it on a device timeline too) and
  ``shardopt::all_gather`` per bucket (its weight gather issued);
- ``shardopt::gather_wait``: waiting for a bucket's weight gather (at the end of ``step()``, or
  with ``overlap_param_gather=True`` in the forward pre-hook of the module that reads it).

A bucket's range carries ``"<buffer>.<bucket>"`` as its argument. Local: names only, nothing is
communicated.
"""
from __future__ import annotations

from torch.profiler import record_function

from shardopt.core._records import BucketRecord

REDUCE_LAUNCH = "shardopt::reduce_launch"
REDUCE_LAND = "shardopt::reduce_land"
FINISH_ROUND = "shardopt::finish_round"
STEP = "shardopt::step"
STEP_AGREEMENT = "shardopt::step_agreement"
UPDATE = "shardopt::update"
ALL_GATHER = "shardopt::all_gather"
GATHER_WAIT = "shardopt::gather_wait"
NAMES = (REDUCE_LAUNCH, REDUCE_LAND, FINISH_ROUND, STEP, STEP_AGREEMENT, UPDATE, ALL_GATHER, GATHER_WAIT)


def bucket_range(name: str, bucket: BucketRecord | None) -> record_function:
    """The range ``name`` around the work of ``bucket`` (None: of no one bucket)."""
    return record_function(name, None if bucket is None else f"{bucket.buffer}.{bucket.index}")


__all__ = ["NAMES", "bucket_range", "record_function"]
