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
from collections.abc import Iterator
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
    rank's local shapes (all ``E`` experts; ``global_params``: whole), ``pieces`` each expert
    parameter as ``(E, elements per expert)`` (``ep`` splits the ``E``, FSDP then shards it: the
    runtime's ``fully_shard`` of an experts module shards dim 0), ``measured``: the same
    parameters as the analysis's block pieces hold them, and ``flops_per_token``: the forward
    FLOPs of one token through ``top_k`` experts (2 per weight element of each expert it visits).

    >>> costs = ExpertCosts(1, 4, 2, 80, 80, ((4, 12), (4, 8)), ((4, 12), (4, 8)), 80.0)
    >>> costs.active_params, split_experts(costs.pieces, 2)
    (40, ((2, 12), (2, 8)))
    """

    modules: int
    num_experts: int
    top_k: int
    params: int
    global_params: int
    pieces: tuple[Piece, ...]
    measured: tuple[Piece, ...]
    flops_per_token: float

    @property
    def active_params(self) -> int:
        """Elements of the experts one token uses (whole): ``top_k / E`` of them."""
        return self.global_params * self.top_k // self.num_experts


def split_experts(pieces: tuple[Piece, ...], ep: int) -> tuple[Piece, ...]:
    """``pieces`` of ``(E, rest)`` as one ``ep`` rank holds them: ``(E / ep, rest)``."""
    return tuple((size // ep, rest) for size, rest in pieces)


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
    pieces, measured = [], []
    flops = 0.0
    for layer in layers:
        for pname, p in model.get_submodule(layer.name).named_parameters(recurse=False):
            name = f"{layer.name}.{pname}"
            shape = list(p.shape)
            if name in split_dims:
                shape[split_dims[name]] //= tp
            numel = math.prod(shape)
            params, whole = params + numel, whole + p.numel()
            pieces.append((shape[0], numel // shape[0]))
            dim = fsdp_dims.get(name, 0)
            measured.append((shape[dim], numel // shape[dim]))
            if pname in EXPERT_WEIGHTS:
                flops += 2 * top_k[layer.name] * numel / shape[0]
    return ExpertCosts(len(layers), layers[0].num_experts, top_k[layers[0].name], params, whole, tuple(pieces),
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


__all__ = ["COUNT_BYTES", "Exchange", "ExpertCosts", "block_experts", "exchanges", "routing_watch", "split_experts",
           "without"]
