"""Small models split over ranks as tensor, pipeline and expert parallelism split them, each with
the whole model it is cut from: the reference a single process trains with torch.optim on the
global batch. Importable in spawned ranks; the collectives between parts are torch.distributed's
own, written out as Megatron-LM writes them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

D, H = 8, 12  # model width, hidden width (split over 2 tensor-parallel ranks: 6 each)


def batch(dp_rank: int, step: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one data-parallel rank at one step."""
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


def global_batch(dp_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(batch(r, step) for r in range(dp_size)))
    return torch.cat(xs), torch.cat(ys)


class Whole(nn.Module):
    """LayerNorm -> Linear(D, H) -> tanh -> Linear(H, D), mean squared error."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.norm = nn.LayerNorm(D)
        with torch.no_grad():
            self.norm.weight.add_(0.1 * torch.randn(D))
            self.norm.bias.add_(0.1 * torch.randn(D))
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)
        self.to(dtype)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc1(self.norm(x.to(self.norm.weight.dtype))))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.fc2(self.hidden(x)).float() - y) ** 2).mean()


class _Copy(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient across the tensor-parallel group backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _Reduce(torch.autograd.Function):
    """Megatron's g: all-reduce forward across the tensor-parallel group, identity backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g, None


class MegatronTP(nn.Module):
    """``Whole`` with fc1 split by rows (column parallel) and fc2 by columns (row parallel) over
    ``group``, as plain tensors holding the local shards; the LayerNorm and fc2's bias replicated."""

    def __init__(self, whole: Whole, group, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.group, rows = group, slice(tp_rank * H // tp_size, (tp_rank + 1) * H // tp_size)
        self.rows = rows
        self.norm = nn.LayerNorm(D).to(whole.fc1.weight.dtype)
        self.norm.load_state_dict(whole.norm.state_dict())
        self.w1 = nn.Parameter(whole.fc1.weight.detach()[rows].clone())
        self.b1 = nn.Parameter(whole.fc1.bias.detach()[rows].clone())
        self.w2 = nn.Parameter(whole.fc2.weight.detach()[:, rows].clone())
        self.b2 = nn.Parameter(whole.fc2.bias.detach().clone())

    def sharded(self) -> list[nn.Parameter]:
        return [self.w1, self.b1, self.w2]

    def replicated(self) -> list[nn.Parameter]:
        return [self.norm.weight, self.norm.bias, self.b2]

    def whole_pieces(self) -> dict[str, tuple[str, tuple]]:
        """For each of this part's parameter names: the name of the ``Whole`` parameter it is a
        piece of, and the index of that piece."""
        every = (slice(None),)
        return {"w1": ("fc1.weight", (self.rows,)), "b1": ("fc1.bias", (self.rows,)),
                "w2": ("fc2.weight", (slice(None), self.rows)), "b2": ("fc2.bias", every),
                "norm.weight": ("norm.weight", every), "norm.bias": ("norm.bias", every)}

    def pieces_of(self, whole: Whole) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(this rank's parameter, the same piece of ``whole``) pairs."""
        theirs = dict(whole.named_parameters())
        return [(p, theirs[self.whole_pieces()[n][0]][self.whole_pieces()[n][1]]) for n, p in self.named_parameters()]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.to(self.w1.dtype)
        h = torch.tanh(nn.functional.linear(_Copy.apply(self.norm(x), self.group), self.w1, self.b1))
        out = _Reduce.apply(nn.functional.linear(h, self.w2), self.group) + self.b2
        return ((out.float() - y) ** 2).mean()


class Stage(nn.Module):
    """One of two pipeline stages of ``Whole``: stage 0 is norm, fc1 and tanh; stage 1 is fc2 and the loss."""

    def __init__(self, whole: Whole, stage: int) -> None:
        super().__init__()
        self.stage = stage
        if stage == 0:
            self.norm, self.fc1 = nn.LayerNorm(D), nn.Linear(D, H)
            self.norm.load_state_dict(whole.norm.state_dict())
            self.fc1.load_state_dict(whole.fc1.state_dict())
        else:
            self.fc2 = nn.Linear(H, D)
            self.fc2.load_state_dict(whole.fc2.state_dict())

    def pieces_of(self, whole: Whole) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mine = dict(self.named_parameters())
        theirs = dict(whole.named_parameters())
        return [(p, theirs[n]) for n, p in mine.items()]


def pipeline_step(stage: Stage, x: torch.Tensor, y: torch.Tensor, peer: int, opt=None,
                  how: str = "tensor") -> torch.Tensor | None:
    """One forward and backward of a 2-stage pipeline: stage 0 sends its activation to ``peer``
    (global rank) and runs backward from the gradient it gets back. Returns the loss on stage 1.
    Without ``opt`` both stages call ``Tensor.backward``. With it (a ShardedAdamW), stage 1 runs
    ``opt.backward(loss)`` and stage 0 ``act.backward(g)`` (``how="tensor"``) or
    ``opt.backward(act, gradient=g)`` (``"opt"``); ``"plain"``: both stages ``Tensor.backward``."""
    dtype = next(stage.parameters()).dtype
    if stage.stage == 0:
        act = torch.tanh(stage.fc1(stage.norm(x.to(dtype))))
        dist.send(act.detach().contiguous(), peer)
        g = torch.empty_like(act)
        dist.recv(g, peer)
        if opt is not None and how == "opt":
            opt.backward(act, gradient=g)
        else:
            act.backward(g)
        return None
    act = torch.empty(x.shape[0], H, dtype=dtype)
    dist.recv(act, peer)
    act.requires_grad_(True)
    loss = ((stage.fc2(act).float() - y) ** 2).mean()
    if opt is not None and how != "plain":
        opt.backward(loss)
    else:
        loss.backward()
    dist.send(act.grad.contiguous(), peer)
    return loss.detach()


def reference(steps: int, dp_size: int, *, clip: float | None, lr: float = 1e-2, weight_decay: float = 0.1,
              seed: int = 0, init_dtype: torch.dtype = torch.float32) -> tuple[Whole, list[float]]:
    """``Whole`` trained in fp32 by torch.optim.AdamW on the global batch of ``dp_size`` ranks,
    clipped by torch.nn.utils.clip_grad_norm_; (the model, the norm at each step). ``init_dtype``:
    the initial weights rounded to it, as a model built in that dtype starts."""
    whole, _, norms = reference_with_optimizer(steps, dp_size, clip=clip, lr=lr, weight_decay=weight_decay, seed=seed,
                                               init_dtype=init_dtype)
    return whole, norms


def reference_with_optimizer(steps: int, dp_size: int, *, clip: float | None, lr: float = 1e-2,
                             weight_decay: float = 0.1, seed: int = 0, init_dtype: torch.dtype = torch.float32
                             ) -> tuple[Whole, torch.optim.AdamW, list[float]]:
    """``reference``, with the torch.optim.AdamW that trained it (its moments)."""
    whole = Whole(seed, init_dtype).float()
    opt = torch.optim.AdamW(whole.parameters(), lr=lr, weight_decay=weight_decay)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        whole(*global_batch(dp_size, step)).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(whole.parameters(), clip)))
        opt.step()
    return whole, opt, norms


class Experts(nn.Module):
    """A dense layer on every rank, then one of ``n`` experts (ranks route their tokens to the
    expert they hold); ``expert`` None: the whole model with every expert, as a reference."""

    def __init__(self, n: int = 2, expert: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(D, D)
        experts = []
        for e in range(n):
            torch.manual_seed(10 + e)
            experts.append(nn.Linear(D, D))
        self.experts = nn.ModuleList(experts if expert is None else [experts[expert]])

    def forward(self, x: torch.Tensor, y: torch.Tensor, expert: int = 0) -> torch.Tensor:
        return ((self.experts[expert](torch.tanh(self.dense(x))) - y) ** 2).mean()


def expert_reference(steps: int, ranks: int, experts: int, *, clip: float, lr: float = 1e-2,
                     weight_decay: float = 0.1) -> tuple[Experts, list[float]]:
    """Every expert in one process, the loss the mean over ``ranks`` ranks of each rank's loss on
    its batch through its expert (rank r holds expert r * experts // ranks); torch.optim.AdamW."""
    model, _, norms = expert_reference_with_optimizer(steps, ranks, experts, clip=clip, lr=lr,
                                                      weight_decay=weight_decay)
    return model, norms


def expert_reference_with_optimizer(steps: int, ranks: int, experts: int, *, clip: float, lr: float = 1e-2,
                                    weight_decay: float = 0.1) -> tuple[Experts, torch.optim.AdamW, list[float]]:
    """``expert_reference``, with the torch.optim.AdamW that trained it (its moments), over the
    dense parameters and then every expert's, in one param group each."""
    model = Experts(experts)
    opt = torch.optim.AdamW([{"params": model.dense.parameters()}, {"params": model.experts.parameters()}],
                            lr=lr, weight_decay=weight_decay)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        loss = sum(model(*batch(r, step), expert=r * experts // ranks) for r in range(ranks)) / ranks
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return model, opt, norms


class Uneven(nn.Module):
    """LayerNorm -> Linear(D, 15) -> tanh -> Linear(15, D) -> tanh -> Linear(D, D), mean squared
    error: a hidden width that two tensor-parallel ranks split 8 / 7 (``torch.chunk``, as DTensor's
    Shard), and a last matrix left whole (a copy on every tensor-parallel rank)."""

    HIDDEN = 15

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, self.HIDDEN)
        self.fc2 = nn.Linear(self.HIDDEN, D)
        self.mix = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.mix(torch.tanh(self.fc2(torch.tanh(self.fc1(self.norm(x)))))) - y) ** 2).mean()


class Gated(Whole):
    """``Whole`` whose hidden units are scaled by ``gate``: beside fc1 split by rows and fc2 by
    columns over tensor-parallel ranks, the gates of this rank's hidden units (H / tp of them), a
    plain tensor or a DTensor whose local piece they are (read through ``to_local``). Each rank
    gates its own units, so the model's output, and every rank's loss, is one."""

    def __init__(self, gate: torch.Tensor, seed: int = 0) -> None:
        super().__init__(seed)
        self.gate = nn.Parameter(gate)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        gate = self.gate.to_local() if hasattr(self.gate, "to_local") else self.gate
        return ((self.fc2(self.hidden(x) * gate) - y) ** 2).mean()
