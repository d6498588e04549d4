"""Apply a Plan to a model with torch.distributed (``sk.shard``).

The order follows torchtitan's parallelize procedures, top to bottom:

1. resolve every parameter's layout (``resolve_layouts``: the per-parameter checks of
   ``Plan.validate``, which callers such as ``verify`` and ``shardkit train`` run in full
   before launch; a pipeline stage resolves only its own parameters);
2. model adapters (``shardkit.models.adapters``) check head counts and fix what TP styles
   cannot know (fused QKV);
3. tensor parallel per model axis: layouts -> torch TP styles (see ``tensor_parallel``);
4. context parallel on ``sp``: attention becomes ring attention (``context_parallel``);
5. data parallel: ``fully_shard`` over ``fsdp`` (HSDP with ``dp``); over ``dp`` alone, DDP
   (torch's composable ``replicate``, in place) or, with TP, mixed precision or a pipeline,
   FSDP2's ``replicate``; ``sp`` joins the gradient reduction;
6. the module's class gains ``step()`` and ``plan``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..plan import Plan, PlanError, param_shapes, resolve_layouts
from ..plan.layout import ParamLayout
from .tensor_parallel import apply_tensor_parallel, model_axes
from .world import Context, current_context

_SHARDED_CLASSES: dict[type, type] = {}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ShardedModule:
    """Mixed into a sharded model's class: one ``step`` for every plan.

    >>> loss = model.step(inputs, targets, loss_fn)   # doctest: +SKIP
    """

    _sk_plan: Plan

    @property
    def plan(self) -> Plan:
        return self._sk_plan

    def step(self, inputs: Any, targets: Any, loss_fn) -> torch.Tensor:
        """Forward and backward on this rank's batch; returns the loss averaged over all ranks."""
        loss = loss_fn(self(inputs), targets)
        loss.backward()
        return mean_over_world(loss.detach())


def mean_over_world(value: torch.Tensor) -> torch.Tensor:
    """Average a scalar over every rank (model-axis ranks hold equal values, so this is the data mean)."""
    value = value.clone().float()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value


def as_sharded(module: nn.Module, plan: Plan) -> nn.Module:
    """Give ``module`` the ``ShardedModule`` methods (a class swap, as FSDP2 does)."""
    cls = type(module)
    if not isinstance(module, ShardedModule):
        if cls not in _SHARDED_CLASSES:
            _SHARDED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {})
        module.__class__ = _SHARDED_CLASSES[cls]
    module._sk_plan = plan
    return module


def shard(model: nn.Module, plan: Plan, ctx: Context | None = None) -> nn.Module:
    """Split ``model`` as ``plan`` says, in this process of a launched world; returns the same module.

    The model takes and returns ordinary tensors; it gains ``model.step(inputs, targets,
    loss_fn)`` and ``model.plan``. Call it inside a function run by ``sk.launch``.

    >>> def work(ctx):                                    # doctest: +SKIP
    ...     model = sk.shard(build_model(), plan)
    ...     loss = model.step(x, y, loss_fn)
    """
    ctx = ctx or current_context()
    plan = plan.resolved(ctx.world_size)
    if plan.pipeline is not None:
        from .pipeline import build_pipeline

        return build_pipeline(model, plan, ctx)
    return as_sharded(parallelize(model, plan, ctx), plan)


def _mesh_for(plan: Plan, ctx: Context):
    if plan.replicas is not None:
        from .groups import grouped_device_mesh

        return grouped_device_mesh(plan, ctx.device.type)
    return ctx.mesh


def parallelize(module: nn.Module, plan: Plan, ctx: Context) -> nn.Module:
    """Apply tensor, context and data parallelism (not pipeline stages) to ``module`` in place."""
    plan = plan.resolved(ctx.world_size)
    mesh_spec = plan.mesh
    layouts = resolve_layouts(param_shapes(module), plan.rules, mesh_spec).params
    if any(p.device.type == "meta" for p in module.parameters()):
        raise PlanError("sk.shard got a model on the meta device; build it on a real device (the plan is validated "
                        "on meta, but sharding needs the weights)")
    module.to(ctx.device)
    mesh = _mesh_for(plan, ctx)
    permutations: dict = {}
    for axis in model_axes(mesh_spec.names):
        size = mesh_spec[axis]
        if size == 1:
            continue
        permutations.update(_adapt(module, size, ctx.mesh[axis].get_local_rank()))
        apply_tensor_parallel(module, layouts, mesh, axis, sequence_parallel=plan.sequence_parallel)
    if mesh_spec.size_of("sp") > 1:
        from .context_parallel import enable_context_parallel

        enable_context_parallel(module, mesh["sp"])
    _apply_data_parallel(module, plan, mesh, layouts)
    module._sk_permutations = permutations  # read by full_state_dict / full_grads
    return module


def _adapt(module: nn.Module, size: int, rank: int) -> dict:
    from ..models.adapters import adapt_for_tensor_parallel, tensor_parallel_problems

    problems = tensor_parallel_problems(module, size)
    if problems:
        raise PlanError(problems)
    return adapt_for_tensor_parallel(module, size, rank)


def _blocks(module: nn.Module) -> list[nn.Module]:
    """Units FSDP wraps on their own: the children of every ModuleList (transformer layers)."""
    return [child for m in module.modules() if isinstance(m, nn.ModuleList) for child in m]


def _data_mesh(plan: Plan, mesh):
    """(mesh for FSDP2 / DDP, shards?) from the data axes; ``sp`` joins the gradient reduction.

    Sliced dims must be in mesh order, and HSDP's replicate dim (``dp``) comes first
    (``Plan.validate`` checks that ``dp`` precedes ``fsdp``).
    """
    m = plan.mesh
    replicate = ["dp_replica"] if plan.replicas is not None else (["dp"] if m.size_of("dp") > 1 else [])
    others = sorted((a for a in ("fsdp", "sp") if m.size_of(a) > 1), key=mesh.mesh_dim_names.index)
    if m.size_of("fsdp") > 1:
        if len(others) == 1:
            return mesh[(*replicate, others[0])], True
        flat = mesh[tuple(others)]._flatten("_".join(others))
        if not replicate:
            return flat, True
        with warnings.catch_warnings():  # torch has no other way yet to pair a flattened dim with dp
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return mesh[(*replicate, flat.mesh_dim_names[0])], True
    replicate = sorted(replicate + others, key=mesh.mesh_dim_names.index)
    if not replicate:
        return None, False
    if len(replicate) == 1:
        return mesh[replicate[0]], False
    return mesh[tuple(replicate)]._flatten("_".join(replicate)), False


def _apply_data_parallel(module: nn.Module, plan: Plan, mesh, layouts: dict[str, ParamLayout]) -> None:
    data_mesh, sharded = _data_mesh(plan, mesh)
    if data_mesh is None:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    opts = plan.fsdp
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES.get(opts.param_dtype or ""),
                              reduce_dtype=_DTYPES.get(opts.reduce_dtype or ""))
    if not sharded:
        if (plan.pipeline is not None or opts.param_dtype or opts.reduce_dtype
                or any(isinstance(p, DTensor) for p in module.parameters())):
            # FSDP2's replicate composes with tensor parallel (DTensor parameters), mixed precision and
            # pipeline schedules (several forwards per backward, which DDP's reducer does not allow).
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(module, mesh=data_mesh, mp_policy=mp)
        else:
            # Plain replication: DDP itself (bucketed all-reduce overlapped with backward), applied in place.
            from torch.distributed._composable import replicate

            replicate(module, device_mesh=data_mesh)
        return
    by_param = {id(p): layouts.get(n) for n, p in module.named_parameters()}

    def placement(param: nn.Parameter) -> Shard:
        lay = by_param.get(id(param))
        dim = None if lay is None else lay.axis_dim("fsdp")
        return Shard(dim or 0)

    kwargs = dict(mesh=data_mesh, reshard_after_forward=opts.reshard_after_forward, mp_policy=mp,
                  shard_placement_fn=placement)
    for block in _blocks(module):
        fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _unpermute(module: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    perm = getattr(module, "_sk_permutations", {}).get(name)
    if perm is None:
        return t
    dim, index = perm
    return t.index_select(dim, torch.argsort(index.to(t.device)))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{dotted name: full tensor}`` of the parameters this rank holds (a collective on sharded ones).

    Every rank of a sharding group must call it. Adapter permutations are undone, so the
    names and values match the unsharded model.
    """
    return {n: _unpermute(model, n, _full(p)).cpu() for n, p in model.named_parameters()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{dotted name: full gradient}`` like :func:`full_state_dict` (zeros where a grad is None)."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = torch.zeros(p.shape) if g is None else _unpermute(model, n, _full(g)).cpu()
    return out
