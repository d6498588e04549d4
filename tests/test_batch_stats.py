"""Batch statistics under a split batch: torch's batch norms synchronised over the data ranks (forward,
backward and running statistics equal to one process over the whole batch), found on meta by the
calls the forward makes; batch statistics the runtime cannot synchronise, and any under micro-batches,
refused naming the module."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardkit as sk
from shardkit.planner.batch_stats import batch_statistics
from shardkit.planner.explain import explain_plan
from shardkit.planner.meta import meta_model
from shardkit.runtime.batch_stats import refuse_micro_batches

FSDP2 = sk.Plan(mesh=sk.Mesh(fsdp=2))


class OwnNorm(nn.Module):
    """Batch statistics in a forward of its own: nothing shardkit can synchronise."""

    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, None, None, self.scale, None, training=True)


def build_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def build_sync_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.SyncBatchNorm(32, momentum=None), nn.ReLU(), nn.Linear(32, 4))


def build_own_norm() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), OwnNorm(16), nn.Linear(16, 4))


class Convs(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.norm(self.conv(x))).mean((2, 3)))


def samples() -> tuple[torch.Tensor, torch.Tensor]:
    """Samples whose halves have different statistics, so per-rank normalisation shows."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 8, generator=g) * torch.linspace(0.2, 3, 16)[:, None] + torch.linspace(-2, 2, 16)[:, None]
    return x, torch.randn(16, 4, generator=g)


def images() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return torch.randn(8, 3, 6, 6, generator=g) + torch.arange(8.0)[:, None, None, None], torch.randn(8, 4, generator=g)


# -- found on meta --------------------------------------------------------------------------------
def test_batch_norms_are_found_by_the_calls_the_forward_makes():
    x = (torch.zeros(1, 8),)
    assert batch_statistics(meta_model(build_mlp), x).synchronised == ("1",)
    own = batch_statistics(meta_model(build_own_norm), x)
    assert own.own == ("1",) and own.synchronised == () and own.traced
    frozen = build_mlp().eval()  # eval mode: running statistics, nothing of the batch
    assert batch_statistics(frozen, x).all == ()


def test_a_sync_batch_norm_runs_on_meta_as_a_plain_one():
    assert batch_statistics(meta_model(build_sync_mlp), (torch.zeros(2, 8),)).synchronised == ("1",)


def test_batch_statistics_the_runtime_cannot_synchronise_are_refused_by_name():
    with pytest.raises(sk.PlanError, match=r"module '1' \(OwnNorm\) normalises with statistics of the batch in a "
                                           r"forward of their own .* under fsdp=2 each of the 2 data ranks"):
        sk.validate(FSDP2, meta_model(build_own_norm), example_inputs=(torch.zeros(2, 8),))
    sk.validate(sk.Plan(mesh=sk.Mesh(tp=1)), meta_model(build_own_norm), example_inputs=(torch.zeros(2, 8),))
    sk.validate(FSDP2, meta_model(build_mlp), example_inputs=(torch.zeros(2, 8),))  # synchronised: accepted


def test_micro_batches_over_a_batch_norm_are_refused_on_every_stage():
    plan = sk.Plan(mesh=sk.Mesh(pp=2), pipeline=sk.Pipeline(split_points=["2"], schedule="gpipe", microbatches=2))
    with pytest.raises(sk.PlanError, match=r"module '1' \(BatchNorm1d\) normalises .* microbatches=2 each "
                                           r"micro-batch has its own"):
        sk.validate(plan, meta_model(build_mlp), example_inputs=(torch.zeros(2, 8),))
    one = sk.Plan(mesh=sk.Mesh(pp=2), pipeline=sk.Pipeline(split_points=["2"], schedule="gpipe"))
    sk.validate(one, meta_model(build_mlp), example_inputs=(torch.zeros(2, 8),))
    with pytest.raises(sk.UsageError, match=r"a step of 2 micro-batches .* '1' \(BatchNorm1d\)"):
        refuse_micro_batches(build_mlp(), 2)
    refuse_micro_batches(build_mlp().eval(), 2)  # running statistics: the micro-batches do not matter


def test_explain_says_the_batch_norms_are_synchronised():
    text = explain_plan(FSDP2, meta_model(build_mlp))
    assert "batch statistics: module '1' (BatchNorm1d) normalise over the whole batch" in text
    assert "all-reduced over fsdp=2 (2 ranks)" in text
    assert "batch statistics" not in explain_plan(sk.Plan(mesh=sk.Mesh(tp=1)), meta_model(build_mlp))


# -- one process over the whole batch -------------------------------------------------------------
def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 2) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        if hasattr(model, "step"):
            loss = model.step(x, y, F.mse_loss)
        else:
            loss = F.mse_loss(model(x), y)
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _sharded_losses(ctx, build, batch, norm: str) -> tuple[list[float], dict[str, torch.Tensor], str]:
    model = sk.shard(build(), ctx.plan)
    losses = _train(model, *ctx.shard_batch(*batch))
    module = model.get_submodule(norm)
    return losses, {n: b.clone() for n, b in module.named_buffers()}, type(module).__name__


@pytest.mark.parametrize("build, batch, norm, mesh", [(build_mlp, samples, "1", "fsdp=2"),
                                                      (build_sync_mlp, samples, "1", "dp=2"),
                                                      (Convs, images, "norm", "fsdp=2")],
                         ids=["BatchNorm1d-fsdp", "SyncBatchNorm-dp", "BatchNorm2d-fsdp"])
def test_losses_and_running_statistics_equal_one_process(world, build, batch, norm, mesh):
    # Before: BatchNorm1d under fsdp=2, step-2 loss 1.2499 against one process's 1.3055, running means 0.25 off;
    # SyncBatchNorm refused the CPU tensors.
    reference = build()
    expected = _train(reference, *batch())
    for losses, buffers, kind in world(2).run(_sharded_losses, build, batch(), norm, plan=sk.Plan(sk.Mesh.parse(mesh))):
        assert kind.startswith("Synchronised")
        assert losses == pytest.approx(expected, rel=1e-5)
        for name, value in reference.get_submodule(norm).named_buffers():
            torch.testing.assert_close(buffers[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_verify_proves_a_batch_norm_model_under_fsdp(world):
    result = sk.verify(Convs, FSDP2, images(), loss_fn=F.mse_loss, steps=2, world=world(2))
    assert result.ok, result
    assert result.steps[1].worst_buffer != "-"  # the running statistics were compared
