"""Parameters tied across pipeline devices (an embedding tied to the LM head on the first and
last stage), kept equal as one parameter of one process would be.

torch's pipelining has no notion of a parameter shared by two stages, and torchtitan unties
them; shardkit keeps the tie, as Megatron's embedding group does: one process group per tie's
pipeline devices and per coordinate of the other mesh axes (every rank creates every group,
in one order), the first name's values broadcast to the other copies when the pipeline is
built, and after each step the gradient each copy gained summed over the copies. Copies on
one device are one parameter already (``zbv`` puts the first and last stage on one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from ..plan import UsageError
from ..planner.stages import StageAssignment
from .meshes import process_group
from .pieces import local_tensor


@dataclass
class TiedCopy:
    """This rank's copy (``name``) of a parameter tied across pipeline devices (``first``: the
    model's first name for it), the group of the devices holding a copy, the group rank of
    the first name's device (``source``), and whether this is that device (``primary``)."""

    name: str
    first: str
    param: nn.Parameter
    group: dist.ProcessGroup
    source: int
    primary: bool


def connect_ties(model: nn.Module, assignment: StageAssignment, mesh: object, pp_rank: int,
                 local: list[int]) -> list[TiedCopy]:
    """This rank's copies of the parameters tied across pipeline devices, each made equal to its
    first name's copy (a broadcast over the tie's group). Every rank of the world calls it."""
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    # the groups (made once per process, runtime/meshes.py): one per coordinate of the other axes
    pp_dim = mesh.mesh_dim_names.index("pp")
    lines = mesh.mesh.movedim(pp_dim, -1).reshape(-1, mesh.mesh.shape[pp_dim]).tolist()
    copies = []
    for tie in assignment.ties:
        devices = tuple(sorted({assignment.ranks[s] for s in tie.stages}))
        if len(devices) < 2:
            continue
        if devices not in groups:  # every rank asks for every line's group, in one order
            for line in lines:
                ranks = tuple(line[d] for d in devices)
                group = process_group(ranks)
                if dist.get_rank() in ranks:
                    groups[devices] = group
        if pp_rank not in devices:
            continue
        name = next(n for n, s in zip(tie.names, tie.stages) if s in local)
        first = assignment.ranks[tie.stages[0]]
        copy = TiedCopy(name, tie.names[0], model.get_parameter(name), groups[devices], devices.index(first),
                        primary=first == pp_rank)
        with torch.no_grad():
            dist.broadcast(local_tensor(copy.param), group=copy.group, group_src=copy.source)
        copies.append(copy)
    return copies


def tied_grads(copies: list[TiedCopy]) -> list[torch.Tensor | None]:
    """Each tied copy's gradient before a step (``None``: none yet)."""
    return [None if t.param.grad is None else _local_grad(t.param).clone() for t in copies]


def sum_tied_grads(copies: list[TiedCopy], before: list[torch.Tensor | None]) -> None:
    """Add to each tied copy's gradient what the other copies gained in this step: the sum of the
    step's gains, so a gradient accumulated over steps is never summed twice.

    Every copy takes part in every step, frozen or not (so no device waits for another), and
    says whether it requires grad: a tie frozen under one name and not another (one parameter
    in one process) would let the copies drift, so it stops every device."""
    learning = []  # how many copies of each tie require grad, read once for all ties (one host read a step)
    with torch.no_grad():
        for tie, old in zip(copies, before):
            param = tie.param
            if param.grad is None and param.requires_grad:
                param.grad = torch.zeros_like(param)
            grad = _local_grad(param) if param.grad is not None else torch.zeros_like(local_tensor(param))
            gained = torch.empty(grad.numel() + 1, dtype=grad.dtype, device=grad.device)
            gained[:-1] = (grad - old if old is not None else grad).flatten()
            gained[-1] = float(param.requires_grad)
            dist.all_reduce(gained, group=tie.group)
            learning.append(gained[-1].float())
            if param.requires_grad:
                gained = gained[:-1].view_as(grad)
                grad.copy_(gained if old is None else old + gained)
    # a dry run's fake tensors hold no values: its copies all learn, as its model was built
    counts = [] if not learning or is_fake(learning[0]) else torch.stack(learning).tolist()
    for tie, count in zip(copies, counts):
        holders = dist.get_world_size(tie.group)
        if round(count) not in (0, holders):
            raise UsageError(f"parameter {tie.name!r} is tied to {tie.first!r} (one parameter in one process), but "
                             f"only {round(count)} of the {holders} pipeline devices holding a copy have it "
                             f"requires_grad=True: freeze or unfreeze it under every name it has on every stage "
                             f"(model.tied_copies lists a stage's other names)")


def _local_grad(param: nn.Parameter) -> torch.Tensor:
    """``param``'s gradient as its local shard, laid out as ``param`` first: the backward of a
    vocabulary-split embedding leaves a replicated DTensor gradient beside its sharded weight,
    while the LM head tied to it gets a sharded one, and the copies' shards must match."""
    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        param.grad = grad = grad.redistribute(param.device_mesh, param.placements)
    return local_tensor(grad)


__all__ = ["TiedCopy", "connect_ties", "sum_tied_grads", "tied_grads"]
