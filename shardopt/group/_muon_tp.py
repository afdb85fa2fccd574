"""Muon for a matrix split over tensor-parallel ranks (a DTensor parameter with a Shard placement).

[Note: Muon beside tensor parallelism]
Newton-Schulz needs the whole matrix: orthogonalising each tensor-parallel piece on its own is a
different update (the pieces' singular vectors are not the whole's). Each piece is owned whole by
one rank of its data-parallel group, the same data-parallel rank at every tensor-parallel position:
owners are placed by the whole matrices' shapes, also where an uneven split gives the positions
pieces of different sizes (see _muon_packing [Note: owners of tensor-parallel pieces]). That
owner's momentum-averaged update of its piece is gathered
across the tensor-parallel mesh (the DTensor's own all-gather, ``full_tensor``, through
``Comm.gather_tensor_parallel``, which names the call if a peer is lost), every owner
orthogonalises the whole matrix, as ``torch.optim.Muon`` would, and keeps its piece (the split
DTensor's Shard placement makes, ``core._dtensor.shard_extent``: pieces of ``ceil(rows / tp)``,
the last ones short or empty, so 4 rows over 3 ranks are 2, 2 and 0; an owner whose piece is empty
still takes part in the gather). The learning-rate adjustment reads the whole
matrix's shape. Each owner gathers its pieces in layout order, where its matrices keep their given
order (the buckets take them in turn), alike at every tensor-parallel position, so the owners
across the mesh meet the same gathers. Bytes: each owner receives the whole matrix's fp32
update once per step, (tp - 1)/tp of it from the others.
"""
from __future__ import annotations

from typing import Any, Callable, cast

from torch import Tensor

from shardopt.comm._collectives import Comm
from shardopt.core._dtensor import is_shard, shard_extent
from shardopt.kernels.muon_reference import orthogonalize


def sharded_dim(dt: Tensor) -> int | None:
    """The dimension DTensor parameter ``dt`` is split along on its mesh, or None (a copy)."""
    for pl in dt.placements:  # type: ignore[attr-defined]
        if is_shard(pl):
            return int(pl.dim)
    return None


def whole_orthogonalizer(dt: Tensor, comm: Comm) -> Callable[..., Tensor]:
    """``orthogonalize`` for this rank's piece of DTensor parameter ``dt``'s update: gathers the
    pieces across ``dt``'s mesh (``comm.gather_tensor_parallel``: a failure names the optimizer's
    call), orthogonalises the whole, returns this rank's piece (see [Note: Muon beside tensor
    parallelism]). Every rank of the mesh, in the same order."""
    dim = cast(int, sharded_dim(dt))  # only a piece split along a dimension gets here
    mesh = dt.device_mesh  # type: ignore[attr-defined]

    def piece(update: Tensor, **kw: Any) -> Tensor:
        whole = comm.gather_tensor_parallel(update.contiguous(), dt)
        ortho = orthogonalize(whole, **kw)
        return ortho.narrow(dim, *shard_extent(int(dt.shape[dim]), mesh.size(), mesh.get_local_rank()))

    return piece
