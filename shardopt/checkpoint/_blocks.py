"""The blocks a checkpoint stores: DCP key names and the cutting of a rank's flat pieces into N-D
blocks (see _dcp [Note: one DCP tensor per parameter, written as N-D blocks of uneven flat pieces]).

Pure layout, no ``torch.distributed.checkpoint``: importing shardopt does not import DCP (about
1.5 s of CPU per process); ``shardopt.checkpoint`` imports ``_dcp``, which writes and reads these
blocks, when a checkpoint is saved or loaded.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable

from torch import Tensor

from shardopt.core._layout import Range

MODEL = "model."  # weights in the parameter dtype, every state-dict entry of the model
MASTER = "optim.master."  # fp32 master weights, for parameters not stored in fp32
EXP_AVG = "optim.exp_avg."  # fp32
EXP_AVG_SQ = "optim.exp_avg_sq."  # fp32
MAX_EXP_AVG_SQ = "optim.max_exp_avg_sq."  # fp32, amsgrad's running maximum of exp_avg_sq (torch's state key)
MOMENTUM = "optim.momentum_buffer."  # fp32, Muon's one moment (torch.optim.Muon's state key)
# the prefix of a parameter's key in a param group with its own process group: pg<group index>-<place>/
# (see comm._model_parts [Note: param groups with their own data-parallel group]), after its part's
GROUP_PREFIX = re.compile(r"pg(\d+)-(\d+)/")

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) within a tensor of some shape


def boxes(shape: tuple[int, ...], r: Range) -> list[Box]:
    """Rectangular boxes of a row-major tensor of ``shape`` that together hold the elements of the
    flat range ``r``, in order; each box is contiguous in the flattened tensor.

    See [Note: one DCP tensor per parameter, written as N-D blocks of uneven flat pieces]."""
    shape = tuple(shape)
    out: list[Box] = []

    def cut(prefix: tuple[int, ...], dims: tuple[int, ...], lo: int, hi: int) -> None:
        if lo >= hi:
            return
        inner = math.prod(dims[1:])
        head, tail = lo // inner, hi // inner
        if lo % inner:
            stop = min(hi, (head + 1) * inner)
            cut(prefix + (head,), dims[1:], lo - head * inner, stop - head * inner)
            head, lo = head + 1, stop
        if tail > head:
            out.append((prefix + (head,) + (0,) * (len(dims) - 1),
                        (1,) * len(prefix) + (tail - head,) + dims[1:]))
        if hi > max(lo, tail * inner):
            cut(prefix + (tail,), dims[1:], 0, hi - tail * inner)

    if len(shape) == 0:
        return [((), ())] if r.start == 0 and r.end == 1 else []
    cut((), shape, r.start, r.end)
    return out


@dataclass(frozen=True)
class Block:
    """One DCP chunk: a box of the tensor stored under ``key``, and the local tensor it is read
    from (save) or written into (load)."""

    key: str
    shape: tuple[int, ...]  # the whole tensor's shape
    offsets: tuple[int, ...]  # of this block within it
    tensor: Tensor  # ND, the block's sizes; a view into local state (flat piece, shard, or model tensor)


def blocks_of(key: str, shape: Iterable[int], r: Range, piece: Tensor) -> list[Block]:
    """``piece`` (1-D, the elements ``r`` of the flattened tensor ``key``) cut into blocks."""
    shape = tuple(int(s) for s in shape)
    out, cursor = [], 0
    for offsets, sizes in boxes(shape, r):
        n = math.prod(sizes)
        out.append(Block(key, shape, offsets, piece[cursor:cursor + n].view(sizes)))
        cursor += n
    if not cursor == piece.numel() == r.size:
        raise AssertionError(f"the blocks of {key!r} over range {r} cover {cursor} elements of a {piece.numel()}-element "
                             "piece")
    return out


def placed(blocks: list[Block], shape: tuple[int, ...], offsets: tuple[int, ...]) -> list[Block]:
    """``blocks`` of a local piece (a DTensor's local tensor) as blocks of the whole tensor of
    ``shape`` in which that piece starts at ``offsets``."""
    return [Block(b.key, tuple(shape), tuple(o + a for o, a in zip(b.offsets, offsets)), b.tensor) for b in blocks]


def whole(key: str, tensor: Tensor) -> Block:
    """A block that is the whole tensor (non-sharded state)."""
    return Block(key, tuple(tensor.shape), (0,) * tensor.dim(), tensor)
