"""DTensor parameters (``torch.distributed.tensor``, as ``parallelize_module`` makes them).

[Note: DTensor parameters]
A DTensor parameter's values on this rank are its *local tensor*, a plain tensor; the optimizer
shards and updates local tensors over its data-parallel ranks exactly as it does plain
parameters. Each DTensor parameter gets a *stand-in*: a plain ``nn.Parameter`` that the records,
the flat buffer, the flat group and the update see in its place (``ParamRecord.param``). Once the
stand-in is a view of the flat buffer, the DTensor parameter is made to hold that same memory as its
local tensor (``rewrap``; the model keeps the very same parameter object, a DTensor with its mesh,
placements, shape and stride, its gradient hooks and its gradient accumulator): the forward pass
reads the flat buffer, the weight all-gather after a step writes it. Autograd accumulates the gradient into the DTensor parameter's ``.grad``; the
optimizer's hook on the DTensor parameter (``ParamRecord.leaf``) moves its local tensor into the
stand-in's ``.grad`` as autograd would have accumulated it there (``move_grad``), and the rest of
the gradient's life is a plain parameter's. So a DTensor parameter's ``.grad`` is None after
backward: the optimizer holds it (in stage 2 as shards), as it holds a plain parameter's in
stage 2; clip with ``opt.clip_grad_norm_``. Once the optimizer stops training the parameter
(closed, superseded, collected), what its stand-in's ``.grad`` held goes to the DTensor
parameter's ``.grad`` (``leave_grad``), and the next optimizer's construction moves it into its own
stand-in (``move_grad``), where group._left_grads takes it as a plain parameter's.

Writes from outside (``load_state_dict``, ``copy_``, a write into ``to_local()``) are noticed
through the model's DTensor parameter, not its stand-in (see group._binding [Note: writes into
DTensor parameters]).

Each DTensor parameter's mesh (1-D: the tensor-parallel ranks) is a model axis (see
comm._model_axes): a Shard placement is a part of the model, a Replicate placement (and a plain
parameter beside DTensor ones) a copy counted once in the norm.

[Note: rebuilding over the flat buffer]
``rewrap`` sets the DTensor's local tensor (its ``_local_tensor``), as torch's FSDP2 does to put a
sharded parameter over its own storage (``FSDPParam.reset_sharded_param``): the mesh, placements,
global shape and stride (the DTensor's spec) stay, and so does everything autograd keeps on the
parameter. Swapping in a new DTensor (``torch.utils.swap_tensors`` with ``DTensor.from_local``
over the view) would not keep the hooks: torch holds a tensor's hook dicts (``register_hook``,
``register_post_accumulate_grad_hook``) on the Python object, which the swap keeps, and wires them
into the autograd data of the tensor they were first made on, which the swap hands to the other
object. After such a swap a hook registered on the parameter before it (the user's, or an earlier
optimizer's, even one removed since) no longer runs, nor does any registered after it: a second
optimizer over the same model would never see its DTensor gradients. A view of the local tensor
taken before (``p.to_local()``) keeps the old storage, as it would after a swap.

The local tensor set is not the view of the flat buffer itself but an alias of the same memory at
offset 0 of a storage of its own (a slice of the flat buffer's storage, ``UntypedStorage[a:b]``,
which holds the buffer's storage alive), as every DTensor's local tensor is: a DTensor wrapper
carries the storage offset its local tensor had when it was made (0 for parallelize_module's), and
``torch.compile`` (its fake-tensor conversion of the parameter) fails where the two disagree
(a view of the flat buffer sits at its offset in it). The alias has its own
version counter, as the ``.data`` of the stand-in would have: writes through the flat buffer (the
all-gather after a step) move no counter of the parameter's.

[Note: a gradient in another placement]
Autograd may give a DTensor parameter a gradient whose placements are not the parameter's: a
Replicate parameter applied where the activations are split across the mesh (the LayerNorm of
torch's ``SequenceParallel``, any Replicate parameter in a sequence-parallel region) gets a
``Partial(sum)`` gradient: each rank holds its share of the gradient, and the gradient is their
sum. Its local tensor is not the gradient. So ``move_grad`` first brings the gradient to the
parameter's placements with DTensor's own ``redistribute`` (a ``Partial(sum)`` or ``Partial(avg)``
made ``Replicate``: an all-reduce over the mesh, summing or averaging; made ``Shard``: a
reduce-scatter), as FSDP2 does with a DTensor parameter's gradient in its post-backward, and
moves that local tensor. The stand-in then holds what a plain parameter's gradient would be: the
whole gradient, alike on every rank of the mesh, so the data-parallel average, accumulation under
``no_sync``, a copy counted once in the clip norm and the first step's check of copies (see
step._copies) hold as for any copy.

Cost: one collective over the mesh per such gradient per backward pass (also per micro-batch under
``no_sync``), issued from the gradient's hook; beside sequence parallelism that is each LayerNorm's
weight and bias, vectors of the model width. (``torch.optim`` on the same DTensor model reduces
such a gradient in each operation of its step that reads it, and in ``clip_grad_norm_``.) Summing such
gradients once per step instead, over the reduced shards (as Megatron-LM all-reduces its
sequence-parallel LayerNorm gradients after the data-parallel reduction), would need each
parameter's shard at the same place on every rank of the mesh, which an uneven Shard split (whose
pieces differ in size between the positions, and so the flat buffers' layouts) does not give; and
it would have to tell a sum already taken from gradients added after it (a backward pass after
``clip_grad_norm_``). In the hook every rank of the mesh holds the whole gradient, in the order
autograd produces them, the order DTensor's own collectives in the backward pass already rely on.
A gradient assigned by hand (``p.grad = g``, moved at ``clip_grad_norm_``/``step``) is brought to
the placements there: assign it on every rank of the mesh alike. It replaces what the stand-in
held (``move_grad(..., replace=True)``), as ``p.grad = g`` replaces a plain parameter's gradient:
in stage 1 the stand-in's ``.grad`` is its view of the flat gradient, where an addition would be
taken for no gradient at all before a backward pass, and for the backward's after one.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it when no
    DTensor module was ever loaded). A question."""
    import sys

    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(t, cls)


def mesh_of(p: Tensor) -> Any:
    return p.device_mesh  # type: ignore[attr-defined]


def axis_name(p: Tensor) -> str:
    """The model-axis name of ``p``'s (1-D) mesh: its dimension's name, else "tp"."""
    names = getattr(mesh_of(p), "mesh_dim_names", None)
    return str(names[0]) if names else "tp"


def check_placements(p: Tensor, name: str) -> None:
    """Raise ValueError for a DTensor parameter ShardedAdamW cannot take: a mesh of more than one
    dimension, or a Partial placement. Local."""
    mesh = mesh_of(p)
    if mesh.ndim != 1:
        raise ValueError(f"parameter {name} is a DTensor on a {mesh.ndim}-D mesh {tuple(mesh.shape)}: shardopt "
                         "takes DTensor parameters on a 1-D (tensor-parallel) mesh and shards their local tensors "
                         "over its own data-parallel group; parallelize the model over mesh['tp'] and pass "
                         "device_mesh=mesh['dp'] to the optimizer")
    if not all(is_shard(pl) or is_replicate(pl) for pl in p.placements):  # type: ignore[attr-defined]
        raise ValueError(f"parameter {name} is a DTensor with placements {tuple(p.placements)}: shardopt "  # type: ignore[attr-defined]
                         "takes Shard and Replicate placements (as parallelize_module makes them)")


def is_shard(pl: object) -> bool:
    """Whether placement ``pl`` is a plain ``Shard``: this exact class, so that a subclass, which
    splits a dimension otherwise than ``shard_extent`` does, is not taken for one (torch 2.9's
    ``_StridedShard``, which FSDP2 over tensor parallelism makes, is a ``Shard``; in later torch it
    is not). Only called for DTensors, so torch.distributed.tensor is loaded already."""
    from torch.distributed.tensor import Shard

    return type(pl) is Shard


def is_replicate(pl: object) -> bool:
    """Whether placement ``pl`` is a ``Replicate`` (see ``is_shard``)."""
    from torch.distributed.tensor import Replicate

    return isinstance(pl, Replicate)


def replicated(p: Tensor) -> bool:
    """Whether DTensor ``p`` is a copy on every rank of its mesh (a Replicate placement)."""
    return all(is_replicate(pl) for pl in p.placements)  # type: ignore[attr-defined]


def shard_extent(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of piece ``index`` of ``parts`` when a Shard placement splits a dimension
    of ``size`` elements: ``torch.chunk``'s pieces of ``ceil(size / parts)``, the last ones short
    or empty (4 over 3: 2, 2, 0), as DTensor splits it. A question."""
    chunk = -(-size // parts)
    offset = min(index * chunk, size)
    return offset, max(0, min(chunk, size - offset))


def local_box(p: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the global shape, the offsets of this rank's local tensor in it) of DTensor ``p``, as its
    Shard placement splits it (``shard_extent``; a Replicate placement: at 0). Raises ValueError
    for a local tensor that is not that piece. Local."""
    shape = tuple(int(n) for n in p.shape)
    local = p.detach().to_local()  # type: ignore[attr-defined]
    offsets = [0] * len(shape)
    mesh = mesh_of(p)
    for pl in p.placements:  # type: ignore[attr-defined]
        if not is_shard(pl):
            continue
        d, rank = int(pl.dim), mesh.get_local_rank()
        offsets[d], length = shard_extent(shape[d], mesh.size(), rank)
        if local.shape[d] != length:
            raise ValueError(f"a DTensor of shape {shape} holds a local tensor of shape {tuple(local.shape)} on rank "
                             f"{rank} of its mesh, not the piece its placement {pl} makes; checkpoints store such "
                             "a parameter by its pieces' offsets and need that split")
    return shape, tuple(offsets)


def local_of(p: Tensor) -> Tensor:
    """DTensor ``p``'s local tensor (or a view of it: torch 2.13 gives a parameter's as a view): its
    storage, and the version counter that a write through ``p.to_local()`` moves.
    ``p.detach().to_local()`` is no such thing: DTensor detaches below autograd, so that alias has a
    counter of its own that no write to ``p`` moves (see group._binding [Note: writes into DTensor
    parameters]). Local."""
    with torch.no_grad():  # to_local() is no autograd function there
        return p.to_local()  # type: ignore[attr-defined]


def stand_in(p: Tensor) -> torch.nn.Parameter:
    """A plain parameter holding a copy of DTensor ``p``'s local tensor (see [Note: DTensor parameters])."""
    with torch.no_grad():
        local = p.detach().to_local()  # type: ignore[attr-defined]
        return torch.nn.Parameter(local.clone(memory_format=torch.contiguous_format), requires_grad=p.requires_grad)


def rewrap(p: Tensor, view: Tensor) -> None:
    """Make DTensor parameter ``p`` (the same object, with its gradient hooks and accumulator) hold
    ``view`` as its local tensor: ``view`` has the shape and dtype of its local tensor now (see
    [Note: rebuilding over the flat buffer]). Local."""
    local = p.detach().to_local()  # type: ignore[attr-defined]
    if tuple(view.shape) != tuple(local.shape) or view.dtype != local.dtype:
        raise AssertionError(f"a DTensor parameter with a local tensor of {tuple(local.shape)} {local.dtype} "
                             f"rebuilt over a view of {tuple(view.shape)} {view.dtype}")
    # an alias of view's memory at offset 0 of a storage of its own (a slice of the flat buffer's
    # storage, which it keeps alive), as a DTensor's local tensor is (see [Note: rebuilding over
    # the flat buffer])
    size = view.numel() * view.element_size()
    start = view.storage_offset() * view.element_size()
    memory = view.untyped_storage()[start:start + size]
    with torch.no_grad():
        alias = torch.empty(0, dtype=view.dtype, device=view.device).set_(memory, 0, view.shape, view.stride())
    p._local_tensor = alias  # type: ignore[attr-defined]


def move_grad(p: Tensor, into: Tensor, *, replace: bool = False) -> None:
    """Move DTensor parameter ``p``'s ``.grad`` (its local tensor, in ``p``'s placements) into
    stand-in ``into``'s ``.grad``: from the optimizer's hook, as autograd accumulates (assigned when
    ``into.grad`` is None, else added in place; a stage-2 placeholder keeps it as its pending part);
    with ``replace`` (a gradient assigned by hand, ``p.grad = g``), assigned in place of whatever
    ``into.grad`` holds, as assigning ``p.grad`` replaces the gradient in torch: the stand-in then
    holds a gradient assigned by hand, which the flat group takes as a plain parameter's (see
    [Note: DTensor parameters]). ``p.grad`` becomes None. Local, but for a gradient in other
    placements than ``p``'s (a Partial one): every rank of ``p``'s mesh, in the same order (see
    [Note: a gradient in another placement])."""
    g: Any = p.grad
    if g is None:
        return
    p.grad = None
    if is_dtensor(g):
        with torch.no_grad():  # the local tensor itself (a gradient left by an earlier optimizer: see leave_grad)
            if tuple(g.placements) != tuple(p.placements):  # type: ignore[attr-defined]
                g = g.redistribute(mesh_of(p), p.placements)  # type: ignore[attr-defined]
            local = g.to_local()
    else:
        local = g
    if replace or into.grad is None:
        into.grad = local
    else:
        into.grad.add_(local)


def leave_grad(p: Tensor, into: Tensor) -> None:
    """Stand-in ``into``'s optimizer no longer trains DTensor parameter ``p``: put what it leaves in
    ``into.grad`` (a view of its flat gradient, or a stage-2 placeholder, see group._left_grads) in
    ``p.grad``, as a DTensor in ``p``'s placements whose local tensor is that very tensor (what marks
    it as left stays with it), where torch holds a DTensor parameter's gradient: ``model.zero_grad()``
    drops it, a backward pass adds to it, and the next optimizer over ``p`` takes it at its
    construction (``move_grad``) as a plain parameter's. A ``p.grad`` assigned by hand since the last
    move stays: it replaces the gradient. ``into.grad`` becomes None. Local."""
    from torch.distributed.tensor import DTensor

    held = into.grad
    into.grad = None
    if held is None or p.grad is not None:
        return
    # DTensor's own constructor: from_local would wrap a view of ``held``, not ``held``
    p.grad = DTensor(held, p._spec, requires_grad=False)  # type: ignore[attr-defined]
