"""What a mixture of experts costs, for the planner: the experts of one block as a rank holds
them, the parameters a token uses (*active*), and expert parallelism's all-to-all.

The experts modules are those :mod:`shardkit.planner.experts` finds (``gate_up_proj`` /
``down_proj`` stacked on dim 0); ``top_k`` is read from the routing the model hands them on the
analysis's forward (:func:`routing_watch`), so it is the model's own. A token goes through
``top_k`` of the ``E`` experts: its FLOPs are those of ``top_k`` experts (the analysis measures
them so), and its active parameters are the model's less ``1 - top_k / E`` of the experts'.

Under ``ep``, each MoE layer exchanges rows by all-to-all (``runtime/expert_parallel.py``): per
micro-batch, forward, the per-expert counts (``E`` int64 per rank), the rows out (each
(token, slot) pair: ``hidden`` values in the compute dtype) and the rows back; backward, the
gradients of the rows back and of the rows out. At balanced routing a rank's ``tokens x top_k``
rows spread evenly over the ``ep`` ranks, and the ``1 / ep`` bound for its own experts stays
local (:func:`exchanges`).

>>> [(e.name, e.bytes) for e in exchanges(tokens=64, top_k=2, hidden=64, itemsize=4, num_experts=4, ep=2)]
[('counts', 16), ('rows out', 16384), ('rows back', 16384), ("rows back's gradient", 16384), ("rows out's gradient", 16384)]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from .experts import EXPERT_WEIGHTS, find_experts
from .measure import Piece

#: Bytes of one per-expert count in the counts exchange (``torch.long``).
COUNT_BYTES = 8


@dataclass(frozen=True)
class ExpertCosts:
    """The experts of one block, as one tensor-parallel rank holds them: ``modules`` experts
    modules of ``num_experts`` experts each, ``top_k`` per token; ``params`` elements at this
    rank's local shapes (all ``E`` experts; ``global_params``: whole), ``shapes`` each expert
    parameter's shape at this rank (``ep`` splits dim 0, ``E``; FSDP then shards the dim
    :func:`expert_shard_dim` picks), ``measured``: the same
    parameters as the analysis's block pieces hold them, and ``flops_per_token``: the forward
    FLOPs of one token through ``top_k`` experts (2 per weight element of each expert it visits).

    >>> costs = ExpertCosts(1, 4, 2, 80, 80, ((4, 6, 2), (4, 8)), ((4, 12), (4, 8)), 80.0)
    >>> costs.active_params, stored_expert_elements(costs.shapes, ep=4, shards=2)
    (40, 10)
    """

    modules: int
    num_experts: int
    top_k: int
    params: int
    global_params: int
    shapes: tuple[tuple[int, ...], ...]
    measured: tuple[Piece, ...]
    flops_per_token: float

    @property
    def active_params(self) -> int:
        """Elements of the experts one token uses (whole): ``top_k / E`` of them."""
        return self.global_params * self.top_k // self.num_experts


def expert_shard_dim(shape: Sequence[int], shards: int) -> int:
    """The dim FSDP2 shards ``shards`` ways of a stacked expert parameter of ``shape`` as one ``ep``
    rank holds it (its ``E / ep`` experts first): dim 0, the expert dim, when ``shards`` divides it;
    else the first other dim it divides, so that no rank allocates a padded expert (FSDP2 pads
    dim 0 to ``ceil(E / ep / shards)`` experts, and shards other dims only evenly; torchtitan
    shards experts on dim 1 the same way); else dim 0, padded. The runtime's ``fully_shard`` of
    an experts module (``runtime/expert_parallel.py``) and the estimate both follow it.

    >>> expert_shard_dim((2, 512, 64), 2), expert_shard_dim((1, 512, 64), 2), expert_shard_dim((1, 3, 4), 2)
    (0, 1, 2)
    >>> expert_shard_dim((1, 3, 5), 2)
    0
    """
    return next((d for d, size in enumerate(shape) if size % shards == 0), 0)


def stored_expert_elements(shapes: Iterable[Sequence[int]], ep: int, shards: int) -> int:
    """Elements a device stores of expert parameters of ``shapes`` (``E`` first): ``E / ep`` experts,
    sharded ``shards`` ways by FSDP2 on :func:`expert_shard_dim` (padded when no dim divides)."""
    total = 0
    for shape in shapes:
        local = (shape[0] // ep, *shape[1:])
        dim = expert_shard_dim(local, shards)
        total += -(-local[dim] // shards) * math.prod(local) // max(local[dim], 1)
    return total


def without(pieces: tuple[Piece, ...], removed: tuple[Piece, ...]) -> tuple[Piece, ...]:
    """``pieces`` less one occurrence of each of ``removed`` (a block's pieces less its experts')."""
    left = list(pieces)
    for piece in removed:
        left.remove(piece)
    return tuple(left)


@contextmanager
def routing_watch(model: nn.Module) -> Iterator[dict[str, int]]:
    """While open, the ``top_k`` of the routing each experts module of ``model`` is handed (by
    module name), read from its ``top_k_index [T, k]`` argument when it runs."""
    seen: dict[str, int] = {}
    handles = []
    for layer in find_experts(model):
        def hook(_module, args, kwargs, name=layer.name):
            index = [*args, *kwargs.values()][1]  # (hidden_states, top_k_index, top_k_weights), by position
            seen[name] = int(index.shape[-1])
        handles.append(model.get_submodule(layer.name).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def block_experts(model: nn.Module, block: str, top_k: dict[str, int], split_dims: dict[str, int], tp: int,
                  fsdp_dims: dict[str, int]) -> ExpertCosts | None:
    """The experts of ``block`` (a module name of ``model``) as a rank of tensor-parallel degree
    ``tp`` holds them (``split_dims``: the dims its plan splits; ``fsdp_dims``: the dims FSDP
    shards where a layout names one), with the ``top_k`` :func:`routing_watch` saw; ``None``
    for a block without experts."""
    prefix = f"{block}."
    layers = [layer for layer in find_experts(model) if layer.name.startswith(prefix)]
    if not layers:
        return None
    params = whole = 0
    shapes, measured = [], []
    flops = 0.0
    for layer in layers:
        for pname, p in model.get_submodule(layer.name).named_parameters(recurse=False):
            name = f"{layer.name}.{pname}"
            shape = list(p.shape)
            if name in split_dims:
                shape[split_dims[name]] //= tp
            numel = math.prod(shape)
            params, whole = params + numel, whole + p.numel()
            shapes.append(tuple(shape))
            dim = fsdp_dims.get(name, 0)
            measured.append((shape[dim], numel // shape[dim]))
            if pname in EXPERT_WEIGHTS:
                flops += 2 * top_k[layer.name] * numel / shape[0]
    return ExpertCosts(len(layers), layers[0].num_experts, top_k[layers[0].name], params, whole, tuple(shapes),
                       tuple(measured), flops)


@dataclass(frozen=True)
class Exchange:
    """One all-to-all of an MoE layer: its ``name``, ``backward`` or not, and the ``bytes`` one rank
    sends to the other ranks of its ``ep`` group (what it keeps for its own experts left out)."""

    name: str
    backward: bool
    bytes: int


def exchanges(*, tokens: float, top_k: int, hidden: int, itemsize: int, num_experts: int, ep: int) -> list[Exchange]:
    """The all-to-alls of one MoE layer for one micro-batch of ``tokens`` tokens per rank, at
    balanced routing: counts, rows out, rows back (forward), their gradients back (backward)."""
    rows = int(tokens * top_k * hidden * itemsize * (ep - 1) / ep)
    counts = num_experts * COUNT_BYTES * (ep - 1) // ep
    return [Exchange("counts", False, counts), Exchange("rows out", False, rows), Exchange("rows back", False, rows),
            Exchange("rows back's gradient", True, rows), Exchange("rows out's gradient", True, rows)]


__all__ = ["COUNT_BYTES", "Exchange", "ExpertCosts", "block_experts", "exchanges", "expert_shard_dim", "routing_watch",
           "stored_expert_elements", "without"]
