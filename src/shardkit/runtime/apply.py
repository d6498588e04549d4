"""Apply a Plan to a model with torch.distributed (``sk.shard``).

The order follows torchtitan's parallelize procedures, top to bottom:

1. validate: ``sk.validate(plan, model)``, the same checks as before launch, so a plan passed
   straight to ``sk.launch`` + ``sk.shard`` fails with the same :class:`PlanError` before any
   weight moves; it also plans every model axis (:mod:`shardkit.planner.tensor_parallel`);
2. pipelines cut this rank's stage(s) first (:mod:`shardkit.runtime.pipeline`), which then
   run steps 3-6 on the stage;
3. tensor parallel per model axis: family attribute changes, packed projections permuted,
   torch's styles, ties re-tied (:mod:`shardkit.runtime.tensor_parallel`); tensor parallel
   needs whole weights, so it comes before data parallel;
4. context parallel on ``sp``: attention becomes ring attention (``context_parallel``);
5. data parallel over :meth:`Meshes.data`: ``fully_shard`` over ``fsdp`` (HSDP with ``dp``),
   each block on its own unless it shares parameters with the rest of the model; over ``dp``
   alone, DDP (torch's composable ``replicate``, in place) when every parameter is used and
   nothing else is asked, else FSDP2's ``replicate`` (tensor parallel, mixed precision,
   pipelines, or parameters the forward never uses, on which DDP's reducer fails); ``sp``
   joins the gradient reduction. Mixed precision applies to every plan: with no data axis
   the reduction runs over a ``dp`` dim of size 1;
6. the module's class gains ``step()`` and ``plan``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..plan import Plan, PlanWarning, UsageError
from ..plan.layout import ParamLayout
from ..planner.model_checks import ModelFacts
from ..planner.validate import validate
from .meshes import DataMesh, meshes_for
from .precision import Precision
from .tensor_parallel import apply_tensor_parallel
from .world import Context, current_context


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


_MIXINS: dict[tuple[type, type], type] = {}


def with_mixin(module: nn.Module, mixin: type, prefix: str) -> nn.Module:
    """Give ``module`` the methods of ``mixin`` by swapping its class (as FSDP2 does), once per class.

    >>> m = with_mixin(nn.Linear(2, 2), ShardedModule, "Sharded")
    >>> type(m).__name__, isinstance(m, nn.Linear)
    ('ShardedLinear', True)
    """
    cls = type(module)
    if isinstance(module, mixin):
        return module
    if (cls, mixin) not in _MIXINS:
        _MIXINS[cls, mixin] = type(f"{prefix}{cls.__name__}", (mixin, cls), {})
    module.__class__ = _MIXINS[cls, mixin]
    return module


def shard(model: nn.Module, plan: Plan, ctx: Context | None = None, *, example_inputs: tuple | None = None
          ) -> nn.Module:
    """Split ``model`` as ``plan`` says, in this process of a launched world; returns the same module.

    Runs ``sk.validate`` first (the same :class:`PlanError` as before launch). The model takes
    and returns ordinary tensors; it gains ``model.step(inputs, targets, loss_fn)`` and
    ``model.plan``. Call it inside a function run by ``sk.launch``. ``example_inputs``: one
    micro-batch, for models whose family shardkit does not know (see ``sk.validate``).

    >>> def work(ctx):                                    # doctest: +SKIP
    ...     model = sk.shard(build_model(), plan)
    ...     loss = model.step(x, y, loss_fn)
    """
    ctx = ctx or current_context()
    if not isinstance(model, nn.Module):
        raise UsageError(f"sk.shard(model, plan): model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, ShardedModule) or getattr(model, "_sk_facts", None) is not None:
        raise UsageError("sk.shard got a model that is already sharded; build a fresh model for each plan")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise UsageError("sk.shard got a model on the meta device; build it on a real device (the plan is validated "
                         "on meta, but sharding needs the weights)")
    plan = plan.resolved(ctx.world_size)
    with warnings.catch_warnings():
        if ctx.rank != 0:  # unused rules are said once, not once per process
            warnings.simplefilter("ignore", PlanWarning)
        report = validate(plan, model, ctx.world_size, example_inputs=example_inputs)
    assert report.facts is not None
    if plan.pipeline is not None:
        from .pipeline import build_pipeline

        return build_pipeline(model, plan, ctx, report.layouts.params, report.facts)
    return with_mixin(parallelize(model, plan, ctx, report.layouts.params, report.facts), ShardedModule, "Sharded")


def parallelize(module: nn.Module, plan: Plan, ctx: Context, layouts: dict[str, ParamLayout],
                facts: ModelFacts) -> nn.Module:
    """Apply tensor, context and data parallelism (not pipeline stages) to ``module`` in place,
    as :func:`sk.validate <shardkit.planner.validate.validate>` planned it (``layouts``, ``facts``)."""
    plan = plan.resolved(ctx.world_size)
    module.to(ctx.device)
    meshes = meshes_for(plan, ctx.device.type)
    permutations: dict = {}
    for axis, axis_plan in facts.tensor_parallel.items():
        permutations.update(apply_tensor_parallel(module, axis_plan, meshes.axis(axis)))
    if plan.mesh.size_of("sp") > 1:
        from .context_parallel import enable_context_parallel

        enable_context_parallel(module, meshes.axis("sp"))
    data = meshes.data()
    if data is not None:
        _apply_data_parallel(module, plan, data, layouts, facts)
    module._sk_permutations = permutations  # read by full_state_dict / full_grads
    module._sk_facts = facts
    return module


def fsdp_units(module: nn.Module) -> list[nn.Module]:
    """Blocks FSDP wraps on their own: the children of every ModuleList, except one holding a
    parameter the model also uses outside it (a module shared by two blocks, a weight tied to
    an embedding): its own unit would hand the other user a sharded parameter, so it stays in
    the root's unit.

    >>> class Shared(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         common = nn.Linear(2, 2)
    ...         self.layers = nn.ModuleList([nn.Sequential(common, nn.Linear(2, 2)), nn.Sequential(common)])
    >>> [type(u).__name__ for u in fsdp_units(Shared())]
    []
    """
    owners: dict[int, set[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), set()).add(name)
    units = []
    for list_name, modules in module.named_modules():
        if not isinstance(modules, nn.ModuleList):
            continue
        for child_name, child in modules.named_children():
            prefix = f"{list_name}.{child_name}." if list_name else f"{child_name}."
            if all(n.startswith(prefix) for p in child.parameters() for n in owners[id(p)]):
                units.append(child)
    return units


def _apply_data_parallel(module: nn.Module, plan: Plan, data: DataMesh, layouts: dict[str, ParamLayout],
                         facts: ModelFacts) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    opts = plan.fsdp
    precision = Precision.of(opts)
    mp = MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype)
    if not data.shards:
        all_used = facts.unused_parameters is not None and not facts.unused_parameters
        if (plan.pipeline is not None or opts.mixed_precision or not all_used
                or any(isinstance(p, DTensor) for p in module.parameters())):
            # FSDP2's replicate composes with tensor parallel (DTensor parameters), mixed precision, pipeline
            # schedules (several forwards per backward, which DDP's reducer does not allow) and parameters the
            # forward never uses (DDP's reducer waits for their gradients forever, then fails).
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(module, mesh=data.mesh, mp_policy=mp)
        else:
            # Plain replication: DDP itself (bucketed all-reduce overlapped with backward), applied in place.
            from torch.distributed._composable import replicate

            replicate(module, device_mesh=data.mesh)
        return
    by_param = {id(p): layouts.get(n) for n, p in module.named_parameters()}

    def placement(param: nn.Parameter) -> Shard:
        lay = by_param.get(id(param))
        dim = None if lay is None else lay.axis_dim("fsdp")
        return Shard(dim or 0)

    kwargs = dict(mesh=data.mesh, reshard_after_forward=opts.reshard_after_forward, mp_policy=mp,
                  shard_placement_fn=placement)
    for unit in fsdp_units(module):
        fully_shard(unit, **kwargs)
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


__all__ = ["ShardedModule", "full_grads", "full_state_dict", "fsdp_units", "mean_over_world", "parallelize", "shard",
           "with_mixin"]
