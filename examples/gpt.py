"""A small GPT (decoder-only transformer) for the examples and benchmarks.

Weights may be stored in 16 bits while the arithmetic runs in ``compute_dtype``: on CPUs without
16-bit matrix hardware, bf16 weights with fp32 compute keep the optimizer's mixed-precision path
while the matmuls stay fast. The LM head is tied to the token embedding (one shared parameter).

``tensor_parallel(model, mesh["tp"])`` splits each block Megatron-style over a tensor-parallel mesh
(``tp_plan`` names the modules): the attention's fused qkv and the MLP's up-projection by output
features, the attention output and the MLP's down-projection by input features; the embeddings,
LayerNorms and the head stay plain, replicated tensors. Each rank then runs its whole heads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    compute_dtype: torch.dtype = torch.float32
    # Round activations (and so their gradients) to this dtype between blocks: emulates a 16-bit
    # model's stored activations while the matmuls accumulate in compute_dtype.
    activation_dtype: torch.dtype | None = None


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), b)


class Embedding(nn.Embedding):
    def __init__(self, num: int, dim: int, compute_dtype: torch.dtype) -> None:
        super().__init__(num, dim)
        self.compute_dtype = compute_dtype

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight.to(self.compute_dtype))


class LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.ln1, self.ln2 = LayerNorm(c.n_embd), LayerNorm(c.n_embd)
        self.qkv, self.proj = Linear(c.n_embd, 3 * c.n_embd), Linear(c.n_embd, c.n_embd)
        self.fc, self.out = Linear(c.n_embd, 4 * c.n_embd), Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # qkv's output features are grouped by head, [q; k; v] of head 0, then of head 1, ..., so that
        # a split of its rows over tensor-parallel ranks gives each rank whole heads (see
        # tensor_parallel); the number of heads here is read from the output, not from the config.
        hd = C // self.n_head
        q, k, v = self.qkv(self.ln1(x)).view(B, T, -1, 3, hd).unbind(dim=3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.wte = Embedding(c.vocab_size, c.n_embd, c.compute_dtype)
        self.wpe = Embedding(c.block_size, c.n_embd, c.compute_dtype)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = LayerNorm(c.n_embd)
        self.head = Linear(c.n_embd, c.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "out.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * c.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        cd = self.config.compute_dtype
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # through the modules, so their forward hooks see the weights
        ad = self.config.activation_dtype
        for block in self.blocks:
            x = block(x if ad is None else x.to(ad).to(cd))
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on matrices and embeddings, none on biases and norms (as in GPT-2 recipes)."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        rest = [p for p in self.parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def tp_plan(model: GPT) -> dict:
    """``parallelize_module``'s plan for Megatron-style tensor parallelism of ``model``'s blocks:
    qkv and fc split by output features (``ColwiseParallel``), proj and out by input features
    (``RowwiseParallel``, their outputs summed over the tensor-parallel ranks). Apply it with
    ``tensor_parallel``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.qkv": ColwiseParallel(), f"blocks.{i}.proj": RowwiseParallel(),
                     f"blocks.{i}.fc": ColwiseParallel(), f"blocks.{i}.out": RowwiseParallel()})
    return plan


def tensor_parallel(model: GPT, tp_mesh) -> GPT:
    """Split ``model``'s blocks over the 1-D device mesh ``tp_mesh`` (in place; call it on every rank
    of the mesh with the same model). The split matrices become DTensors, the rest stays plain.

    ``ColwiseParallel`` gives rank r the r-th contiguous block of qkv's output rows; since the rows
    are grouped by head (see ``Block.forward``), that block is [q; k; v] of whole heads, and the
    DTensor's whole tensor is the plain model's at every tensor-parallel size (a checkpoint moves
    between sizes)."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp, c = tp_mesh.size(), model.config
    if c.n_head % tp:
        raise ValueError(f"tensor parallelism splits whole heads: n_head={c.n_head} is not a multiple of tp={tp}")
    return parallelize_module(model, tp_mesh, tp_plan(model))


def muon_param_groups(model: nn.Module, weight_decay: float, adamw_lr: float) -> list[dict]:
    """Muon for the blocks' matrices; AdamW (``"use_muon": False``) for the embeddings, norms and
    biases, as in modded-nanogpt and nanochat."""
    hidden = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": hidden, "weight_decay": weight_decay},
            {"params": rest, "use_muon": False, "lr": adamw_lr, "betas": (0.9, 0.95), "weight_decay": 0.0}]


def load_bytes(path: str | None, limit: int = 8 << 20) -> torch.Tensor:
    """A byte-level corpus: the file or directory at ``path``, or by default the Python standard
    library's own ``.py`` sources (present on every Python installation). At most ``limit`` bytes."""
    import os

    root = path or os.path.dirname(os.__file__)
    files = [root] if os.path.isfile(root) else sorted(
        os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
        if path or (f.endswith(".py") and "site-packages" not in d))
    chunks, total = [], 0
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read(limit - total)
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if total < 1024:
        raise ValueError(f"corpus at {root!r} has only {total} bytes; give --data a larger text file or folder")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()
