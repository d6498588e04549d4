"""Where this rank's part of each parameter sits in the full tensor: the one answer that
initialisation, HuggingFace weights in, checkpoints and exports all need.

A parameter here is a DTensor (tensor parallel, FSDP, or both) or a plain tensor, and may be
*permuted*: a packed projection's rows are reordered rank-major before it is split (see
:mod:`shardkit.runtime.tensor_parallel`), so a rank's contiguous shard holds several runs of
the full tensor's rows. :func:`pieces` cuts a rank's local tensor into boxes of the *full,
canonical* tensor (the one an unsharded model and a HuggingFace checkpoint hold): one box for
an ordinary shard, one per run for a permuted one.

torch's DTensor says where a regular shard sits (``compute_local_shape_and_global_offset``) but
knows nothing of our permutations, and checkpoint writers (DCP) accept one box per DTensor:
this module adds the runs.

>>> import torch
>>> [p.box for p in pieces(torch.zeros(4, 2))]
[(slice(0, 4, None), slice(0, 2, None))]
>>> [p.box[0] for p in pieces(torch.zeros(4, 2), (0, torch.tensor([0, 2, 1, 3])))]
[slice(0, 1, None), slice(2, 3, None), slice(1, 2, None), slice(3, 4, None)]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

#: ``(dim, permutation)``: the tensor holds ``full.index_select(dim, permutation)``.
Permutation = tuple[int, torch.Tensor]


@dataclass(frozen=True)
class Piece:
    """A view of this rank's storage (``local``) and the box of the full tensor it holds.

    ``writer``: this rank is the one of the ranks holding the same box that writes it out (the
    first along every mesh dim the tensor is replicated over), so a box is written once.
    """

    local: torch.Tensor
    box: tuple[slice, ...]
    writer: bool = True

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(s.start for s in self.box)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.box)


def _regular(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    """(local tensor, its offset in the (permuted) full tensor, whether this rank writes it)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return tensor, (0,) * tensor.dim(), True
    local = tensor.to_local()
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    coordinates = tensor.device_mesh.get_coordinate() or []
    writer = all(c == 0 for c, p in zip(coordinates, tensor.placements) if isinstance(p, Replicate))
    return local, tuple(offset), writer


def pieces(tensor: torch.Tensor, permutation: Permutation | None = None) -> list[Piece]:
    """This rank's part of ``tensor`` as boxes of the full canonical tensor, in local order."""
    local, offset, writer = _regular(tensor)
    box = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
    if permutation is None or local.numel() == 0:
        return [Piece(local, box, writer)]
    dim, perm = permutation
    rows = perm[offset[dim]:offset[dim] + local.shape[dim]].tolist()
    found, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            run = list(box)
            run[dim] = slice(rows[start], rows[i - 1] + 1)
            found.append(Piece(local.narrow(dim, start, i - start), tuple(run), writer))
            start = i
    return found


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage), or the tensor itself."""
    # DTensor can only exist once its module is imported; importing it here would cost seconds per process
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(tensor, dtensor.DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def full_parameter(tensor: torch.Tensor, permutation: Permutation | None = None) -> torch.Tensor:
    """The whole canonical tensor (a collective over the tensor's mesh when it is a DTensor:
    every rank holding a part must call it), the permutation undone.

    >>> full_parameter(torch.tensor([10., 30., 20.]), (0, torch.tensor([0, 2, 1])))
    tensor([10., 20., 30.])
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    full = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
    if isinstance(full, AsyncCollectiveTensor):  # waited here: pending gathers would pile up, one per parameter
        full = full.wait()
    if permutation is None:
        return full
    dim, order = permutation
    return full.index_select(dim, torch.argsort(order.to(full.device)))


def model_pieces(model: nn.Module) -> dict[str, list[Piece]]:
    """``{parameter name: pieces}`` of every parameter ``model`` holds on this rank (each tied
    parameter once, under its first name), with the model's permutations applied."""
    permutations = getattr(model, "_sk_permutations", {})
    return {name: pieces(p, permutations.get(name)) for name, p in model.named_parameters()}


__all__ = ["Permutation", "Piece", "full_parameter", "local_tensor", "model_pieces", "pieces"]
