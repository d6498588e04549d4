"""One simulation of what a tensor-parallel rank sees (planner/one_rank.py): the validator's
one-shard run (whole weights inside split modules) and the planner's measurement (their local
slices) see the same widths everywhere outside the split modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardkit as sk
from shardkit.families.on_meta import meta_tensors, run_on_meta
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt
from shardkit.models.hf import GPT2_RULES, LLAMA_RULES, build_tiny_gpt2, build_tiny_llama
from shardkit.planner.one_rank import one_rank, sliced_parameters


def _widths(model: nn.Module, plan, local_weights: bool) -> dict[str, tuple]:
    """Output shapes of every module outside the split ones, with the model run as one rank."""
    inside = tuple(f"{n}." for n in plan.splits)
    tensors = meta_tensors(model)
    if local_weights:
        for name, dim in sliced_parameters(model, plan).items():
            shape = list(tensors[name].shape)
            shape[dim] //= plan.size
            tensors[name] = torch.empty(shape, device="meta", requires_grad=True)
    seen: dict[str, tuple] = {}

    def record(name: str, out: object) -> None:
        seen.setdefault(name, tuple(out.shape) if isinstance(out, torch.Tensor) else None)

    handles = [m.register_forward_hook(lambda _m, _a, out, n=n: record(n, out))
               for n, m in model.named_modules() if n and n not in plan.splits and not n.startswith(inside)]
    try:
        with one_rank(model, [plan], local_weights=local_weights):
            run_on_meta(model, tensors, (torch.zeros(1, 7, dtype=torch.long),))
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("build, rules, between", [(build_tiny_gpt, GPT_RULES, 0), (build_tiny_gpt2, GPT2_RULES, 128),
                                                   (build_tiny_llama, LLAMA_RULES, 0)], ids=["gpt", "gpt2", "llama"])
def test_whole_and_local_weights_show_a_rank_the_same_widths(build, rules, between):
    """``between``: the width a module between a column/row pair sees (half the MLP's; the GPT's
    activation is a function, not a module; Llama's half of 128 is its hidden width)."""
    model = build()
    plan = sk.validate(sk.Plan(sk.Mesh(tp=2), rules), model).facts.tensor_parallel["tp"]
    whole, local = _widths(model, plan, local_weights=False), _widths(model, plan, local_weights=True)
    assert whole == local
    widths = {shape[-1] for shape in whole.values() if shape}
    assert 64 in widths and (between in widths or not between)  # whole hidden widths, and this rank's
