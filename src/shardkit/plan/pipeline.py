"""Pipeline: how a model's layers are split into stages and how micro-batches flow through them.

Pure data (no torch): the schedule and split are checked against the mesh here, against a
batch by :meth:`Pipeline.check_batch`, and against a model by the planner
(:func:`shardkit.planner.stages.assign_stages`, run by ``sk.validate``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from .errors import PlanError
from .files import known_keys, mapping
from .mesh import Mesh

#: Schedule name -> (torch.distributed.pipelining class, stages per device, what it does).
SCHEDULES: dict[str, tuple[str, str, str]] = {
    "sequential": ("ScheduleGPipe", "1", "plain sharding: the whole batch through stage 0, then stage 1, ... "
                   "(one device busy at a time; a GPipe schedule with one micro-batch)"),
    "gpipe": ("ScheduleGPipe", "1", "all forwards, then all backwards (holds every micro-batch's activations)"),
    "1f1b": ("Schedule1F1B", "1", "one forward, one backward in the steady state (holds <= stages micro-batches)"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", ">=2", "1F1B over virtual_stages stages per device, looped"),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", ">=1", "ZB1P: the weight-gradient pass fills the bubble"),
    "zbv": ("ScheduleZBVZeroBubble", "2", "zero-bubble V schedule: two stages per device in a V shape"),
}
SPLITS = ("even", "auto", "scopes")
OBJECTIVES = ("time", "memory")
#: Schedules that run one stage per device (torch's PipelineScheduleSingle family).
SINGLE_STAGE_SCHEDULES = ("sequential", "gpipe", "1f1b")


def _names(value: Any, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise PlanError(f"Pipeline({what}=...) must be a list of module names such as ['layers.4'], got {value!r}")
    bad = [v for v in value if not isinstance(v, str) or not v]
    if bad:
        raise PlanError(f"Pipeline({what}=...) holds non-names {bad!r}; give dotted module names such as 'layers.4'")
    return tuple(value)


@dataclass(frozen=True)
class Pipeline:
    """Pipeline stages over the ``pp`` mesh axis and the schedule that runs them.

    The stages are chosen by exactly one of: ``split_points`` (each named module begins a new
    stage), ``stage_modules`` (the module names of every stage), or ``split``: ``"even"`` (equal
    numbers of blocks), ``"auto"`` (balanced estimated time, see :mod:`shardkit.planner.autosplit`)
    or ``"scopes"`` (the ``sk.stage(i)`` tags set while the model was built).
    ``stages`` defaults to ``pp * virtual_stages``.

    >>> p = Pipeline(split_points=["layers.2"], schedule="gpipe", microbatches=4)
    >>> p.num_stages(Mesh(pp=2)), Pipeline.from_dict(p.to_dict()) == p
    (2, True)
    """

    stages: int | None = None
    split_points: tuple[str, ...] | None = None
    stage_modules: tuple[tuple[str, ...], ...] | None = None
    split: str = "even"
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    objective: str = "time"
    memory_limit: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "split_points", _names(self.split_points, "split_points"))
        if self.stage_modules is not None:
            if isinstance(self.stage_modules, str) or not isinstance(self.stage_modules, Sequence):
                raise PlanError(f"Pipeline(stage_modules=...) must be one list of module names per stage, "
                                f"e.g. [['embed', 'layers.0'], ['layers.1', 'lm_head']], got {self.stage_modules!r}")
            object.__setattr__(self, "stage_modules",
                               tuple(_names(s, f"stage_modules[{i}]") for i, s in enumerate(self.stage_modules)))
        problems = []
        for name in ("stages", "microbatches", "virtual_stages", "memory_limit"):
            value = getattr(self, name)
            if value is None and name in ("stages", "memory_limit"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"Pipeline({name}={value!r}): must be an integer >= 1")
        for name, valid in (("schedule", SCHEDULES), ("split", SPLITS), ("objective", OBJECTIVES)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in valid:
                problems.append(f"Pipeline({name}={value!r}) is unknown; valid: {list(valid)}")
        if self.split_points is not None and self.stage_modules is not None:
            problems.append("give split_points or stage_modules, not both (each fixes every stage boundary)")
        if problems:
            raise PlanError(problems)

    # -- derived ------------------------------------------------------------------------------
    @property
    def method(self) -> str:
        """How the stages are chosen: ``"split_points"``, ``"stage_modules"`` or the ``split`` name."""
        if self.split_points is not None:
            return "split_points"
        if self.stage_modules is not None:
            return "stage_modules"
        return self.split

    def num_stages(self, mesh: Mesh) -> int:
        """Total number of stages: ``stages`` if given, else ``pp * virtual_stages``."""
        return self.stages if self.stages is not None else mesh.size_of("pp") * self.virtual_stages

    # -- validation -----------------------------------------------------------------------------
    def check_mesh(self, mesh: Mesh) -> list[str]:
        """Problems of this pipeline on ``mesh`` (stage counts, schedule constraints), as text."""
        problems: list[str] = []
        pp, v, m, s = mesh.size_of("pp"), self.virtual_stages, self.microbatches, self.schedule
        if "pp" not in mesh or pp < 2:
            problems.append(f"a pipeline needs a mesh axis 'pp' of size >= 2 (one device per stage), but {mesh!r} "
                            f"has pp={pp}; add pp=<stages> to the mesh or drop the pipeline")
            return problems
        total = self.num_stages(mesh)
        if total != pp * v:
            problems.append(f"pipeline has stages={total} but pp={pp} devices x virtual_stages={v} hold {pp * v}; "
                            f"set stages={pp * v} (or virtual_stages={total // pp if total % pp == 0 else '?'})")
        given = (len(self.split_points) + 1 if self.split_points is not None
                 else len(self.stage_modules) if self.stage_modules is not None else None)
        if given is not None and given != total:
            what = (f"split_points {list(self.split_points)} make {given} stages" if self.split_points is not None
                    else f"stage_modules lists {given} stages")
            problems.append(f"{what} but the pipeline has {total} (pp={pp} x virtual_stages={v}); "
                            f"give {total - 1} split points / {total} stage lists")
        per_device = SCHEDULES[s][1]
        if s in SINGLE_STAGE_SCHEDULES and v != 1:
            problems.append(f"schedule {s!r} runs one stage per device but virtual_stages={v}; use virtual_stages=1 "
                            f"or schedule 'interleaved-1f1b' / 'zero-bubble'")
        if per_device == ">=2" and v < 2:
            problems.append(f"schedule {s!r} needs virtual_stages >= 2 (stages per device); with 1 it is plain "
                            f"'1f1b': use schedule='1f1b' or virtual_stages=2")
        if per_device == "2" and v != 2:
            problems.append(f"schedule {s!r} needs exactly virtual_stages=2 (a V of two stages per device), got {v}")
        if s == "sequential" and m != 1:
            problems.append(f"schedule 'sequential' runs the whole batch at once, so microbatches must be 1 (got {m}); "
                            f"to split the batch into {m} micro-batches use 'gpipe' or '1f1b'")
        if s == "1f1b" and m < pp:
            problems.append(f"schedule '1f1b' needs microbatches >= pipeline devices: got microbatches={m} for pp={pp}; "
                            f"use microbatches >= {pp} (or schedule 'gpipe')")
        data = [f"{a}={mesh.size_of(a)}" for a in ("dp", "fsdp") if mesh.size_of(a) > 1]
        if s in ("zero-bubble", "zbv") and data:
            problems.append(f"schedule {s!r} splits the backward into input and weight passes, which FSDP2's gradient "
                            f"hooks (used for {', '.join(data)}) do not follow: gradients come out wrong or the run "
                            f"fails; with data parallel use '1f1b' or 'interleaved-1f1b' (zero-bubble works with pp "
                            f"and tp)")
        if s in ("interleaved-1f1b", "zero-bubble"):
            rounds = max(1, m // pp)
            if m % rounds:
                valid = [k for k in range(pp, 4 * pp + 1) if k % max(1, k // pp) == 0][:6]
                problems.append(f"schedule {s!r} needs microbatches to be a multiple of max(1, microbatches // pp) = "
                                f"{rounds}; got microbatches={m} for pp={pp}; valid for example: {valid}")
        if self.memory_limit is not None and self.method != "auto":
            problems.append(f"memory_limit applies to split='auto' only, but the stages come from {self.method}")
        return problems

    def check_batch(self, batch_size: int, data_world: int = 1) -> list[str]:
        """Problems splitting a global batch of ``batch_size`` over data ranks, then micro-batches.

        >>> Pipeline(schedule="gpipe", microbatches=4).check_batch(6)
        ['batch of 6 samples per data rank does not split into 4 equal micro-batches; use a multiple of 4 (e.g. 8)']
        """
        if batch_size % data_world:
            return [f"batch of {batch_size} samples does not split evenly over {data_world} data-parallel replicas; "
                    f"use a multiple of {data_world * self.microbatches}"]
        local, m = batch_size // data_world, self.microbatches
        if local % m:
            hint = m * max(1, -(-local // m))
            return [f"batch of {local} samples per data rank does not split into {m} equal micro-batches; "
                    f"use a multiple of {m} (e.g. {hint * data_world if data_world > 1 else hint})"]
        return []

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.split_points is not None:
            out["split_points"] = list(self.split_points)
        if self.stage_modules is not None:
            out["stage_modules"] = [list(s) for s in self.stage_modules]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Pipeline:
        data = mapping(data, "plan field 'pipeline'", "{schedule: 1f1b, microbatches: 4}")
        known_keys(data, [f.name for f in fields(cls)], "plan field 'pipeline'")
        return cls(**dict(data))


def theoretical_bubble(schedule: str, devices: int, microbatches: int, virtual_stages: int = 1) -> float | None:
    """The idle fraction of an ideal schedule with equal stage times: ``(p-1)/(v*m+p-1)``.

    ``sequential`` is ``m = 1``; zero-bubble schedules have no closed form here (``None``).

    >>> round(theoretical_bubble("1f1b", 4, 8), 4)
    0.2727
    >>> theoretical_bubble("sequential", 4, 1)
    0.75
    """
    p, m, v = devices, microbatches, virtual_stages
    if schedule == "sequential":
        return (p - 1) / p
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    return None


def pipeline_from_args(mesh: Mesh, schedule: str | None = None, microbatches: int | None = None,
                       split: str | None = None, split_points: Sequence[str] | str | None = None) -> Pipeline | None:
    """The Pipeline that command-line options describe, or ``None`` when the mesh has no ``pp`` axis.

    ``split_points`` may be a comma-separated string. Schedule defaults to ``1f1b``, micro-batches
    to the pp size (the fewest 1F1B accepts).

    >>> pipeline_from_args(Mesh(pp=4), "1f1b", 8, "auto")
    Pipeline(stages=None, split_points=None, stage_modules=None, split='auto', schedule='1f1b', microbatches=8, virtual_stages=1, objective='time', memory_limit=None)
    >>> pipeline_from_args(Mesh(dp=2)) is None
    True
    """
    given = {k: v for k, v in (("--schedule", schedule), ("--microbatches", microbatches), ("--split", split),
                               ("--split-points", split_points)) if v is not None}
    pp = mesh.size_of("pp")
    if pp < 2:
        if given:
            raise PlanError(f"{sorted(given)} configure a pipeline but the mesh {mesh!r} has no 'pp' axis of size >= 2; "
                            f"add one, e.g. --mesh pp=2" + ("," + ",".join(f"{n}={s}" for n, s in mesh.items())
                                                            if len(mesh) else ""))
        return None
    if isinstance(split_points, str):
        split_points = [s.strip() for s in split_points.split(",") if s.strip()]
    schedule = schedule or "1f1b"
    virtual = 2 if schedule in ("interleaved-1f1b", "zbv") else 1
    return Pipeline(split_points=split_points or None, split=split or "even", schedule=schedule,
                    microbatches=microbatches if microbatches is not None else (1 if schedule == "sequential" else pp),
                    virtual_stages=virtual)


__all__ = ["OBJECTIVES", "SCHEDULES", "SPLITS", "Pipeline", "pipeline_from_args", "theoretical_bubble"]
