"""How checkpoint tensors are laid out in ``torch.distributed.checkpoint`` (DCP) storage.

Owns the two planners that write and read exactly the blocks ``_blocks`` cuts (the key names and
the cutting live there, so that importing shardopt does not import DCP). Used with a process group by
``shardopt.checkpoint`` and without one by ``shardopt.checkpoint._convert``.

[Note: one DCP tensor per parameter, written as N-D blocks of uneven flat pieces]
A rank owns a contiguous range of the flat buffer, so of each parameter it owns one contiguous
range of the *flattened* parameter (``param_range``): the whole, nothing, or a middle piece, and
pieces differ in size between ranks. DCP, however, describes a tensor as rectangular chunks of
its N-D shape. We bridge the two with views and no communication of our own:

* A flat range ``[a, b)`` of a row-major tensor splits into at most ``2 * ndim - 1`` rectangular
  boxes, each contiguous in memory: a partial first row (recursively), a run of whole rows, a
  partial last row (recursively). ``boxes`` computes them; each box is a ``view`` of the piece
  (DCP copies one block at a time into a compact tensor as it writes it).
* Every box becomes one DCP chunk of the key ``"model.<fqn>"``, ``"optim.exp_avg.<fqn>"``, ...
  with its true global offsets and the parameter's true shape and dtype. DCP's metadata thus
  records each parameter by its fully qualified name, shape, dtype and chunk offsets, and
  resharding (each wanted block read from the saved chunks it overlaps: :func:`read_items`)
  serves any other split on load: at any world size, bucket size or stage, or with no process
  group at all (the converter).

Alternatives we rejected (torch 2.13):

* A plain local tensor under the same key on every rank is treated as replicated and
  deduplicated: all but one rank's data would be lost.
* A 1-D ``DTensor`` with ``Shard(0)`` per parameter: DCP takes each rank's chunk from DTensor's
  torch.chunk-style even split, not from the local tensor. For a 20-element parameter held as
  pieces of 5 and 15 elements (``from_local`` with ``shape=``), the metadata recorded chunks
  (0, 10) and (10, 10): wrong offsets. Our pieces follow no such rule (a rank may own a middle
  piece of one parameter and none of the next).
* One flat ``DTensor`` per buffer (equal shards): correct, but keys would be buffers, not
  parameter names, and the buffer length changes with the world size (end padding).
* DCP's ``__create_write_items__`` extension: ``find_state_dict_object`` only consults it for
  ``torch.Tensor`` objects, so it would need a tensor subclass. Custom planners
  (``SavePlanner``/``LoadPlanner`` are DCP's documented extension point) need none.

Non-sharded model state (frozen parameters, module buffers) is written whole, by rank 0 only.
"""
from __future__ import annotations

import warnings
from typing import cast

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from shardopt.checkpoint._blocks import Block, Box
from shardopt.checkpoint._files import described, restated


class _BlockSavePlanner(dcp.DefaultSavePlanner):
    """Writes exactly the given blocks; DCP's default global planning then checks that all
    ranks' blocks tile every tensor without overlap."""

    def __init__(self, blocks: list[Block]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._blocks = {(b.key, tuple(b.offsets)): b for b in blocks}
        self._repeated = len(self._blocks) != len(blocks)

    def create_local_plan(self) -> SavePlan:
        if self._repeated:  # raised here, in DCP's local step, DCP raises it on every rank
            raise AssertionError("a rank's checkpoint blocks hold two blocks with the same key and offsets")
        items = []
        for b in self._blocks.values():
            t = b.tensor.detach()
            items.append(WriteItem(
                index=MetadataIndex(b.key, b.offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.tensor.shape)),
                    properties=TensorProperties.create_from_tensor(t), size=torch.Size(b.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Tensor:
        offset = cast(torch.Size, write_item.index.offset)  # a tensor's item has its offset
        return self._blocks[(write_item.index.fqn, tuple(offset))].tensor.detach()

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's global plan, after refusing two ranks that write the same block: DCP would keep one
        of them and drop the other's data (its deduplication of replicated tensors). Each block is
        written by exactly one rank by construction, so two are two different tensors under one
        key (see checkpoint [Note: one checkpoint for every part of the model]). On the coordinator;
        DCP raises it on every rank."""
        first: dict[tuple[str, tuple[int, ...]], int] = {}
        for rank, plan in enumerate(all_plans):
            for item in plan.items:
                where = (item.index.fqn, tuple(item.index.offset or ()))
                other = first.setdefault(where, rank)
                if other != rank:
                    raise ValueError(f"ranks {other} and {rank} both write {where[0]!r} at offsets {list(where[1])}: "
                                     "two different tensors under one name, of which the checkpoint would keep one. "
                                     "Each part of a model split over ranks needs its own keys: pass "
                                     "model_parallel_group= (or DTensor parameters, or a param group's own "
                                     "process_group) so that the optimizer knows which ranks hold which part")
        return super().create_global_plan(all_plans)


def read_items(key: str, saved: list[ChunkStorageMetadata], wanted: list[Box]) -> list[ReadItem]:
    """The reads that fill each wanted box of tensor ``key`` from the saved chunks it overlaps,
    one per overlapping pair (what DCP's own ``create_read_items_for_chunk_list`` computes, written
    here with DCP's public planner types only)."""
    items = []
    for i, (offsets, sizes) in enumerate(wanted):
        for j, chunk in enumerate(saved):
            lo = [max(a, b) for a, b in zip(offsets, chunk.offsets)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, chunk.offsets, chunk.sizes)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue  # no overlap in some dimension (a 0-d tensor always overlaps)
            items.append(ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(key, torch.Size(offsets), i),
                dest_offsets=torch.Size([low - o for low, o in zip(lo, offsets)]),
                storage_index=MetadataIndex(key, chunk.offsets, j),
                storage_offsets=torch.Size([low - o for low, o in zip(lo, chunk.offsets)]),
                lengths=torch.Size([h - low for low, h in zip(lo, hi)])))
    return items


class _BlockLoadPlanner(dcp.DefaultLoadPlanner):
    """Reads the given blocks, each from whichever saved chunks overlap it."""

    def __init__(self, blocks: list[Block]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._by_key: dict[str, list[Block]] = {}
        for b in blocks:
            self._by_key.setdefault(b.key, []).append(b)

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise AssertionError("DCP asked for the load plan before it read the checkpoint's metadata")
        requests: list[ReadItem] = []
        for key, blocks in self._by_key.items():
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"checkpoint has no tensor {key!r}")
            requests += read_items(key, md.chunks, [(b.offsets, tuple(b.tensor.shape)) for b in blocks])
        return LoadPlan(requests)

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        block = self._by_key[read_item.dest_index.fqn][cast(int, read_item.dest_index.index)]  # set by read_items
        t = block.tensor.detach()
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, offset, length)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        pass  # resolve_tensor returned a view of the destination: nothing left to do


class CollectiveFailed(RuntimeError):
    """One of DCP's own collectives (the exchange of plans and metadata between the ranks) failed
    on this rank: ``cause`` is torch's error (a peer's connection closed, or the wait timed out),
    which the caller, knowing its call and its ranks, restates (``Comm.collective_failed``). DCP
    gathers what a rank raises in its own steps into a ``CheckpointException``; what is left is
    the collectives themselves."""

    def __init__(self, cause: RuntimeError) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _reraise(what: str, path: str, e: BaseException) -> None:
    """Raise DCP's ``CheckpointException`` ``e`` (the same on every rank: every failing rank's
    exception) as one error that names each failing rank, of the class ``_files.restated`` gives the
    first OSError among them (an EIO, a full disk: a caller's ``except OSError`` sees one on every
    rank, with its errno), else the first failing rank's. The same on every rank."""
    failures = getattr(e, "failures", None) or {}  # rank -> (exception, traceback frames)
    errors = {r: x[0] if isinstance(x, tuple) else x for r, x in failures.items()}
    detail = "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in sorted(errors.items())) or str(e)
    message = f"{what} {path} failed: {detail}"
    if not errors:
        raise RuntimeError(message) from e
    first = next((r for r in sorted(errors) if isinstance(errors[r], OSError)), min(errors))
    raise restated(described(errors[first]), message) from e


def write_blocks(path: str, blocks: list[Block], group: object) -> None:
    """Write this rank's blocks into the directory ``path``; every rank of ``group`` calls it, in
    parallel, each writing its own file. Rank 0 of the group also writes DCP's ``.metadata``."""
    writer = dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True)
    try:
        dcp.save({}, storage_writer=writer, planner=_BlockSavePlanner(blocks), process_group=group)
    except dcp.CheckpointException as e:  # a BaseException: raised on every rank when any rank failed
        _reraise("writing checkpoint", path, e)
    except torch.OutOfMemoryError:  # this rank's own, outside DCP's steps: not a collective of DCP's
        raise
    except RuntimeError as e:  # torch's own, from a collective of DCP's: see CollectiveFailed
        raise CollectiveFailed(e) from e


def read_blocks(path: str, blocks: list[Block], group: object = None, *, no_dist: bool = False) -> None:
    """Fill every block's tensor from the checkpoint at ``path`` (casting to the block's dtype).
    Every rank of ``group`` calls it, or one process alone with ``no_dist=True``."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")  # no_dist is what we asked for
            dcp.load({}, storage_reader=dcp.FileSystemReader(path), planner=_BlockLoadPlanner(blocks),
                     process_group=group, no_dist=no_dist)
    except dcp.CheckpointException as e:
        _reraise("reading checkpoint", path, e)
    except torch.OutOfMemoryError:  # see write_blocks
        raise
    except RuntimeError as e:  # torch's own, from a collective of DCP's: see CollectiveFailed
        if no_dist:
            raise
        raise CollectiveFailed(e) from e


def read_metadata(path: str) -> Metadata:
    """DCP's index of the checkpoint at ``path``: each key's shape, dtype and chunks. Local."""
    return dcp.FileSystemReader(path).read_metadata()
