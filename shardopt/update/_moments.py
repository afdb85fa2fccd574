"""Moment strategies: how this rank stores the two Adam moments of its shard.

Beside the master-weight strategies (``shardopt.update._master``): each wraps this rank's ``exp_avg`` and
``exp_avg_sq`` behind one interface. ``operands`` gives the kernels what they read and write over
a local range (a tensor, or a (codes, scales) pair), ``fp32`` decodes them, ``load_`` encodes
them from fp32 (a checkpoint always holds the decoded fp32 moments, so it loads into any mode).
Bytes per element, sharded, both moments together:

``fp32``  8     two fp32 tensors (``torch.optim.AdamW``'s state)
``bf16``  4     two bf16 tensors; ``exp_avg`` rounded to nearest, ``exp_avg_sq`` stochastically
                (see kernels.reference [Note: 16-bit moments])
``8bit``  2.125 one byte per element per moment plus one fp32 scale per block of 64 elements per
                moment; blocks in the flat buffer's global coordinates, never across two parameters
                (see kernels.reference [Note: 8-bit moments])

Every mode is elementwise or block-wise in global coordinates, with random bits keyed by the
global element offset, so the moments (and the weights) do not depend on the number of ranks.
"""
from __future__ import annotations

import abc
from typing import Callable

import torch
from torch import Tensor

from shardopt.core._config import MOMENT_FORMATS
from shardopt.core._layout import Range
from shardopt.kernels import Kernels
from shardopt.kernels.reference import MOMENT_BLOCK, Scalars, decode_moment8, encode_moment8

Moment = Tensor | tuple  # a moment's kernel operand: a tensor (fp32, bf16) or 8-bit (codes, scales, new maxima)


class Moments(abc.ABC):
    """Base: this rank's two Adam moments over ``numel`` elements of its shard."""

    name = ""
    alignment = 1  # elements: parameters and shard boundaries are aligned to it in the flat buffer

    def __init__(self, numel: int, device: torch.device,
                 empty: Callable[[int, torch.dtype], Tensor] | None = None, amsgrad: bool = False) -> None:
        self.numel, self.device = numel, device
        # how the moments are allocated: (elements, dtype) -> 1D tensor (offloaded: in host memory, update._offload)
        self.empty = empty or (lambda n, dtype: torch.empty(n, dtype=dtype, device=device))
        self.amsgrad = amsgrad  # a third tensor: the running maximum of exp_avg_sq (max_exp_avg_sq)
        if amsgrad and not self.keeps_max:
            raise ValueError(f"amsgrad=True needs the running maximum of exp_avg_sq, which moments={self.name!r} "
                             "cannot store; use moments='fp32' or 'bf16'")

    keeps_max = False  # a format that can hold amsgrad's max_exp_avg_sq

    def zeros(self, numel: int, dtype: torch.dtype) -> Tensor:
        return self.empty(numel, dtype).zero_()

    @abc.abstractmethod
    def operands(self, r: Range) -> tuple[Moment, Moment]:
        """(exp_avg, exp_avg_sq) operands of the step kernels over local range ``r``."""

    def prepare(self, r: Range, grad: Tensor, s: Scalars, kernels: Kernels) -> tuple[Moment, Moment]:
        """The operands of this step over local range ``r`` (``grad``: its slice of the gradient
        shard), after any pass the step needs first. Local."""
        return self.operands(r)

    @abc.abstractmethod
    def fp32(self) -> tuple[Tensor, ...]:
        """(exp_avg, exp_avg_sq) of the whole shard as fp32, and with amsgrad max_exp_avg_sq third:
        the stored tensors for ``fp32`` (writes go through), decoded copies otherwise."""

    @abc.abstractmethod
    def load_(self, exp_avg: Tensor, exp_avg_sq: Tensor, max_exp_avg_sq: Tensor | None = None) -> None:
        """Store fp32 moments of the whole shard (1-D, ``numel`` elements); ``max_exp_avg_sq``:
        amsgrad's, where the source has one."""

    @abc.abstractmethod
    def tensors(self) -> dict[str, Tensor]:
        """The stored tensors by name (for this rank's own state dict, restored bit for bit)."""

    def max_operand(self, r: Range) -> Tensor | None:
        """amsgrad's running maximum of ``exp_avg_sq`` over local range ``r`` (the step's ``vmax``
        operand), or None without amsgrad."""
        return None

    def state_piece(self, r: Range) -> dict[str, Tensor]:
        """torch.optim.AdamW's state tensors over local range ``r`` (one parameter's piece), 1-D
        fp32: views of the stored tensors for ``fp32`` (writes go through), decoded copies
        otherwise. A question. Local."""
        m, v = self.fp32_range(r)
        out = {"exp_avg": m, "exp_avg_sq": v}
        vmax = self.max_operand(r)
        if vmax is not None:
            out["max_exp_avg_sq"] = vmax.float()
        return out

    def fp32_range(self, r: Range) -> tuple[Tensor, Tensor]:
        """(exp_avg, exp_avg_sq) over local range ``r`` as fp32 (see ``state_piece``)."""
        m, v = self.operands(r)
        return m.float(), v.float()  # type: ignore[union-attr]

    live = False  # state_piece gives views of the stored tensors (writes go through), not decoded copies

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The keys of ``state_piece``, in its order."""
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.max_operand(Range(0, 0)) is not None else ())

    def write_piece(self, r: Range, key: str, value: Tensor) -> None:
        """Store ``value`` (1-D, ``r.size`` elements, any float dtype and device) as the state
        tensor ``key`` (one of ``state_keys``) over local range ``r``, rounded to nearest as a
        loaded checkpoint is: what a write into ``opt.state[p]`` becomes. Local."""
        self.tensors()[key][r.as_slice()].copy_(value.reshape(-1))

    def load_tensors(self, tensors: dict[str, Tensor]) -> None:
        """Restore ``tensors()`` output bit for bit (this rank's own state dict). Local."""
        for k, t in self.tensors().items():
            t.copy_(tensors[k])

    @property
    def exp_avg_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for k, t in self.tensors().items() if not _second(k))

    @property
    def exp_avg_sq_bytes(self) -> int:
        """The second moment's bytes, amsgrad's running maximum of it included."""
        return sum(t.numel() * t.element_size() for k, t in self.tensors().items() if _second(k))


def _second(key: str) -> bool:
    """A stored tensor of the second moment (or of amsgrad's maximum of it)."""
    return key.startswith(("exp_avg_sq", "max_exp_avg_sq"))


class _Dense(Moments):
    dtype = torch.float32
    keeps_max = True

    def __init__(self, numel: int, device: torch.device, empty: Callable | None = None, amsgrad: bool = False) -> None:
        super().__init__(numel, device, empty, amsgrad)
        self.exp_avg = self.zeros(numel, self.dtype)  # 1D, this rank's shard
        self.exp_avg_sq = self.zeros(numel, self.dtype)
        # 1D, this rank's shard: amsgrad's running maximum of exp_avg_sq (bf16: rounded to nearest)
        self.max_exp_avg_sq = self.zeros(numel, self.dtype) if amsgrad else None

    def operands(self, r: Range) -> tuple[Moment, Moment]:
        return self.exp_avg[r.as_slice()], self.exp_avg_sq[r.as_slice()]

    def max_operand(self, r: Range) -> Tensor | None:
        return None if self.max_exp_avg_sq is None else self.max_exp_avg_sq[r.as_slice()]

    def fp32(self) -> tuple[Tensor, ...]:
        if self.max_exp_avg_sq is not None:
            return self.exp_avg.float(), self.exp_avg_sq.float(), self.max_exp_avg_sq.float()
        return self.exp_avg.float(), self.exp_avg_sq.float()

    def load_(self, exp_avg: Tensor, exp_avg_sq: Tensor, max_exp_avg_sq: Tensor | None = None) -> None:
        self.exp_avg.copy_(exp_avg)  # nearest: a checkpoint's moments, not a running sum
        self.exp_avg_sq.copy_(exp_avg_sq)
        if self.max_exp_avg_sq is not None:  # a checkpoint without one: the maximum starts at exp_avg_sq
            self.max_exp_avg_sq.copy_(exp_avg_sq if max_exp_avg_sq is None else max_exp_avg_sq)

    def tensors(self) -> dict[str, Tensor]:
        out = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.max_exp_avg_sq is not None:
            out["max_exp_avg_sq"] = self.max_exp_avg_sq
        return out


class FP32Moments(_Dense):
    name = "fp32"
    live = True


class BF16Moments(_Dense):
    name = "bf16"
    dtype = torch.bfloat16


class Int8Moments(Moments):
    name = "8bit"
    alignment = MOMENT_BLOCK

    def __init__(self, numel: int, device: torch.device, empty: Callable | None = None, amsgrad: bool = False) -> None:
        super().__init__(numel, device, empty, amsgrad)
        if numel % MOMENT_BLOCK:
            raise ValueError(f"an 8-bit moment shard must be a whole number of {MOMENT_BLOCK}-element blocks, "
                             f"got {numel} elements")
        blocks = numel // MOMENT_BLOCK
        self.m_codes = self.zeros(numel, torch.int8)  # exp_avg / scale * 127
        self.m_scales = self.zeros(blocks, torch.float32)  # per block: max |exp_avg|
        self.v_codes = self.zeros(numel, torch.uint8)  # sqrt(exp_avg_sq) / scale * 255
        self.v_scales = self.zeros(blocks, torch.float32)  # per block: max sqrt(exp_avg_sq)

    def operands(self, r: Range) -> tuple[tuple, tuple]:
        if r.start % MOMENT_BLOCK or r.size % MOMENT_BLOCK:
            raise ValueError(f"8-bit moments update whole {MOMENT_BLOCK}-element blocks, got range {r}")
        s, b = r.as_slice(), slice(r.start // MOMENT_BLOCK, r.end // MOMENT_BLOCK)
        return (self.m_codes[s], self.m_scales[b]), (self.v_codes[s], self.v_scales[b])

    def prepare(self, r: Range, grad: Tensor, s: Scalars, kernels: Kernels) -> tuple[Moment, Moment]:
        # Two passes (see kernels.reference.moment8_scan): the new blocks' maxima, then the step.
        m, v = self.operands(r)
        m_max, v_max = kernels.moment8_scan(grad, m, v, s)
        return (*m, m_max), (*v, v_max)

    def fp32(self) -> tuple[Tensor, Tensor]:
        m, v = decode_moment8(self.m_codes, self.m_scales, self.v_codes, self.v_scales)
        return m, v

    def fp32_range(self, r: Range) -> tuple[Tensor, Tensor]:
        # the whole blocks around r (a parameter starts a block; its last block may hold padding)
        start, end = r.start - r.start % MOMENT_BLOCK, -(-r.end // MOMENT_BLOCK) * MOMENT_BLOCK
        blocks = slice(start // MOMENT_BLOCK, end // MOMENT_BLOCK)
        m, v = decode_moment8(self.m_codes[start:end], self.m_scales[blocks], self.v_codes[start:end],
                              self.v_scales[blocks])
        cut = slice(r.start - start, r.end - start)
        return m[cut], v[cut]

    def write_piece(self, r: Range, key: str, value: Tensor) -> None:
        # the whole blocks around r decoded, r's part of moment ``key`` replaced, that moment's
        # blocks encoded again (to nearest); the other moment's codes stay as they are
        start, end = r.start - r.start % MOMENT_BLOCK, -(-r.end // MOMENT_BLOCK) * MOMENT_BLOCK
        blocks = slice(start // MOMENT_BLOCK, end // MOMENT_BLOCK)
        m, v = decode_moment8(self.m_codes[start:end], self.m_scales[blocks], self.v_codes[start:end],
                              self.v_scales[blocks])
        (m if key == "exp_avg" else v)[r.start - start:r.end - start] = value.reshape(-1).to(m.device, torch.float32)
        (mq, ms), (vq, vs) = encode_moment8(m, v, None)
        codes, scales, new = (self.m_codes, self.m_scales, (mq, ms)) if key == "exp_avg" else \
            (self.v_codes, self.v_scales, (vq, vs))
        codes[start:end].copy_(new[0])
        scales[blocks].copy_(new[1])

    def load_(self, exp_avg: Tensor, exp_avg_sq: Tensor, max_exp_avg_sq: Tensor | None = None) -> None:
        (mq, ms), (vq, vs) = encode_moment8(exp_avg.float(), exp_avg_sq.float(), None)
        self.m_codes.copy_(mq)
        self.m_scales.copy_(ms)
        self.v_codes.copy_(vq)
        self.v_scales.copy_(vs)

    def tensors(self) -> dict[str, Tensor]:
        return {"exp_avg_codes": self.m_codes, "exp_avg_scales": self.m_scales,
                "exp_avg_sq_codes": self.v_codes, "exp_avg_sq_scales": self.v_scales}


class MuonMomentum(Moments):
    """Muon's one moment, the ``momentum_buffer`` of the matrices this rank owns (padding stays
    zero): fp32, 4 bytes per owned element, or with ``moments="bf16"`` bf16, 2 bytes, rounded to
    nearest after each step as bf16 ``exp_avg`` is (elementwise, so independent of the number of
    ranks). It fills the interface's first moment; the second is empty."""

    def __init__(self, numel: int, device: torch.device, name: str = "fp32", empty: Callable | None = None) -> None:
        super().__init__(numel, device, empty)
        self.name = name  # one of MUON_MOMENTS, checked by ShardedMuon
        self.buffer = self.zeros(numel, MUON_MOMENTS[name])  # 1D, this rank's shard

    # ignored: Muon keeps one moment, so there is no second operand; no AdamW step reads these
    def operands(self, r: Range) -> tuple[Tensor, None]:  # type: ignore[override]
        return self.buffer[r.as_slice()], None

    def read(self, r: Range) -> Tensor:
        """The momentum over local range ``r`` as fp32: the stored tensor itself in fp32 (writes go
        through), a decoded copy in bf16, to be stored back with ``write_``. Local."""
        return self.buffer[r.as_slice()].float()

    def write_(self, r: Range, value: Tensor) -> None:
        """Store ``read(r)``'s tensor after the step changed it (bf16: rounded to nearest). Local."""
        stored = self.buffer[r.as_slice()]
        if value.data_ptr() != stored.data_ptr():
            stored.copy_(value.reshape(-1))

    def fp32(self) -> tuple[Tensor, Tensor]:
        return self.buffer.float(), self.buffer.new_zeros(0, dtype=torch.float32)

    def state_piece(self, r: Range) -> dict[str, Tensor]:
        """torch.optim.Muon's state over local range ``r``: its ``momentum_buffer`` (1-D fp32)."""
        return {"momentum_buffer": self.read(r)}

    @property
    def live(self) -> bool:  # type: ignore[override]
        return self.buffer.dtype == torch.float32  # read() gives the stored tensor itself

    @property
    def state_keys(self) -> tuple[str, ...]:
        return ("momentum_buffer",)

    def write_piece(self, r: Range, key: str, value: Tensor) -> None:
        self.buffer[r.as_slice()].copy_(value.reshape(-1))

    def load_(self, exp_avg: Tensor, exp_avg_sq: Tensor, max_exp_avg_sq: Tensor | None = None) -> None:
        self.buffer.copy_(exp_avg)

    def tensors(self) -> dict[str, Tensor]:
        return {"momentum_buffer": self.buffer}


MUON_MOMENTS = {"fp32": torch.float32, "bf16": torch.bfloat16}  # how Muon's momentum can be stored
MOMENTS: dict[str, type[Moments]] = {"fp32": FP32Moments, "bf16": BF16Moments, "8bit": Int8Moments}
if tuple(MOMENTS) != MOMENT_FORMATS:  # checked at import, also under python -O
    raise AssertionError(f"one moments strategy per format core._config accepts: {tuple(MOMENTS)} against "
                         f"{MOMENT_FORMATS}")


def make_moments(name: str, numel: int, device: torch.device, empty: Callable | None = None,
                 amsgrad: bool = False) -> Moments:
    """The strategy called ``name`` over ``numel`` shard elements, allocated by ``empty`` (elements,
    dtype) when given; ``amsgrad``: with the running maximum of exp_avg_sq."""
    if name not in MOMENTS:
        raise ValueError(f"unknown moments={name!r}; choose one of {sorted(MOMENTS)}")
    return MOMENTS[name](numel, device, empty, amsgrad)


def moment_alignment(name: str) -> int:
    """Elements the flat-buffer layout must align parameters and shard boundaries to for ``name``."""
    return MOMENTS[name].alignment if name in MOMENTS else 1
