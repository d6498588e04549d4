"""What one training step costs one rank: bytes by component and the collectives it issues
(``sk.dry_run``; the same tracker on a real run is the dry run's test).

Memory: torch's ``FSDPMemTracker`` (``torch.distributed._tools``; ``MemTracker`` for a model
with no FSDP2), a dispatch mode that follows every tensor's storage, fake or real, and files it
as a parameter, gradient, optimizer state, FSDP2's gathered copies and communication buffers, an
activation (made in the forward, or in recompute) or a temporary (made in the backward). What it
lacks and :class:`_ComponentPeaks` adds: the peak of each component on its own (torch keeps the
total's peak and the split at that moment). Components (:data:`COMPONENTS`), in the words of
``sk.estimate``: ``parameters``, ``gradients``, ``optimizer`` at the step's end; ``gathered``,
``activations``, ``temporaries`` at their own peaks; ``peak``: the most bytes live at once.

Nothing of a step outlives it: torch's ``ModTracker`` (the trackers' module tracking) hooks the
gradients of every module's inputs with hooks that hold those inputs' autograd nodes, stored on the
nodes, a chain of cycles through C++ that Python's collector frees one node per full collection; the
step's graph kept the plan's meshes alive past a real world's job, and with FSDP2 the model too
(``runtime/meshes.py``'s ``release_unused`` could not free them). The tracker's hooks are removed when
it exits (:func:`_mod_tracker`; ``tests/test_mesh_release.py``).

Collectives: :class:`CollectiveLog`, a dispatch mode like :class:`~shardkit.observe.comm.CommCounter`
(the same op table and byte convention: the payload this rank hands to the op) that also names
each call's group by the mesh axes its ranks span.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..plan import Mesh
from .comm import _OPS, _group, payload_bytes

#: component -> the tracker's categories (``_MemRefType`` / ``_FSDPRefType`` member names) it sums
COMPONENTS: dict[str, tuple[str, ...]] = {
    "parameters": ("PARAM", "SHARDED_PARAM"),
    "gradients": ("GRAD", "SHARDED_GRAD"),
    "optimizer": ("OPT",),
    "gathered": ("UNSHARDED_PARAM", "UNSHARDED_GRAD", "ALL_GATHER", "REDUCE_SCATTER"),
    "activations": ("ACT",),
    "temporaries": ("TEMP",),
    "other": ("BUFFER", "INP", "OTH"),
}
_PART = {kind: part for part, kinds in COMPONENTS.items() for kind in kinds}
#: components read at the step's end (the state a rank keeps); the others at their own peak
STATE = ("parameters", "gradients", "optimizer")


def _by_component(snapshot: dict[Any, int]) -> dict[str, int]:
    names = {getattr(key, "name", key): size for key, size in snapshot.items()}
    return {part: sum(names.get(c, 0) for c in kinds) for part, kinds in COMPONENTS.items()}


def _buffer_kind(tracker: Any) -> Any:
    """The tracker's category for a buffer (``BUFFER`` of its own reference types)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed._tools.mem_tracker import _MemRefType

    return _FSDPRefType.BUFFER if isinstance(tracker, FSDPMemTracker) else _MemRefType.BUFFER


def _temporary_kind() -> Any:
    from torch.distributed._tools.mem_tracker import _MemRefType

    return _MemRefType.TEMP


def _gathered_kind() -> Any:
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    return _FSDPRefType.ALL_GATHER


def _unsharded_grad() -> Any:
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    return _FSDPRefType.UNSHARDED_GRAD


def _tracker(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
    """torch's memory tracker for ``model``, with each component's own peak recorded."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    base = FSDPMemTracker if isinstance(model, FSDPModule) else MemTracker

    class _ComponentPeaks(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__(model, optimizer) if base is FSDPMemTracker else super().__init__()
            self._mod_tracker = _mod_tracker()  # its gradient hooks removed when it exits (see there)
            self.component_peaks: dict[str, int] = dict.fromkeys(COMPONENTS, 0)
            self._part_of: dict[Any, str | None] = {}  # the tracker's category -> its component
            self._gloo_inputs: list[tuple[tuple[int, ...], torch.dtype]] = []  # see _gloo_reduce_scatter_inputs
            self._unsharding = False  # inside FSDP2's pre-forward or pre-backward (see _track)
            self.bucket_stand_ins: list[torch.Tensor] = []  # see StepCost(buckets=...)
            self._func: Any = None  # the op being tracked

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self._func = func
            if self._gloo_inputs and func is torch.ops.aten.split.Tensor and self._gloo_buffer(args[0]):
                return func(*args, **(kwargs or {}))  # a chunk of gloo's copy of a reduce-scatter's input
            res = super().__torch_dispatch__(func, types, args, kwargs)
            if res is not NotImplemented:
                self._gloo_inputs += _gloo_reduce_scatter_inputs(func, args)
            return res

        def _gloo_buffer(self, tensor: torch.Tensor) -> bool:
            """Whether ``tensor`` is gloo's copy of a pending reduce-scatter's input (a storage the
            tracker never saw, of that input's shape and dtype), which is then left untracked."""
            key = (tuple(tensor.shape), tensor.dtype)
            if key not in self._gloo_inputs or tensor.untyped_storage() in self._WINFO:
                return False
            self._gloo_inputs.remove(key)
            return True

        def _update_peak_stats(self, peak_state: Any) -> None:
            # the device's peak and each component's, after every op; torch's own also updates every
            # module's peak, which the dry run does not read and which doubles its time
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot["Total"]:
                    self._peak_mem[device] = snapshot["Total"]
                    self._peak_mem_snap[device] = dict(snapshot)
                sizes = dict.fromkeys(COMPONENTS, 0)
                for key, size in snapshot.items():
                    if key not in self._part_of:
                        self._part_of[key] = _PART.get(getattr(key, "name", key))
                    part = self._part_of[key]
                    if part is not None:
                        sizes[part] += size
                peaks = self.component_peaks
                for part, size in sizes.items():
                    if size > peaks[part]:
                        peaks[part] = size

        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            # a pipeline stage's module runs once per micro-batch before its backward, which torch's
            # MemTracker takes for a root module called in the next iteration and refuses ("does not
            # support memory tracking for multiple iterative calls"): each call is tracked as a new one
            # (only the per-module statistics, which nothing here reads, start again)
            if base is MemTracker and module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def _track(self, reftype: Any, tensor: torch.Tensor) -> None:
            # FSDP2 unshards in its pre-forward and pre-backward hooks: the all-gather's output, its inputs
            # cast to the compute dtype, the unsharded parameters copied out of it. torch's tracker files
            # them as activations (temporaries in the backward) until the all-gather is issued or the hook
            # returns, so the op that made one counted it there (an activation peak of one micro-batch's
            # activations and a block's all-gather output, under accumulation). They are FSDP2's, "gathered"
            # (``sk.estimate`` counts them so), from their allocation
            if self._unsharding and reftype.name in ("ACT", "TEMP") and not self._in_ac:
                reftype = _gathered_kind()
            if self.bucket_stand_ins and getattr(self._func, "_schema", None) is not None \
                    and self._func._schema.is_mutable:  # DDP writes a gradient into its bucket (copy_, mul.out)
                self._bucket_found(tensor)
            super()._track(reftype, tensor)

        def _bucket_found(self, tensor: torch.Tensor) -> None:
            """DDP's first write of a gradient into a bucket the tracker never saw: the bucket's stand-in,
            counted since the step began, is dropped (the bucket is filed as the stand-in was)."""
            storage = tensor.untyped_storage()
            if storage in self._WINFO:
                return
            for i, stand_in in enumerate(self.bucket_stand_ins):
                if stand_in.untyped_storage().nbytes() == storage.nbytes():
                    del self.bucket_stand_ins[i]
                    return

        def _unsharding_in(self, inner: Any) -> Any:
            def unsharding(*args: Any, **kwargs: Any) -> Any:
                self._unsharding = True
                try:
                    return inner(*args, **kwargs)
                finally:
                    self._unsharding = False
            return unsharding

        def _fsdp_state_pre_forward(self, fsdp_mod: Any, orig: Any) -> Any:
            return self._unsharding_in(super()._fsdp_state_pre_forward(fsdp_mod, orig))

        def _fsdp_param_group_pre_backward(self, fsdp_mod: Any, orig: Any) -> Any:
            return self._unsharding_in(super()._fsdp_param_group_pre_backward(fsdp_mod, orig))

        def _fsdp_param_group_post_backward(self, fsdp_mod: Any, orig: Any) -> Any:
            # FSDP2 keeps the gradients it accumulates without a reduce-scatter (a pipeline's
            # micro-batches) in the reduce dtype as ``unsharded_accumulated_grad``, which torch's
            # tracker leaves filed as temporaries: they are unsharded gradients, "gathered"
            inner = super()._fsdp_param_group_post_backward(fsdp_mod, orig)

            def refiled(*args: Any, **kwargs: Any) -> None:
                inner(*args, **kwargs)
                group = fsdp_mod._get_fsdp_state()._fsdp_param_group
                for param in group.fsdp_params if group else ():
                    if param.unsharded_accumulated_grad is not None:
                        self._update_and_maybe_create_winfos(param.unsharded_accumulated_grad, _unsharded_grad(),
                                                             update_existing=True)
            return refiled

    tracker = _ComponentPeaks()
    if base is MemTracker:
        tracker.track_external(model, *([optimizer] if optimizer is not None else []))
    return tracker


def _mod_tracker() -> Any:
    """torch's ``ModTracker`` (which module runs, for the memory trackers), whose gradient hooks are
    removed when it exits.

    Why: in each module's forward it hooks the gradients of the module's inputs and outputs by
    ``register_multi_grad_hook`` and keeps no handle. On inputs (``mode="all"``) that hook's closure
    holds the inputs' autograd nodes (``grad_fns``), and the hook is stored on those nodes in C++: each
    hooked node is a cycle through C++ that outlives the step's backward. Python's collector frees such
    a cycle only when nothing else holds the node, and the next node of the graph does (its edge): one
    full collection frees one node, the last of the chain, so the step's graph outlives many. The
    graph's DTensor nodes hold the plan's meshes, and the hook dicts of FSDP2's modules' outputs hold its
    ``FSDPState``, hence the model: after a measured step in a real world (``tests/test_dry_run.py``) the
    model and its meshes stayed alive past the job, which ``runtime/meshes.py``'s ``release_unused``
    (one collection) could not free (``tests/test_mesh_release.py``). The hooks it adds during a
    forward are noted per tensor (the keys new in the tensor's hook dict, the one its node holds) and
    removed once the tracker exits, after the step's backward: the graph is then freed by reference
    counting when the step lets go of it."""
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.utils._pytree import tree_flatten

    class _UnhookedModTracker(ModTracker):
        def __init__(self) -> None:
            super().__init__()
            self._added: list[tuple[dict, list[int]]] = []  # a tensor's hook dict, the keys this tracker added

        def _noting_hooks(self, hook: Any, values: Any, *args: Any) -> None:
            tensors = [t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)]
            before = [set(t._backward_hooks or ()) for t in tensors]
            hook(*args)
            for tensor, keys in zip(tensors, before, strict=True):
                hooks = tensor._backward_hooks
                if hooks is not None and len(hooks) > len(keys):
                    self._added.append((hooks, [k for k in hooks if k not in keys]))

        def _fw_pre_hook(self, mod: nn.Module, input: Any) -> None:
            self._noting_hooks(super()._fw_pre_hook, input, mod, input)

        def _fw_post_hook(self, mod: nn.Module, input: Any, output: Any) -> None:
            self._noting_hooks(super()._fw_post_hook, output, mod, input, output)

        def __exit__(self, *args: Any) -> None:
            super().__exit__(*args)
            for hooks, keys in self._added:
                for key in keys:
                    hooks.pop(key, None)
            self._added.clear()

    return _UnhookedModTracker()


def _refile_gradients(tracker: Any, model: nn.Module) -> None:
    """File what each parameter holds as its ``.grad`` at the step's end as a gradient. torch's
    ``MemTracker`` files a gradient when autograd accumulates it; a gradient set after the
    backward is filed by the op that made it (an activation outside the backward): a pipeline's
    tied copies' (``runtime/pipeline_ties.py`` lays a vocab-split embedding's whole gradient out
    as the rank's rows, a copy, at the step's end). FSDP2's tracker files its sharded gradients."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _MemRefType

    if isinstance(tracker, FSDPMemTracker):
        return
    for param in model.parameters():
        if param.grad is not None:
            tracker._update_and_maybe_create_winfos(param.grad, _MemRefType.GRAD)


#: reduce-scatter ops that take a whole input tensor (or a list of them): their kind in ``comm._OPS``
_REDUCE_SCATTER_KINDS = ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced")


def _gloo_reduce_scatter_inputs(func: Any, args: tuple) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The (shape, dtype) of each input of a reduce-scatter ``func`` issued on a gloo group, else none.

    gloo reduce-scatters by all-reducing a copy of the whole input, made inside the op where the
    tracker does not see it (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``: ``input.clone()``),
    then copies this rank's chunk of it into the output when the call is waited on: the tracker
    first sees that copy there, at the chunk (``aten.split``), and would count it live until the
    call is freed, beside the input. NCCL, and the dry run's fake process group, write the output
    directly, with no copy; so a real gloo world's step measures what a GPU's would, the copy is
    left untracked (:meth:`_ComponentPeaks._gloo_buffer`). Counted, it raises a real gloo run's
    peak above the dry run's where the peak falls on a reduce-scatter: the root's float32
    gradients under bfloat16 compute (``tests/test_dry_run.py``, docs/dry-run.md)."""
    import torch.distributed as dist

    kind = _OPS.get(getattr(func, "namespace", ""), {}).get(getattr(func, "_opname", ""))
    if kind is None or kind[0] not in _REDUCE_SCATTER_KINDS or dist.get_backend(_group(_group_arg(args))) != "gloo":
        return []
    inputs = args[kind[1]]
    return [(tuple(t.shape), t.dtype) for t in (inputs if isinstance(inputs, (list, tuple)) else [inputs])]


@dataclass(frozen=True)
class Collective:
    """Calls of one collective ``kind`` on the group spanning mesh ``axes``, and their payload bytes."""

    kind: str
    axes: tuple[str, ...]
    calls: int
    bytes: int


def _group_arg(args: tuple) -> Any:
    """The group an op names: a boxed ProcessGroup (``c10d`` ops; their reduce op is boxed too),
    or the last string (functional ops: ``group_name`` comes after a reduce op's name)."""
    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in a._type().qualified_name():
            return a
    names = [a for a in args if isinstance(a, str)]
    return names[-1] if names else None


class CollectiveLog(TorchDispatchMode):
    """Every collective this process issues while entered, by kind and group (the mesh axes its
    ranks span; ``("world",)`` without a mesh), with calls and payload bytes.

    >>> with CollectiveLog(Mesh(fsdp=2, tp=2)) as log:     # doctest: +SKIP
    ...     model.step(x, y, loss_fn)
    >>> log.collectives()                                  # doctest: +SKIP
    [Collective(kind='all_gather_into_tensor', axes=('fsdp',), calls=6, bytes=...), ...]
    """

    def __init__(self, mesh: Mesh | None = None) -> None:
        super().__init__()
        from torch.distributed.tensor import DTensor

        self._dtensor = DTensor
        self._mesh = mesh
        self._counts: dict[tuple[str, tuple[str, ...]], list[int]] = {}
        self._axes: dict[Any, tuple[str, ...]] = {}

    def _axes_of(self, group: Any) -> tuple[str, ...]:
        import torch.distributed as dist

        pg = _group(group) or dist.group.WORLD
        if pg not in self._axes:
            ranks = dist.get_process_group_ranks(pg)
            if self._mesh is None:
                self._axes[pg] = ("world",) if len(ranks) == dist.get_world_size() else (f"{len(ranks)} ranks",)
            else:
                coords = [self._mesh.coordinates(r) for r in ranks]
                self._axes[pg] = tuple(a for a in self._mesh.names if len({c[a] for c in coords}) > 1)
        return self._axes[pg]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented  # DTensor lowers the op; its collectives come back through this mode
        kwargs = kwargs or {}
        kind = _OPS.get(getattr(func, "namespace", ""), {}).get(getattr(func, "_opname", ""))
        if kind is not None:
            name, index = kind
            entry = self._counts.setdefault((name, self._axes_of(_group_arg(args))), [0, 0])
            entry[0] += 1
            if index is not None:
                entry[1] += payload_bytes(args[index] if index < len(args) else None)
        return func(*args, **kwargs)

    def collectives(self) -> list[Collective]:
        """The calls by (kind, axes), sorted."""
        return [Collective(kind, axes, calls, size) for (kind, axes), (calls, size) in sorted(self._counts.items())]


class StepCost:
    """Bytes by component (:data:`COMPONENTS`) and collectives of what runs while entered, on
    ``model`` and ``optimizer`` (fake tensors or real ones).

    ``accumulate``: the micro-steps of the step (``model.step(..., accumulate=k)``). ``buffers``: tensors
    made before the step that it reuses (a pipeline's receive buffers), filed as ``other`` from the start.
    ``buckets``: stand-ins of DDP's gradient buckets (tensors of their sizes: DDP keeps its own out of
    reach), temporaries from the start: DDP makes its buckets with itself and keeps them (a real 2-process
    run's buckets outlive each step, docs/benchmarks.md), where the tracker would first see each at the
    backward's first write into it; then the bucket replaces its stand-in.

    >>> with StepCost(model, optimizer, plan.mesh) as cost:      # doctest: +SKIP
    ...     model.step(x, y, loss_fn); optimizer.step()
    >>> cost.memory()["activations"], cost.collectives()         # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, mesh: Mesh | None = None,
                 accumulate: int = 1, buffers: Sequence[torch.Tensor] = (),
                 buckets: Sequence[torch.Tensor] = ()) -> None:
        self._model, self._accumulate = model, accumulate
        self._tracker = _tracker(model, optimizer)
        self._log = CollectiveLog(mesh)
        self._buffers = list(buffers)
        self._tracker.bucket_stand_ins = list(buckets)
        self._end: dict[str, int] = {}
        self._peak = 0
        self._handle: Any = None

    def __enter__(self) -> StepCost:
        # torch's trackers refuse a second forward of the root in one tracked step ("multiple iterative
        # calls"), as gradient accumulation (``accumulate`` > 1, no pipeline) runs: each forward of it
        # starts the modules' own stats afresh (``reset_mod_stats``), which the step's bytes are not
        # read from. A global hook, registered before the tracker's, runs before its module hooks.
        def fresh_module_stats(module: nn.Module, args: Any) -> None:
            if module is self._model:
                self._tracker.reset_mod_stats()

        if self._accumulate > 1:
            self._handle = torch.nn.modules.module.register_module_forward_pre_hook(fresh_module_stats)
        self._tracker.__enter__()
        # tensors made before the step that it reuses (a pipeline's receive buffers): "other" from the start,
        # not an activation when the step first writes them
        for tensor in self._buffers:
            self._tracker._update_and_maybe_create_winfos(tensor, _buffer_kind(self._tracker))
        for tensor in self._tracker.bucket_stand_ins:
            self._tracker._update_and_maybe_create_winfos(tensor, _temporary_kind())
        self._log.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
        self._log.__exit__(*exc)
        _refile_gradients(self._tracker, self._model)
        current = self._tracker.get_tracker_snapshot("current")
        self._end = _by_component(next(iter(current.values()), {}))
        self._peak = max((snap.get("Total", 0) for snap in self._tracker.get_tracker_snapshot("peak").values()),
                         default=0)
        self._tracker.__exit__(*exc)

    def memory(self) -> dict[str, int]:
        """``{component: bytes}`` (state at the step's end, the rest at their own peaks) and ``peak``."""
        peaks = self._tracker.component_peaks
        out = {part: self._end.get(part, 0) if part in STATE else peaks.get(part, 0) for part in COMPONENTS}
        return {**out, "peak": self._peak}

    def collectives(self) -> list[Collective]:
        return self._log.collectives()


__all__ = ["COMPONENTS", "Collective", "CollectiveLog", "STATE", "StepCost"]
