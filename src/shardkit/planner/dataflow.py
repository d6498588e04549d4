"""What a model's forward and backward do, seen on the meta device (no memory, no compute).

:func:`trace` runs one forward and backward of an example input with every parameter and
buffer replaced by a meta tensor (:func:`shardkit.families.on_meta.run_on_meta`) and records:

- how many times each module runs (a module shared by two blocks runs twice);
- how the outputs of watched modules are cut along their last dim: a ``chunk``, ``split``,
  ``narrow``, ``unbind`` or slice there shows a *packed* projection (several outputs side by
  side in one matrix, like Phi-3's ``gate_up_proj`` or GPT-2's ``c_attn``), which a plain
  column split would hand out wrongly; and whether they are changed in place (Falcon's
  ``mlp_output += attention_output``), which autograd forbids on the views torch's
  tensor-parallel styles return;
- which parameters get no gradient (unused in the forward: DDP's reducer breaks on them);
- which modules normalise with statistics of the batch (:class:`~shardkit.planner.batch_stats.BatchNormWatch`),
  so ``sk.validate`` needs no forward of its own for them.

Where a split lies through each op is :mod:`shardkit.planner.split_ops`'.

torch has no such analysis for eager modules (``torch.export`` needs a traceable model and
real shapes; HF models often break it), so this is a ``TorchFunctionMode`` over the eager run.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..families.on_meta import META_FALLBACK_DTYPE, meta_tensors, module_stack, run_on_meta
from .batch_stats import BatchNormWatch

#: Functions that cut a tensor into pieces along a dim, with how to find that dim.
_CUTS = {
    torch.Tensor.chunk: "chunk", torch.chunk: "chunk", torch.Tensor.split: "split", torch.split: "split",
    torch.Tensor.split_with_sizes: "split", torch.Tensor.tensor_split: "split", torch.tensor_split: "split",
    torch.Tensor.unbind: "unbind", torch.unbind: "unbind", torch.Tensor.narrow: "narrow", torch.narrow: "narrow",
    torch.Tensor.__getitem__: "index",
}


@dataclass(frozen=True)
class Cut:
    """How a watched output was cut along its last dim: ``"chunk"`` into ``parts`` equal pieces (a
    shard's chunks are then its parts, in order); ``"split"`` into ``parts`` equal pieces of a size
    the code holds (right on a shard only if that size is made local); ``"slice"``: offsets or
    sizes the code computes (split sizes, slices, narrows), wrong on a shard's narrower output."""

    kind: str
    parts: int


@dataclass
class Dataflow:
    """What :func:`trace` saw. ``ran`` is ``False`` when no example input was known. ``modified``:
    watched modules whose output the forward changes in place (``out += x``). ``dtype``: the
    floating dtype of the stand-ins it ran with (``None``: the model's own; else
    :data:`~shardkit.families.on_meta.META_FALLBACK_DTYPE`, where a meta kernel needs it).
    ``batch_norms``: the modules that called ``batch_norm`` in training mode, when it ran in the
    model's own dtype (else ``None``: :func:`~shardkit.planner.batch_stats.batch_statistics` finds them)."""

    ran: bool
    calls: dict[str, int] = field(default_factory=dict)
    cuts: dict[str, Cut] = field(default_factory=dict)
    modified: set[str] = field(default_factory=set)
    unused: list[str] = field(default_factory=list)
    error: str | None = None
    dtype: torch.dtype | None = None
    batch_norms: tuple[str, ...] | None = None


class _CutWatcher(TorchFunctionMode):
    def __init__(self, outputs: dict[int, tuple[str, torch.Tensor]]):
        super().__init__()
        self.outputs = outputs  # id(output tensor) -> (module name, the tensor: kept alive so no other reuses the id)
        self.cuts: dict[str, Cut] = {}
        self.modified: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.outputs:
            name = self.outputs[id(args[0])][0]
            kind = _CUTS.get(func)
            cut = None if kind is None else _cut_of(kind, args, kwargs)
            if cut is not None:
                self.cuts.setdefault(name, cut)
            if is_in_place(func):
                self.modified.add(name)
        return func(*args, **kwargs)


def is_in_place(func: Any) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``__iadd__``, ...)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("_")) or (name.startswith("__i") and name.endswith("__"))


def _cut_of(kind: str, args: tuple, kwargs: dict) -> Cut | None:
    """The cut a call makes along the last dim of ``args[0]``, or ``None`` when it cuts elsewhere."""
    tensor = args[0]
    if kind == "index":
        return _index_cut(tensor, args[1])
    position = 2 if kind in ("chunk", "split") else 1
    dim = kwargs.get("dim", args[position] if len(args) > position else 0)
    if not isinstance(dim, int) or dim % tensor.dim() != tensor.dim() - 1:
        return None
    width = tensor.shape[-1]
    if kind == "chunk":
        chunks = int(kwargs.get("chunks", args[1] if len(args) > 1 else 1))
        return Cut("chunk", chunks) if width % chunks == 0 else Cut("slice", chunks)
    if kind == "split":
        sizes = args[1] if len(args) > 1 else next(iter(v for k, v in kwargs.items() if k != "dim"), None)
        if isinstance(sizes, int) and sizes and width % sizes == 0:
            return Cut("split", width // sizes)
        return Cut("slice", len(sizes) if isinstance(sizes, (list, tuple)) else 0)
    return Cut("slice", 0)


def _index_cut(tensor: torch.Tensor, index: Any) -> Cut | None:
    index = index if isinstance(index, tuple) else (index,)
    if any(i is None or isinstance(i, torch.Tensor) for i in index):
        return None  # new axes or advanced indexing: not a plain cut of the last dim
    if Ellipsis in index:
        position = index.index(Ellipsis)
        after = index[position + 1:]
        entry = after[-1] if after else None
        touches_last = bool(after)
    else:
        touches_last = len(index) == tensor.dim()
        entry = index[-1] if touches_last else None
    if not touches_last:
        return None
    if isinstance(entry, slice) and entry == slice(None):
        return None
    return Cut("slice", 0)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif hasattr(value, "to_tuple"):  # transformers' ModelOutput
        yield from _tensors(value.to_tuple())


@contextmanager
def _hooks(model: nn.Module, calls: dict[str, int], outputs: dict[int, tuple[str, torch.Tensor]],
           watch: Collection[str]) -> Iterator[None]:
    handles = []
    for name, module in model.named_modules(remove_duplicate=False):
        def post(_m: nn.Module, _a: tuple, out: Any, name: str = name) -> None:
            calls[name] = calls.get(name, 0) + 1
            if name in watch and isinstance(out, torch.Tensor):
                outputs[id(out)] = (name, out)

        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def trace(model: nn.Module, example_inputs: tuple | None, watch: Collection[str] = ()) -> Dataflow:
    """Run one forward and backward of ``example_inputs`` on meta tensors; see the module docstring.

    >>> net = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2), nn.Linear(2, 2))
    >>> flow = trace(net, (torch.zeros(1, 4),))
    >>> flow.calls["0"], flow.unused
    (1, [])
    """
    if example_inputs is None:
        return Dataflow(ran=False)
    error = ""
    for dtype in (None, META_FALLBACK_DTYPE):
        calls: dict[str, int] = {}
        outputs: dict[int, tuple[str, torch.Tensor]] = {}
        tensors = meta_tensors(model, dtype)
        watcher, stack = _CutWatcher(outputs), list[str]()
        norms = BatchNormWatch(stack, lenient=False)
        try:
            with _hooks(model, calls, outputs, set(watch)), module_stack(model, stack), watcher, norms:
                output = run_on_meta(model, tensors, example_inputs)
            grads = [t for t in _tensors(output) if t.requires_grad and t.is_floating_point()]
            if grads:
                torch.autograd.backward([g.float().sum() for g in grads])
        except Exception as exc:  # the model's own error, reported by the caller with context
            error = error or f"{type(exc).__name__}: {exc}"
            continue
        unused = [name for name, _ in model.named_parameters() if tensors[name].grad is None]
        return Dataflow(ran=True, calls=calls, cuts=watcher.cuts, modified=watcher.modified, unused=unused,
                        dtype=dtype, batch_norms=tuple(norms.found) if dtype is None else None)
    return Dataflow(ran=False, calls=calls, error=error)

__all__ = ["Cut", "Dataflow", "is_in_place", "trace"]
