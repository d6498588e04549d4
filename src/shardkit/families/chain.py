"""Chain models: a forward that passes each top-level module's output straight to the next
(``nn.Sequential``, or a hand-written ``forward`` doing the same; ModuleList / Sequential
children are expanded). Any model no other family recognises is tried as a chain.

The chain and its execution order are checked by running the forward on meta tensors with
hooks on every unit: a module that runs twice, never, or takes anything but the previous
unit's output makes the model no chain (a :class:`PlanError` saying which).

>>> layout = ChainFamily().pipeline_layout(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
>>> layout.kind, [u.name for u in layout.units]
('chain', ['0', '1', '2'])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..plan import PlanError
from .base import Family, ModelLayout, Unit
from .modules import guess_input
from .on_meta import meta_kernels, meta_tensors, swapped


class ChainFamily(Family):
    name = "chain"

    def example_inputs(self, model: nn.Module, seq_len: int | None = None) -> tuple | None:
        return guess_input(model, seq_len or 16)

    def takes_token_ids(self, model: nn.Module) -> bool:
        inputs = self.example_inputs(model)
        return inputs is not None and not inputs[0].is_floating_point()

    def pipeline_layout(self, model: nn.Module, example_inputs: tuple | None = None) -> ModelLayout:
        units = _chain_units(model)
        if not units:
            raise PlanError(f"{type(model).__name__} has no child modules to place in pipeline stages")
        inputs = example_inputs or guess_input(model.get_submodule(units[0].modules[0])) or guess_input(model)
        if inputs is None:
            if type(model).forward is not nn.Sequential.forward:  # only nn.Sequential runs in registration order
                raise PlanError(f"shardkit cannot tell in which order {type(model).__name__}'s children run without "
                                f"an example input (it guesses one only from an Embedding or a Linear): pass "
                                f"example_inputs=(one input batch,) to sk.validate / sk.shard, or make the model an "
                                f"nn.Sequential")
            return ModelLayout(self, tuple(units), (), None)
        return ModelLayout(self, _chain_order(model, units, inputs), (), inputs)

    def stage_forward(self, model: nn.Module, units: Sequence[Unit], *args: Any) -> Any:
        """Each unit's output is the next unit's only input."""
        for unit in units:
            args = (model.get_submodule(unit.name)(*args),)
        return args[0]


def _chain_units(model: nn.Module) -> list[Unit]:
    units = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            units += [Unit(f"{name}.{i}", (f"{name}.{i}",)) for i, _ in child.named_children()]
        else:
            units.append(Unit(name, (name,)))
    return units


def _run_on_meta(model: nn.Module, inputs: tuple) -> tuple[Any, tuple]:
    """The model's output on meta stand-ins of ``inputs`` (its own dtypes; a float32 mixture of experts
    runs under :func:`~shardkit.families.on_meta.meta_kernels`), and those inputs."""
    meta_inputs = tuple(torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    try:
        with swapped(model, meta_tensors(model)), meta_kernels():
            return model(*meta_inputs), meta_inputs
    except Exception as exc:  # the model's own error, reported with what was run
        raise PlanError(f"could not run {type(model).__name__}.forward on meta tensors of shapes "
                        f"{[tuple(x.shape) for x in inputs if isinstance(x, torch.Tensor)]} to find its execution "
                        f"order ({exc}); pass example_inputs= to assign_stages/model_layout") from None


def _chain_order(model: nn.Module, units: list[Unit], inputs: tuple) -> tuple[Unit, ...]:
    """Run the forward on meta tensors; return the units in call order after checking it is a chain."""
    calls: list[tuple[int, tuple, dict, Any]] = []
    handles = []
    for index, unit in enumerate(units):
        module = model.get_submodule(unit.modules[0])

        def post(_m: nn.Module, args: tuple, kwargs: dict, out: Any, index: int = index) -> None:
            calls.append((index, args, kwargs, out))

        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        output, meta_inputs = _run_on_meta(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    problems = []
    counts = [sum(1 for c in calls if c[0] == i) for i in range(len(units))]
    for unit, count in zip(units, counts):
        if count > 1:
            problems.append(f"module {unit.name!r} runs {count} times in one forward; a pipeline unit must run once "
                            f"(a module reused in two places cannot live in one stage only)")
        if count == 0 and any(True for _ in model.get_submodule(unit.modules[0]).parameters()):
            problems.append(f"module {unit.name!r} has parameters but the forward never calls it (it may call "
                            f"modules inside it directly); a chain pipeline calls each of its top-level modules once")
    expected: Any = meta_inputs
    for position, (index, args, kwargs, out) in enumerate(calls):
        takes_previous = (len(args) == len(expected) and all(a is b for a, b in zip(args, expected)) and not kwargs)
        if not takes_previous:
            source = "the model's inputs" if position == 0 else f"the output of {units[calls[position - 1][0]].name!r}"
            problems.append(f"{type(model).__name__} is not a chain of its modules: {units[index].name!r} does not take "
                            f"{source} as its only input, so the model cannot be cut between them. Pipelines support "
                            f"the shardkit GPT, HF causal LMs and chain models (nn.Sequential-like)")
            break
        expected = (out,)
    if not problems and calls and output is not calls[-1][3]:
        problems.append(f"{type(model).__name__}.forward does more after its last module {units[calls[-1][0]].name!r}; "
                        f"a chain model must return the last module's output")
    if problems:
        raise PlanError(problems)
    order = [c[0] for c in calls] + [i for i, n in enumerate(counts) if n == 0]
    return tuple(units[i] for i in order)


__all__ = ["ChainFamily"]
