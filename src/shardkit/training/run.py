"""``sk.train(config)``: a whole training job as one call, as torchtitan's ``Trainer`` is: the plan made and
checked with everything else before any process starts (:func:`prepare`), then a local world (or the
``torchrun`` world this process is in) trains, and every rank reports memory, step time and communication.

>>> import shardkit as sk
>>> config = sk.TrainConfig(model="gpt-tiny", plan=sk.Plan(mesh=sk.Mesh(fsdp=2)), steps=2, batch_size=4,
...                         seq_len=16, data_mb=0.05)
>>> result = sk.train(config)  # doctest: +SKIP
>>> len(result.losses), len(result.stats)  # doctest: +SKIP
(2, 2)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..observe.report import RankStats
from ..plan import Plan
from ..runtime import world as runtime_world
from ..runtime.torchrun import in_torchrun
from .checks import CheckedJob, check_job
from .config import VERIFY_STEPS, TrainConfig
from .loop import train_rank
from .model import model_builder, model_from_flag
from .plans import job_plan


@dataclass
class TrainResult:
    """What a training run did: the checked job, every rank's stats (``stats[rank]``; empty when ``verify``
    failed, and nothing trained), their timeline spans with ``profile``, and the seconds it took."""

    job: CheckedJob
    stats: list[RankStats] = field(default_factory=list)
    spans: dict[int, list] = field(default_factory=dict)
    seconds: float = 0.0
    verified: bool | None = None  # None: not asked

    @property
    def losses(self) -> list[float]:
        """Rank 0's loss at every step it trained."""
        return self.stats[0].losses if self.stats else []

    @property
    def tokens(self) -> int:
        """The tokens this run trained on (after a resume, only its own steps)."""
        config = self.job.config
        return (config.steps - self.job.start) * config.batch_size * self.job.seq_len


def prepare(config: TrainConfig) -> CheckedJob:
    """The job's plan and everything else checked before any process starts (:mod:`.checks`)."""
    plan, world_size = job_plan(config)
    return check_job(config, plan, world_size)


def is_leader() -> bool:
    """Whether this process prints: always, except under ``torchrun`` where rank 0 does."""
    return not in_torchrun() or os.environ["RANK"] == "0"


def start_line(job: CheckedJob) -> str:
    """What a run says before it starts: the model, mesh, processes, steps, batch and data."""
    config, plan = job.config, job.plan
    zero = "" if plan.zero is None else f" with ZeRO stage {plan.zero}"
    scaling = plan.loss_scaling
    if scaling is not None:
        zero += ", dynamic loss scale" if scaling == "dynamic" else f", fixed loss scale {scaling:g}"
    held = "" if job.eval_data is None else f", evaluating on {job.eval_data.describe()}"
    return (f"shardkit train: {config.model} on {plan.mesh!r}{zero} ({job.world_size} processes), "
            f"{job.steps_text()} of {config.batch_size} x {job.seq_len} tokens from {job.data.describe()}{held}")


def train(config: TrainConfig | CheckedJob, *, world: runtime_world.LocalWorld | None = None) -> TrainResult:
    """Train as ``config`` says: checked before launch (unless it is :func:`prepare`'s checked job already), then
    on ``world`` (a live ``sk.LocalWorld`` of the plan's size), the ``torchrun`` world this process is in, or a
    local world started for the run and closed after.

    Raises :class:`~shardkit.plan.PlanError` / :class:`~shardkit.plan.UsageError` before any process starts,
    and :class:`~shardkit.runtime.world.WorldError` when a rank fails. With ``config.verify`` the sharded model
    is first compared with one process (``sk.verify``); when it differs, nothing trains
    (``result.verified`` is ``False``). With ``config.profile`` the pipeline timeline is written there.
    """
    if isinstance(config, CheckedJob):
        job = config
    else:
        job = prepare(config)
        if is_leader():
            print(start_line(job), flush=True)
    if world is not None or in_torchrun():
        return run(job, world)
    with runtime_world.LocalWorld(job.world_size) as started:  # closed on exit, killed on error
        return run(job, started)


def run(job: CheckedJob, world: runtime_world.LocalWorld | None) -> TrainResult:
    """A checked job on ``world`` (``None``: the ``torchrun`` world): verify if asked, train, write the profile."""
    config = job.config
    began = time.perf_counter()
    result = TrainResult(job)
    if config.verify:
        result.verified = _verify(job, world)
        if not result.verified:
            return result
    timeout = runtime_world.DEFAULT_TIMEOUT_S if config.timeout is None else config.timeout
    results = runtime_world.launch(train_rank, job.plan, job, world=world, timeout=timeout)
    result.stats = [stats for stats, _ in results]
    result.spans = {rank: spans for rank, (_, spans) in enumerate(results)}
    result.seconds = time.perf_counter() - began
    if config.profile is not None and is_leader():
        _write_profile(job.plan, result.spans, config.profile)
    return result


def _verify(job: CheckedJob, world: runtime_world.LocalWorld | None) -> bool:
    from ..runtime.verify import verify

    config = job.config
    first = next(job.data.batches(config.batch_size, 1))
    outcome = verify(model_builder(config.model, config.build), job.plan, (first.inputs, first.targets),
                     loss_fn=model_from_flag(config.model).loss_fn, steps=VERIFY_STEPS, optimizer=config.optimizer,
                     lr=config.lr, world=world)
    if is_leader():
        print(outcome, flush=True)
    return outcome.ok


def _write_profile(plan: Plan, spans_by_rank: dict, out_dir: Path) -> None:
    from ..observe.timeline import write_profile

    pipeline = plan.pipeline
    assert pipeline is not None
    profile = write_profile(spans_by_rank, out_dir, pipeline.schedule, pipeline.num_stages(plan.mesh),
                            pipeline.microbatches, pipeline.virtual_stages)
    print(profile["summary"])


__all__ = ["VERIFY_STEPS", "TrainResult", "is_leader", "prepare", "run", "start_line", "train"]
