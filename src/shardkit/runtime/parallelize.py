"""Tensor, context and data parallelism applied to a module (a whole model, or a pipeline stage).

The steps after validation, top to bottom, in a fixed order:

1. tensor parallel per model axis: family attribute changes, packed projections permuted,
   torch's styles, ties re-tied (:mod:`shardkit.runtime.tensor_parallel`); tensor parallel
   needs whole weights, so it comes before data parallel;
2. context parallel on ``sp``: attention becomes ring attention (``context_parallel``);
3. activation recompute per block (``Plan(recompute=...)``, :mod:`shardkit.runtime.recompute`):
   after the blocks' final forward is in place, before FSDP2, so its hooks stay outside the
   checkpointed region;
4. data parallel over :meth:`Meshes.data`: ``fully_shard`` over ``fsdp`` (HSDP with ``dp``),
   each block on its own unless it shares parameters with the rest of the model; over ``dp``
   alone, DDP (torch's composable ``replicate``, in place) when every parameter is used and
   nothing else is asked, else FSDP2's ``replicate`` (tensor parallel, mixed precision,
   pipelines, or parameters the forward never uses, on which DDP's reducer fails); ``sp``
   joins the gradient reduction. Mixed precision applies to every plan: with no data axis
   the reduction runs over a ``dp`` dim of size 1. ``Plan(zero=1)`` is always DDP (torch's
   pairing for ``ZeroRedundancyOptimizer``, which ``sk.optimizer`` builds), told about unused
   parameters; ``zero=2`` / ``3`` are ``fully_shard`` as the plan's ``fsdp`` options say.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..plan import Plan
from ..plan.layout import ParamLayout
from ..planner.model_checks import ModelFacts
from .batch_stats import synchronise_batch_norms
from .context import Context
from .expert_parallel import apply_expert_parallel, wrap_experts
from .materialize import WeightSource, load_weights, materialize
from .meshes import DataMesh, meshes_for
from .outputs import install_plain_outputs
from .partial_grads import reduce_at_end_of_backward
from .precision import Precision
from .recompute import apply_recompute
from .router_balance import balance_routers
from .tensor_parallel import apply_tensor_parallel

_MIXINS: dict[tuple[type, type], type] = {}


def with_mixin(module: nn.Module, mixin: type, prefix: str) -> nn.Module:
    """Give ``module`` the methods of ``mixin`` by swapping its class (as FSDP2 does), once per class.

    >>> class Greets:
    ...     def hello(self):
    ...         return "hi"
    >>> m = with_mixin(nn.Linear(2, 2), Greets, "Greeting")
    >>> type(m).__name__, isinstance(m, nn.Linear), m.hello()
    ('GreetingLinear', True, 'hi')
    """
    cls = type(module)
    if isinstance(module, mixin):
        return module
    if (cls, mixin) not in _MIXINS:
        _MIXINS[cls, mixin] = type(f"{prefix}{cls.__name__}", (mixin, cls), {})
    module.__class__ = _MIXINS[cls, mixin]
    return module


def parallelize(module: nn.Module, plan: Plan, ctx: Context, layouts: dict[str, ParamLayout],
                facts: ModelFacts, seed: int = 0, source: WeightSource | None = None) -> nn.Module:
    """Apply tensor, context and data parallelism (not pipeline stages) to ``module`` in place,
    as :func:`sk.validate <shardkit.planner.validate.validate>` planned it (``layouts``, ``facts``).

    A module on the meta device is split there and materialised (initialised under ``seed``, or
    read from ``source``) as late as it can be: after FSDP2 has sharded it, or just before DDP,
    which needs real weights to broadcast. A real module's shards are overwritten from
    ``source`` once split."""
    plan = plan.resolved(ctx.world_size)
    on_meta = any(p.device.type == "meta" for p in module.parameters())
    if not on_meta:
        module.to(ctx.device)
    meshes = meshes_for(plan, ctx.device.type)
    permutations: dict = {}
    for axis, axis_plan in facts.tensor_parallel.items():
        permutations.update(apply_tensor_parallel(module, axis_plan, meshes.axis(axis)))
    module._sk_permutations = permutations  # read by materialize, full_state_dict, checkpoints
    if facts.experts:  # ep: experts split whole over it, before data parallel reduces the rest over it
        routing_own_part = tuple(meshes.axis(a).get_group() for a, p in facts.tensor_parallel.items() if p.routed)
        apply_expert_parallel(module, facts.experts, meshes.axis("ep"), routing_own_part)
    if plan.mesh.size_of("sp") > 1:
        from .context_parallel import enable_context_parallel

        enable_context_parallel(module, meshes.axis("sp"), facts.causal_convs)
    if plan.recompute != "none":  # after tensor and context parallel, before FSDP2 wraps the blocks (torchtitan's order)
        apply_recompute(module, plan.recompute, facts.blocks, facts.attentions)
    install_plain_outputs(module)  # before data parallel, whose hooks then see the plain outputs
    data = meshes.data()
    # batch norms see the whole batch: statistics all-reduced over the ranks it is split over
    synchronise_batch_norms(module, None if data is None else data.mesh)
    balance_routers(module, None if data is None else data.mesh)  # router losses and load over the whole batch too
    ddp = data is not None and _uses_ddp(module, plan, data, facts)
    if on_meta and (data is None or ddp):
        materialize(module, ctx.device, seed=seed, source=source)
    if data is not None:
        _apply_data_parallel(module, plan, data, layouts, facts, ddp)
        if on_meta and not ddp:
            materialize(module, ctx.device, seed=seed, source=source)
    if source is not None and not on_meta:
        load_weights(module, source)
    if data is None:  # no data-parallel wrapper reduces what tensor parallel leaves Partial (SP's norms)
        reduce_at_end_of_backward(module)
    module._sk_facts = facts
    return module


def _uses_ddp(module: nn.Module, plan: Plan, data: DataMesh, facts: ModelFacts) -> bool:
    """Plain replication by DDP itself: no sharding, every parameter used, nothing DDP cannot do
    (tensor-parallel DTensors, mixed precision, pipeline schedules: FSDP2's replicate does those)."""
    if plan.zero == 1:  # Plan.problems() refused what DDP cannot do with it
        return True
    all_used = facts.unused_parameters is not None and not facts.unused_parameters
    return (not data.shards and all_used and plan.pipeline is None and not plan.fsdp.mixed_precision
            and not any(isinstance(p, DTensor) for p in module.parameters()))


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
                         facts: ModelFacts, ddp: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    opts = plan.fsdp
    precision = Precision.of(opts)
    mp = MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype)
    experts = meshes_for(plan, data.mesh.device_type).expert_data() if facts.experts else None
    ignored = wrap_experts(module, facts.experts, experts, mp, opts.reshard_after_forward) if facts.experts else set()
    if not data.shards:
        if ddp:
            # Plain replication: DDP itself (bucketed all-reduce overlapped with backward), applied in place.
            from torch.distributed._composable import replicate

            all_used = facts.unused_parameters is not None and not facts.unused_parameters
            replicate(module, device_mesh=data.mesh, find_unused_parameters=not all_used)
        else:
            # FSDP2's replicate composes with tensor parallel (DTensor parameters), mixed precision, pipeline
            # schedules (several forwards per backward, which DDP's reducer does not allow) and parameters the
            # forward never uses (DDP's reducer waits for their gradients forever, then fails).
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(module, mesh=data.mesh, mp_policy=mp, ignored_params=ignored)
        return
    by_param = {id(p): layouts.get(n) for n, p in module.named_parameters()}

    def placement(param: nn.Parameter) -> Shard:
        lay = by_param.get(id(param))
        dim = None if lay is None else lay.axis_dim("fsdp")
        return Shard(dim or 0)

    kwargs = dict(mesh=data.mesh, reshard_after_forward=opts.reshard_after_forward, mp_policy=mp,
                  shard_placement_fn=placement, ignored_params=ignored)
    for unit in fsdp_units(module):
        fully_shard(unit, **kwargs)
    fully_shard(module, **kwargs)


__all__ = ["fsdp_units", "parallelize", "with_mixin"]
