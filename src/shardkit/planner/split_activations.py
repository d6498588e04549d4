"""Which activations are split over a model axis, followed through one forward on the meta device.

Under tensor parallel a column-parallel layer whose output stays split hands each rank its
part of the features; everything computed from that part (a head's queries after a view, the
attention scores of this rank's heads, an activation function's output) is split too, until a
row-parallel layer takes it in. :func:`follow_splits` runs the model once on meta tensors
under a ``TorchFunctionMode`` and follows, op by op (:func:`~shardkit.planner.split_ops.follow_split`),
where that split lies. On the way it records

- per column-parallel layer, the first op certain to compute across its split features (a
  norm, softmax or sum over them, a contraction over them): each rank would compute it from its
  part alone (``mixing``);
- per parameter that no tensor-parallel style splits, every op where something computed from
  it meets an activation (``uses``): on a split activation, broadcast across the split features
  (every rank uses all of it on its part: its gradient is a partial sum, ``"summed"``), lined up
  with them along one of its own dims (each rank needs only its slice, ``"sliced"``), or combined
  in a way no slicing makes right (``"mixed"``); on a whole activation (``"whole"``).

A parameter's values reach an activation through ops on the parameter alone (Apertus' xIELU
takes ``softplus(alpha_p)``; GPT-OSS reshapes and expands ``sinks`` before concatenating them
with the scores), so tensors computed only from parameters are followed too, with, for each of
the parameter's dims, where that dim lies in them (a :class:`~shardkit.planner.split_ops.Split`
"as if" the parameter were split on it).

torch has no analysis of which eager ops consume a split (DTensor finds out at run time, in the
workers, and only for modules run entirely on DTensors), so it is made here, before launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..families.on_meta import meta_tensors, swapped
from .split_ops import SHAPE_ONLY, Mixes, Split, follow_split, op_name

SUMMED, SLICED, MIXED, WHOLE = "summed", "sliced", "mixed", "whole"


@dataclass(frozen=True)
class Use:
    """One op where a parameter's values meet an activation: ``kind`` (``summed``, ``sliced``,
    ``mixed``, ``whole``), the op's name, the column-parallel ``layer`` whose output the activation
    is computed from, the parameter's ``dim`` lined up with the split (``sliced``) and, for
    ``mixed``, why."""

    kind: str
    op: str
    layer: str = ""
    dim: int | None = None
    why: str = ""


@dataclass
class SplitFlow:
    """What :func:`follow_splits` saw: ``ran`` is ``False`` when the forward failed on meta.
    ``outside``: parameters an op reads while their own module's forward is not running (a parent
    reading a child's parameter), with the innermost module running then."""

    ran: bool
    mixing: dict[str, str] = field(default_factory=dict)
    uses: dict[str, list[Use]] = field(default_factory=dict)
    outside: dict[str, str] = field(default_factory=dict)


class _Follow(TorchFunctionMode):
    def __init__(self, params: dict[int, str], stopped: set[int]):
        super().__init__()
        self.stopped = stopped  # parameters split by a style (DTensors at run time): not followed
        self.splits: dict[int, tuple[torch.Tensor, Split, str]] = {}  # tensors kept so no other reuses an id
        self.lost: dict[int, tuple[torch.Tensor, str, str]] = {}  # split, then through an op not followed: which, layer
        self.whole: dict[int, torch.Tensor] = {}
        # tensors computed from parameters alone: {param: [(param dim, where it lies here)]}
        self.derived: dict[int, tuple[torch.Tensor, dict[str, list[tuple[int, Split]]]]] = {}
        self.inside = 0
        self.mixing: dict[str, str] = {}
        self.uses: dict[str, list[Use]] = {}
        self.params = params
        self.running: list[str] = []  # the modules whose forward is running, outermost first
        self.outside: dict[str, str] = {}  # parameters read while their module's forward is not running: where

    def seed(self, tensors: dict[str, torch.Tensor], inputs: tuple) -> None:
        for name, tensor in tensors.items():
            if id(tensor) in self.params:
                self.derived[id(tensor)] = (tensor, {name: [(d, Split(d, 1, n)) for d, n in enumerate(tensor.shape)
                                                           if n > 1]})
        for tensor in inputs:
            if isinstance(tensor, torch.Tensor):
                self.whole[id(tensor)] = tensor

    def _use(self, param: str, use: Use) -> None:
        self.uses.setdefault(param, [])
        if use not in self.uses[param]:
            self.uses[param].append(use)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside:
            return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs or any(id(t) in self.stopped for t in tensors):
            return out
        name = op_name(func)
        first = args[0] if args else None
        for tensor in tensors:
            param = self.params.get(id(tensor))
            owner = param.rpartition(".")[0] if param else None
            if param and owner not in self.running and param not in self.outside:
                self.outside[param] = self.running[-1] if self.running else ""
        derived = {id(t): self.derived[id(t)] for t in tensors if id(t) in self.derived
                   and not (name in SHAPE_ONLY and t is not first)}
        known = {id(t): self.splits[id(t)] for t in tensors if id(t) in self.splits}
        lost = [self.lost[id(t)][1:] for t in tensors if id(t) in self.lost]
        whole = any(id(t) in self.whole for t in tensors)
        for tensor in outs:  # an output may be an input (``x.to(its own dtype)``): read above, replaced below
            for table in (self.splits, self.lost, self.whole, self.derived):
                table.pop(id(tensor), None)
        if known:
            self._split_op(func, args, kwargs, out, outs, known, derived, name)
        elif lost:
            for _, params in derived.values():
                for param in params:
                    self._use(param, Use(MIXED, name, lost[0][1], why=f"meets there an activation split over the "
                                         f"axis that went through {lost[0][0]}, an op shardkit does not follow"))
            self.lost.update({id(t): (t, *lost[0]) for t in outs})
        elif whole:
            for _, params in derived.values():
                for param in params:
                    self._use(param, Use(WHOLE, name))
            self.whole.update({id(t): t for t in outs})
        elif derived:
            self._derived_op(func, args, kwargs, out, outs, derived)
        return out

    def _split_op(self, func: Any, args: tuple, kwargs: dict, out: Any, outs: list[torch.Tensor],
                  known: dict[int, tuple[torch.Tensor, Split, str]],
                  derived: dict[int, tuple[torch.Tensor, dict[str, list[tuple[int, Split]]]]], name: str) -> None:
        layers = sorted({layer for _, _, layer in known.values()})
        splits = {i: split for i, (_, split, _) in known.items()}
        try:
            base, failure = follow_split(func, args, kwargs, out, splits), None
        except Mixes as exc:
            base, failure = None, exc
            if exc.certain:
                for layer in layers:
                    self.mixing.setdefault(layer, str(exc))
        except Exception as exc:  # arguments follow_split does not read
            base, failure = None, Mixes(f"passes through {name} ({type(exc).__name__})")
        found = base
        for tensor, params in derived.values():
            for param, dims in params.items():
                if base is not None:
                    self._use(param, Use(SUMMED, name, layers[0]))
                    continue
                for dim, split in dims:
                    try:
                        found = follow_split(func, args, kwargs, out, {**splits, id(tensor): split})
                    except Exception:
                        continue
                    self._use(param, Use(SLICED, name, layers[0], dim))
                    break
                else:
                    self._use(param, Use(MIXED, name, layers[0], why=f"the activation {failure}"))
        if found is not None:
            self.splits.update({id(t): (t, found[id(t)], layers[0]) for t in outs if id(t) in found})
            self.whole.update({id(t): t for t in outs if id(t) not in found})
        elif failure is not None and not failure.certain:
            self.lost.update({id(t): (t, name, layers[0]) for t in outs})
        else:
            self.whole.update({id(t): t for t in outs})  # computed across the split: refused as mixing

    def _derived_op(self, func: Any, args: tuple, kwargs: dict, out: Any, outs: list[torch.Tensor],
                    derived: dict[int, tuple[torch.Tensor, dict[str, list[tuple[int, Split]]]]]) -> None:
        """An op on parameters alone (and constants): where each parameter dim lies in its outputs."""
        merged: dict[int, dict[str, list[tuple[int, Split]]]] = {id(t): {} for t in outs}
        for tensor, params in derived.values():
            for param, dims in params.items():
                for output in merged.values():
                    output.setdefault(param, [])
                for dim, split in dims:
                    try:
                        found = follow_split(func, args, kwargs, out, {id(tensor): split})
                    except Exception:
                        continue  # that dim does not survive the op intact
                    for t in outs:
                        if id(t) in found:
                            merged[id(t)][param].append((dim, found[id(t)]))
        self.derived.update({id(t): (t, merged[id(t)]) for t in outs})


def _pop(stack: list[str]) -> None:
    stack.pop()


def follow_splits(model: nn.Module, inputs: tuple, local: set[str], split_modules: set[str],
                  stopped: set[str], dtype: torch.dtype | None = None) -> SplitFlow:
    """Run ``model(*inputs)`` on meta tensors (floating ones in ``dtype`` when given) and follow the
    outputs of the column-parallel modules in ``local`` (split over the axis). Ops inside
    ``split_modules`` (run by torch's styles) are not followed; the outputs of those not in
    ``local`` are whole. ``stopped``: parameters split by a style; every other parameter's uses
    are recorded by canonical name.

    >>> class Gated(nn.Module):  # a learnable scalar times split features
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.up, self.gate, self.down = nn.Linear(4, 8), nn.Parameter(torch.ones(())), nn.Linear(8, 4)
    ...     def forward(self, x):
    ...         return self.down(self.up(x) * self.gate)
    >>> follow_splits(Gated(), (torch.zeros(2, 4),), {"up"}, {"up", "down"}, {"up.weight", "up.bias", "down.weight"}).uses
    {'gate': [Use(kind='summed', op='mul', layer='up', dim=None, why='')]}
    """
    tensors = meta_tensors(model, dtype)
    follow = _Follow({id(t): n for n, t in tensors.items() if n not in stopped and t.requires_grad},
                     {id(tensors[n]) for n in stopped if n in tensors})
    meta_inputs = tuple(torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    follow.seed(tensors, meta_inputs)
    modules = dict(model.named_modules())
    handles = []

    def enter(_m: nn.Module, _a: tuple) -> None:
        follow.inside += 1

    def leave(_m: nn.Module, _a: tuple, out: Any, name: str) -> None:
        follow.inside -= 1
        if follow.inside or not isinstance(out, torch.Tensor):
            return
        if name in local and out.dim():
            follow.splits[id(out)] = (out, Split.of_output(out), name)
        else:
            follow.whole[id(out)] = out

    for name, module in modules.items():
        handles += [module.register_forward_pre_hook(lambda _m, _a, name=name: follow.running.append(name)),
                    module.register_forward_hook(lambda _m, _a, _o: _pop(follow.running))]
    for name in split_modules:
        handles += [modules[name].register_forward_pre_hook(enter),
                    modules[name].register_forward_hook(lambda m, a, out, name=name: leave(m, a, out, name))]
    try:
        with swapped(model, tensors), follow:
            model(*meta_inputs)
    except Exception:  # the model's own error: the other checks report it
        return SplitFlow(False)
    finally:
        for handle in handles:
            handle.remove()
    return SplitFlow(True, follow.mixing, follow.uses, follow.outside)


__all__ = ["MIXED", "SLICED", "SUMMED", "WHOLE", "SplitFlow", "Use", "follow_splits"]
