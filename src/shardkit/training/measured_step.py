"""One rank's training step measured (``sk.dry_run``'s, and a real world's to check it): the
model sharded by the plan, the state the first step leaves made without running it
(:func:`_steady_state`), then one step and one optimizer step under
:class:`~shardkit.observe.step_cost.StepCost`: bytes by component and collectives. See
``docs/dry-run.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from ..observe.step_cost import Collective, StepCost
from ..plan import Plan
from ..runtime.context import Context


def default_loss() -> Callable:
    """The loss a step measures with unless told: a transformers causal LM's (``hf_loss``)."""
    from ..models.hf import hf_loss

    return hf_loss


def measure_step(ctx: Context, model: nn.Module, plan: Plan, batch: int, seq_len: int,
                 loss_fn: Callable | None = None, optimizer: str = "adamw",
                 steps_before: int = 0, report: Any = None, accumulate: int = 1) -> tuple[dict[str, int], list[Collective]]:
    """Shard ``model`` (on meta) by ``plan`` in ``ctx``'s world, and run one training step of a global
    batch of ``batch`` random sequences of ``seq_len`` tokens under :class:`StepCost`: the rank's
    bytes by component and its collectives in a step that finds the optimizer state made, as every
    step but the first does. What the first step leaves is made without running it
    (:func:`_steady_state`), or with ``steps_before=k`` by running ``k`` whole steps (forward,
    backward and optimizer step) first, as a real run does (DDP's second step is one of its own:
    it rebuilds its gradient buckets). ``report``: ``sk.validate``'s of ``plan`` on a model built
    as ``model`` (else ``sk.shard`` validates); ``optimizer``: a name of ``OPTIMIZER_STATES``
    (:func:`step_optimizer`); ``accumulate``: the step's gradient accumulation steps
    (``model.step(..., accumulate=k)``, as ``shardkit train --grad-accum k`` runs). The dry run calls
    it in its fake world; a real world's job can call it too, and gets the same numbers
    (``tests/test_dry_run.py``)."""
    loss_fn = loss_fn or default_loss()
    sharded, opt, inputs, targets = sharded_for_step(ctx, model, plan, batch, seq_len, optimizer, report)
    for _ in range(steps_before):
        sharded.step(inputs, targets, loss_fn, accumulate=accumulate)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if not steps_before:
        _steady_state(sharded, opt, plan, inputs, targets, loss_fn, accumulate)
    with StepCost(sharded, opt, plan.mesh, accumulate, buffers=_receive_buffers(sharded),
                  buckets=_bucket_stand_ins(sharded)) as cost:
        sharded.step(inputs, targets, loss_fn, accumulate=accumulate)
        opt.step()
    return cost.memory(), cost.collectives()


def sharded_for_step(ctx: Context, model: nn.Module, plan: Plan, batch: int, seq_len: int, optimizer: str,
                     report: Any) -> tuple[nn.Module, Any, Any, Any]:
    """``model`` sharded by ``plan`` in ``ctx``'s world (with ``report``, not validated again), its
    optimizer, and this rank's part of a global batch of random tokens."""
    import torch

    from ..families import token_sizes
    from ..runtime.apply import shard, shard_validated

    vocab = token_sizes(model)[0] or 2
    ctx = replace(ctx, plan=plan)  # the batch splits over this plan's data ranks
    sharded = shard(model, plan, ctx) if report is None else shard_validated(model, plan, ctx, report)
    opt = step_optimizer(sharded, optimizer)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
    inputs, targets = ctx.shard_batch(tokens[:, :-1], tokens[:, 1:])
    return sharded, opt, inputs, targets


def step_optimizer(model: nn.Module, name: str) -> Any:
    """The optimizer ``name`` (a key of ``OPTIMIZER_STATES``: ``adamw``, ``adam``, ``sgd``,
    ``sgd-momentum``) over ``model``'s parameters through ``sk.optimizer``, keeping the state the
    estimate prices for it: two tensors per parameter for Adam(W), one for SGD with momentum (0.9:
    the state's size does not depend on it), none for plain SGD."""
    import torch

    from ..plan import UsageError
    from ..planner.space import OPTIMIZER_STATES
    from ..runtime.optimizer import optimizer as sk_optimizer

    kinds = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
             "sgd-momentum": torch.optim.SGD}
    if name not in kinds:
        raise UsageError(f"optimizer={name!r} is unknown; valid: {sorted(OPTIMIZER_STATES)}")
    settings = {"momentum": 0.9} if name == "sgd-momentum" else {}
    return sk_optimizer(model, kinds[name], lr=1e-4, **settings)


def _steady_state(model: nn.Module, opt: Any, plan: Plan, inputs: Any, targets: Any, loss_fn: Callable,
                  accumulate: int = 1) -> None:
    """What the first step leaves for the next, without running it: with a pipeline, torch's stages
    initialised (:func:`_initialise_stages`); DDP made (torch's composable ``replicate`` makes it in
    its first forward, with a broadcast of the parameters and a check of their shapes across ranks);
    and the optimizer's state (:func:`_optimizer_state`)."""
    from torch.distributed._composable import replicate

    if plan.pipeline is not None:
        _initialise_stages(model, inputs, targets, loss_fn, accumulate)
    ddp = replicate.state(model)
    if ddp is not None and not ddp.has_initialized:
        ddp.lazy_init()
    _optimizer_state(opt)


def _receive_buffers(model: nn.Module) -> list[Any]:
    """The receive buffers of ``model``'s pipeline stages on this rank (hidden states and their gradients, one
    per micro-batch), which torch's stages make when initialised, before the step; none without a pipeline."""
    runtime = getattr(model, "_sk_runtime", None)
    buffers = []
    for stage in getattr(runtime, "stages", ()):
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            buffers += [info.buffer for info in infos if getattr(info, "buffer", None) is not None]
    return buffers


def _bucket_stand_ins(model: nn.Module) -> list[Any]:
    """Tensors the sizes of DDP's gradient buckets for ``model`` (torch's composable ``replicate``), which DDP
    keeps out of reach (its reducer gives copies); none without DDP."""
    from torch.distributed._composable import replicate

    state = replicate.state(model)
    if state is None or not state.has_initialized:
        return []
    return [bucket.buffer() for bucket in state._ddp.reducer._get_zeros_like_grad_buckets()]


class _StagesReady(Exception):
    """Raised by :func:`_initialise_stages` to leave a step once torch's stages are initialised."""


def _initialise_stages(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable, accumulate: int = 1) -> None:
    """torch's pipeline stages as their first step leaves them: on that step, before any
    micro-batch, the schedule infers the stages' shapes (with ``autograd.grad``, which the memory
    tracker's module hooks refuse) and makes their receive buffers. The step runs up to there
    and stops: the micro-batches, which would cost as much as the measured step, do not run
    (every rank of a real world stops at the same point, so the shape exchange stays paired)."""
    schedule = model._sk_runtime.schedule
    # torch 2.13: single-stage schedules initialise in _initialize_stage, the others in _initialize_stages
    name = "_initialize_stage" if hasattr(schedule, "_initialize_stage") else "_initialize_stages"
    initialise = getattr(schedule, name)

    def then_stop(*args: Any, **kwargs: Any) -> None:
        initialise(*args, **kwargs)
        raise _StagesReady

    setattr(schedule, name, then_stop)
    try:
        model.step(inputs, targets, loss_fn, accumulate=accumulate)
    except _StagesReady:
        pass
    finally:
        delattr(schedule, name)


def _optimizer_state(opt: Any) -> None:
    """The optimizer's state as its first step makes it, made by that step on plain tensors: each
    DTensor parameter's local shard stands in for it (with a zero gradient), and the state made
    for the shard is put back under the parameter as a DTensor laid out like it. The tensors
    (shapes, dtypes, strides, bytes) are those a step on the DTensors makes, which costs
    DTensor's dispatch on each of the optimizer's ops (a dozen per parameter with AdamW): most of
    a dry run's time. torch's optimizers keep their step counts (``"step"``) as plain tensors."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import DTensor

    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt  # it steps the rank's part
    held = [group["params"] for group in inner.param_groups]
    with torch.no_grad():
        stand_ins = {p: _stand_in(p) for params in held for p in params}
    for group, params in zip(inner.param_groups, held, strict=True):
        group["params"] = [stand_ins[p] for p in params]
    try:
        inner.step()
    finally:
        for group, params in zip(inner.param_groups, held, strict=True):
            group["params"] = params
    for p, local in stand_ins.items():
        if local not in inner.state:  # SGD without momentum keeps none
            continue
        state = inner.state.pop(local)
        if isinstance(p, DTensor):
            state = {key: DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                             run_check=False)
                     if key != "step" and isinstance(value, torch.Tensor) and value.shape == local.shape else value
                     for key, value in state.items()}
        inner.state[p] = state
    opt.zero_grad(set_to_none=True)


def _stand_in(p: Any) -> Any:
    """A leaf on ``p``'s local shard (``p`` itself when it is a plain tensor), with a zero gradient."""
    import torch
    from torch.distributed.tensor import DTensor

    local = p.to_local().detach().requires_grad_(p.requires_grad) if isinstance(p, DTensor) else p
    local.grad = torch.zeros_like(local)
    return local


__all__ = ["default_loss", "measure_step", "sharded_for_step", "step_optimizer"]
