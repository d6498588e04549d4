"""Plan: the one serialisable description of how a model is split."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .dtypes import FLOATING
from .errors import PlanError, UsageError
from .files import boolean, known_keys, mapping, read_file, read_text
from .layout import LayoutMap
from .loss_scale import check_loss_scale, loss_scale_problems, resolved_loss_scale
from .mesh import AXIS_ROLES, DATA_AXES, Mesh, is_model_axis
from .pipeline import Pipeline
from .replicas import ReplicaGrouping
from .sequence import sequence_problems

#: Activation recompute per repeated block: nothing, the whole block, or its attention core only.
RECOMPUTE = ("none", "full", "selective")
#: ZeRO stages (Rajbhandari et al. 2020) as DeepSpeed names them; ``None``: no stage asked for.
ZERO_STAGES = (1, 2, 3)


@dataclass(frozen=True)
class FSDPOptions:
    """Options of the data-parallel wrapper (torch's FSDP2: ``fully_shard`` / ``replicate``).

    ``reshard_after_forward``: free gathered parameters after the forward (``fsdp`` only);
    ``None`` (not written): the plan's ZeRO stage says, ``False`` under ``zero=2`` and ``True``
    otherwise. Inside a :class:`Plan` it reads as that ``bool``, and stays not written: plan
    files leave it out, and a plan with another stage resolves it again.
    ``param_dtype`` / ``reduce_dtype``: mixed precision (``"bfloat16"``, ``"float16"``,
    ``"float32"`` or ``None`` to keep the parameter dtype), torch's ``MixedPrecisionPolicy``:
    parameters stay in their dtype for the optimizer, compute runs in ``param_dtype`` and
    gradients are reduced in ``reduce_dtype``. It applies to every plan, with or without data axes.

    >>> Plan(Mesh(fsdp=2), zero=2).fsdp.reshard_after_forward, Plan(Mesh(fsdp=2)).fsdp.reshard_after_forward
    (False, True)
    >>> FSDPOptions(reshard_after_forward="no")
    Traceback (most recent call last):
        ...
    shardkit.plan.errors.PlanError: FSDPOptions(reshard_after_forward=...) must be true or false, got str 'no'
    """

    reshard_after_forward: bool | None = None
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    #: the zero stage's value, when ``reshard_after_forward`` holds it because it was not written
    _stage_default: bool | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.reshard_after_forward is not None:
            boolean(self.reshard_after_forward, "FSDPOptions(reshard_after_forward=...)")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in FLOATING:
                raise PlanError(f"FSDPOptions.{name}={value!r}; valid: None or one of {list(FLOATING)}")

    @property
    def mixed_precision(self) -> bool:
        """Whether compute or gradient reduction runs below float32."""
        return bool({self.param_dtype, self.reduce_dtype} - {None, "float32"})

    @property
    def written(self) -> bool:
        """Whether ``reshard_after_forward`` was written, rather than left to the zero stage
        (``dataclasses.replace`` with the other value writes it)."""
        return self.reshard_after_forward is not None and self.reshard_after_forward != self._stage_default

    def resolved(self, zero: int | None) -> FSDPOptions:
        """These options in a plan of ZeRO stage ``zero``: ``reshard_after_forward``, when not
        written, is the stage's (``False`` under ``zero=2``, else ``True``), still not written.

        >>> options = FSDPOptions().resolved(2)
        >>> options.reshard_after_forward, options.written, options.resolved(3).reshard_after_forward
        (False, False, True)
        """
        if self.written:
            return self
        return replace(self, reshard_after_forward=zero != 2, _stage_default=zero != 2)

    def to_dict(self) -> dict[str, Any]:
        """The options as written: ``reshard_after_forward`` only when it was."""
        return {name: getattr(self, name) for name in _written_fields(type(self))
                if name != "reshard_after_forward" or self.written}

    @classmethod
    def from_dict(cls, data: Any) -> FSDPOptions:
        data = mapping(data, "plan field 'fsdp'", "{reshard_after_forward: true, param_dtype: bfloat16}")
        known_keys(data, _written_fields(cls), "plan field 'fsdp'")
        if "reshard_after_forward" in data:  # written: null is no choice (leave the key out for the stage's)
            boolean(data["reshard_after_forward"], "plan field 'fsdp' reshard_after_forward (leave it out for the "
                                                   "zero stage's choice)")
        return cls(**dict(data))


def _written_fields(cls: type) -> list[str]:
    """The fields a user writes (in Python and in plan files); private ones are shardkit's bookkeeping."""
    return [f.name for f in fields(cls) if not f.name.startswith("_")]


def _recompute(value: Any, where: str) -> str:
    """``value`` if it is exactly one of :data:`RECOMPUTE` (``True``, ``"Full"`` or ``"true"`` are errors)."""
    if not isinstance(value, str) or value not in RECOMPUTE:
        raise PlanError(f"{where} must be one of {list(RECOMPUTE)}, got {type(value).__name__} {value!r}")
    return value


def _zero(value: Any, where: str) -> int | None:
    """``value`` if it is ``None`` or exactly one of :data:`ZERO_STAGES` (``"2"``, ``True``, ``2.0`` are errors)."""
    if value is not None and (type(value) is not int or value not in ZERO_STAGES):
        raise PlanError(f"{where} must be null/None or one of {list(ZERO_STAGES)}, got {type(value).__name__} {value!r}")
    return value


def param_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """``{dotted name: shape}`` of a module's parameters (works on the meta device), or a copy of a mapping."""
    if isinstance(model, Mapping):
        return {str(k): tuple(int(d) for d in v) for k, v in model.items()}
    if hasattr(model, "named_parameters"):
        return {n: tuple(p.shape) for n, p in model.named_parameters()}
    hint = (" (this is a function: pass the model it builds, e.g. sk.meta_model(build), not the builder)"
            if callable(model) else "")
    raise UsageError(f"validate(plan, model): cannot read parameters from {type(model).__name__}{hint}; pass an "
                     f"nn.Module (on the meta device is fine) or a mapping of parameter name -> shape")


@dataclass(frozen=True)
class Plan:
    """How a model is split: mesh, layout rules, FSDP options, pipeline, replica groups.

    ``recompute``: activation recompute per repeated block (``"none"``, ``"full"``: each block's
    activations are recomputed in the backward; ``"selective"``: only its attention core,
    Korthikanti et al. 2022); see ``docs/recompute.md``.

    ``zero``: a ZeRO stage as DeepSpeed names it, each torch's own mechanism over the data axes
    (``docs/zero.md``): ``1`` optimizer state sharded over ``dp`` (``ZeroRedundancyOptimizer``,
    built by ``sk.optimizer``), ``2`` FSDP2 over ``fsdp`` keeping parameters gathered from
    forward to backward (``reshard_after_forward=False``), ``3`` FSDP2 over ``fsdp`` resharding
    after the forward; ``None``: the mesh and ``fsdp`` options alone say what is sharded. The
    stage sets ``reshard_after_forward`` when it is not written; only a written contradiction
    is a problem.

    ``loss_scale``: gradient scaling for float16 (:mod:`shardkit.plan.loss_scale`): ``None`` (not
    written) is ``"dynamic"`` when ``fsdp.param_dtype`` or ``reduce_dtype`` is float16 and off
    otherwise; ``"dynamic"``, a fixed positive scale, or ``"off"`` (refused with float16: use
    bfloat16). :attr:`loss_scaling` is what runs.

    A plan is data: it checks its own fields here, and what it can know without a model with
    :meth:`problems`; ``sk.validate(plan, model)`` adds every check against the model.

    >>> plan = Plan(mesh=Mesh(fsdp=2, tp=2), rules=LayoutMap([(r".*\\.w_in\\.weight", ("tp", None)), (r".*", None)]))
    >>> Plan.from_json(plan.to_json()) == plan
    True
    """

    mesh: Mesh
    rules: LayoutMap | None = None
    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    pipeline: Pipeline | None = None
    replicas: ReplicaGrouping | None = None
    sequence_parallel: bool = False
    recompute: str = "none"
    zero: int | None = None
    loss_scale: str | float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise PlanError(f"Plan(mesh=...) must be a shardkit Mesh, got {type(self.mesh).__name__}; e.g. Mesh(dp=2)")
        if self.rules is not None and not isinstance(self.rules, LayoutMap):
            if isinstance(self.rules, (str, bytes)) or not isinstance(self.rules, (Mapping, list, tuple)):
                raise PlanError(f"Plan(rules=...) must be a LayoutMap or a list of (regex, layout) pairs, got "
                                f"{type(self.rules).__name__}")
            object.__setattr__(self, "rules", LayoutMap(self.rules))
        for name, kind in (("fsdp", FSDPOptions), ("pipeline", Pipeline), ("replicas", ReplicaGrouping)):
            value = getattr(self, name)
            if not isinstance(value, kind) and not (value is None and name != "fsdp"):
                raise PlanError(f"Plan({name}=...) must be a {kind.__name__}{'' if name == 'fsdp' else ' or None'}, "
                                f"got {type(value).__name__}")
        boolean(self.sequence_parallel, "Plan(sequence_parallel=...)")
        _recompute(self.recompute, "Plan(recompute=...)")
        _zero(self.zero, "Plan(zero=...)")
        object.__setattr__(self, "loss_scale", check_loss_scale(self.loss_scale, "Plan(loss_scale=...)"))
        # what the user left out of the fsdp options takes the zero stage's value (and stays left out)
        object.__setattr__(self, "fsdp", self.fsdp.resolved(self.zero))

    def __getattr__(self, name: str) -> Any:
        if name in ("validate", "explain"):
            raise AttributeError(f"Plan.{name} is sk.{name if name == 'validate' else 'explain_plan'}(plan, model): "
                                 f"checks against a model live in the planner, which knows model families")
        raise AttributeError(f"'Plan' object has no attribute {name!r}")

    @property
    def loss_scaling(self) -> str | float | None:
        """The loss scaling this plan runs: ``"dynamic"``, a fixed scale, or ``None`` (off).

        >>> Plan(Mesh(fsdp=2), fsdp=FSDPOptions(param_dtype="float16")).loss_scaling
        'dynamic'
        """
        return resolved_loss_scale(self.loss_scale, self.fsdp.param_dtype, self.fsdp.reduce_dtype)

    # -- checks without a model --------------------------------------------------------------
    def resolved(self, world_size: int) -> Plan:
        """This plan with the mesh's ``-1`` axis inferred from ``world_size``."""
        return Plan(**{**self._fields(), "mesh": self.mesh.resolved(world_size)})

    def problems(self) -> list[str]:
        """What is wrong with this (resolved) plan that is known without a model: axes no rule
        uses, a ``pp`` axis without a pipeline, HSDP axis order, Megatron SP without ``tp``, the
        pipeline's and the replica groups' fit to the mesh, recompute with a zero-bubble schedule. Layouts need the parameter shapes:
        ``sk.validate(plan, model)`` runs these checks and every check against the model.

        >>> Plan(mesh=Mesh(tp=2)).problems()
        ["mesh axis 'tp' (size 2) is used by no layout rule, so every tp rank would compute the same thing; add rules that split parameters over 'tp' or remove the axis"]
        """
        mesh = self.mesh
        problems: list[str] = []
        rule_axes = self.rules.axes() if self.rules is not None else set()
        for axis in mesh.names:
            if axis == "pp" and mesh[axis] > 1 and self.pipeline is None:
                problems.append(f"mesh axis 'pp' (size {mesh[axis]}) needs a pipeline: add "
                                f"Plan(pipeline=Pipeline(stages={mesh[axis]}, ...)) (CLI: --schedule/--split) or remove the axis")
            elif mesh[axis] > 1 and is_model_axis(axis) and axis not in rule_axes:
                user = "" if axis in AXIS_ROLES else (f" ({axis!r} is a user axis; shardkit's own axes are "
                                                       f"{', '.join(AXIS_ROLES)}: a typo?)")
                problems.append(
                    f"mesh axis {axis!r} (size {mesh[axis]}) is used by no layout rule, so every {axis} rank would "
                    f"compute the same thing; add rules that split parameters over {axis!r} or remove the axis{user}"
                )
        names = mesh.names
        if "dp" in names and "fsdp" in names and mesh["dp"] > 1 and mesh["fsdp"] > 1:
            late = [a for a in ("fsdp", "sp", "ep") if a in names and names.index(a) < names.index("dp") and mesh[a] > 1]
            if late:
                problems.append(f"mesh {mesh!r}: with dp and fsdp together (HSDP), 'dp' must come before {late} "
                                f"(the replicate dim is outermost), e.g. Mesh(dp={mesh['dp']}, fsdp={mesh['fsdp']}, ...)")
        if self.sequence_parallel and mesh.size_of("tp") == 1:
            problems.append("sequence_parallel=True needs a 'tp' axis of size > 1 (Megatron-style SP splits the "
                            "sequence over the tensor-parallel group); for context parallel use an 'sp' mesh axis")
        if self.pipeline is not None:
            problems.extend(self.pipeline.check_mesh(mesh))
            if self.sequence_parallel and mesh.size_of("pp") > 1:
                problems.append(f"sequence_parallel=True with a pipeline (pp={mesh['pp']}) is not supported: a stage's "
                                f"residual stream would mix sequence-split DTensors with plain tensors; use "
                                f"sequence_parallel=False with pp, or no pipeline")
            if mesh.size_of("sp") > 1 and mesh.size_of("pp") > 1:
                problems.append(f"context parallel (sp={mesh['sp']}) with a pipeline (pp={mesh['pp']}) is not supported: "
                                f"a pipeline stage is not handed the global positions of its sequence chunk; use "
                                f"the sp devices for dp, fsdp or tp instead")
            if self.recompute != "none" and self.pipeline.schedule in ("zero-bubble", "zbv"):
                problems.append(f"recompute={self.recompute!r} with schedule {self.pipeline.schedule!r}: the schedule "
                                f"runs each backward as an input pass and a weight pass, and torch's activation "
                                f"checkpointing recomputes a block once per backward, so the weight pass fails; use "
                                f"schedule '1f1b', 'interleaved-1f1b' or 'gpipe', or recompute='none'")
        if self.replicas is not None:
            problems.extend(self.replicas.check_mesh(mesh))
        return problems + zero_problems(self) + loss_scale_problems(self.loss_scale, self.fsdp.param_dtype,
                                                                    self.fsdp.reduce_dtype)

    def batch_problems(self, batch_size: int, seq_len: int | None = None) -> list[str]:
        """Problems of a global batch under this (resolved) plan: its split over the data
        replicas, into pipeline micro-batches, and of its sequence over ``sp`` / Megatron SP.

        >>> Plan(mesh=Mesh(dp=2, tp=2), rules=LayoutMap([(".*", None)])).batch_problems(3)
        ['batch of 3 samples does not split evenly over 2 data-parallel replicas (dp=2 x fsdp=1); use a multiple of 2']
        >>> Plan(mesh=Mesh(dp=2)).batch_problems(-1)
        ['a batch of -1 samples: give a whole number of samples, a positive multiple of 2 (dp=2 x fsdp=1), e.g. 2']
        """
        data = self.mesh.data_size
        if type(batch_size) is not int or batch_size < 1:
            step = data * (self.pipeline.microbatches if self.pipeline is not None else 1)
            axes = _data_axes_text(self.mesh) + (
                f" x {self.pipeline.microbatches} micro-batches" if self.pipeline is not None else "")
            return [f"a batch of {batch_size!r} samples: give a whole number of samples, a positive multiple of "
                    f"{step} ({axes}), e.g. {step}"]
        if self.pipeline is not None:
            problems = self.pipeline.check_batch(batch_size, data)
        elif batch_size % data:
            axes = _data_axes_text(self.mesh)
            problems = [f"batch of {batch_size} samples does not split evenly over {data} data-parallel replicas "
                        f"({axes}); use a multiple of {data}"]
        else:
            problems = []
        if seq_len is not None:
            problems += sequence_problems(self, seq_len)
        return problems

    # -- serialisation ------------------------------------------------------------------------
    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_dict(self) -> dict[str, Any]:
        """The plan as a plan file holds it (``loss_scale`` only when written)."""
        return {
            "mesh": self.mesh.to_dict(),
            "rules": None if self.rules is None else self.rules.to_list(),
            "strict": True if self.rules is None else self.rules.strict,
            "fsdp": self.fsdp.to_dict(),
            "pipeline": None if self.pipeline is None else self.pipeline.to_dict(),
            "replicas": None if self.replicas is None else self.replicas.to_dict(),
            "sequence_parallel": self.sequence_parallel,
            "recompute": self.recompute,
            "zero": self.zero,
            **({} if self.loss_scale is None else {"loss_scale": self.loss_scale}),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """A plan from parsed JSON/YAML; every field is type-checked and named when wrong.

        >>> Plan.from_dict({"mesh": {"dp": 2}, "sequence_parallel": "false"})
        Traceback (most recent call last):
            ...
        shardkit.plan.errors.PlanError: plan field 'sequence_parallel' must be true or false, got str 'false'
        """
        data = mapping(data, "a plan", '{"mesh": {"fsdp": 2, "tp": 2}}')
        known_keys(data, [f.name for f in fields(cls)] + ["strict"], "plan", required=["mesh"])
        mesh = Mesh.from_dict(mapping(data["mesh"], "plan field 'mesh'", "{fsdp: 2, tp: 2}"))
        rules = data.get("rules")
        strict = boolean(data.get("strict", True), "plan field 'strict'")
        if rules is not None and (isinstance(rules, (str, Mapping)) or not isinstance(rules, list)):
            raise PlanError(f"plan field 'rules' must be a list of [regex, layout] pairs such as "
                            f"[['lm_head\\\\.weight', [tp, null]], ['.*', null]], got {type(rules).__name__}")
        pipeline, replicas = data.get("pipeline"), data.get("replicas")
        return cls(
            mesh=mesh,
            rules=None if rules is None else LayoutMap.from_list(rules, strict=strict),
            fsdp=FSDPOptions.from_dict(data.get("fsdp", {})),
            pipeline=None if pipeline is None else Pipeline.from_dict(
                mapping(pipeline, "plan field 'pipeline'", "{schedule: 1f1b, microbatches: 4}")),
            replicas=None if replicas is None else ReplicaGrouping.from_dict(
                mapping(replicas, "plan field 'replicas'", "{replication_factor: 4, group_size: 2}")),
            sequence_parallel=boolean(data.get("sequence_parallel", False), "plan field 'sequence_parallel'"),
            recompute=_recompute(data.get("recompute", "none"), "plan field 'recompute'"),
            zero=_zero(data.get("zero"), "plan field 'zero'"),
            loss_scale=check_loss_scale(data.get("loss_scale"), "plan field 'loss_scale'"),
        )

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(read_text(text, "plan"))

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> Plan:
        return cls.from_dict(read_text(text, "plan", yaml=True))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan file: ``.json``, or ``.yaml`` / ``.yml`` (a key given twice is an error); every
        problem names the file."""
        data = read_file(path, "plan")
        try:
            return cls.from_dict(data)
        except PlanError as exc:
            raise PlanError([f"plan file {str(path)!r}: {problem}" for problem in exc.problems]) from None

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.write_text(self.to_yaml() if path.suffix in (".yaml", ".yml") else self.to_json() + "\n")


def zero_problems(plan: Plan) -> list[str]:
    """Contradictions between ``plan.zero`` and the mesh or the ``fsdp`` options (none without a stage).

    >>> zero_problems(Plan(mesh=Mesh(fsdp=4), zero=1))
    ["zero=1 shards only the optimizer state, over 'dp', but the mesh has fsdp=4, which shards parameters and gradients too (that is zero=2 or 3); use Mesh(dp=4) with zero=1, or zero=3"]
    """
    zero, mesh = plan.zero, plan.mesh
    if zero is None:
        return []
    fsdp, dp = mesh.size_of("fsdp"), mesh.size_of("dp")
    if zero == 1:
        problems = []
        if fsdp > 1:
            problems.append(f"zero=1 shards only the optimizer state, over 'dp', but the mesh has fsdp={fsdp}, which "
                            f"shards parameters and gradients too (that is zero=2 or 3); use Mesh(dp={dp * fsdp}) with "
                            f"zero=1, or zero=3")
        elif dp == 1:
            problems.append(f"zero=1 shards the optimizer state over the 'dp' axis, and the mesh {mesh!r} has none of "
                            f"size > 1; add one, e.g. Mesh(dp=2, ...), or zero=None")
        others = {a: mesh[a] for a in mesh.names if a not in ("dp", "fsdp") and mesh[a] > 1}
        if others:
            problems.append(f"zero=1 with {others}: torch's ZeroRedundancyOptimizer partitions whole local tensors "
                            f"over one process group and cannot hold tensor-parallel, context-parallel or pipeline "
                            f"parts; use zero=1 on a mesh of 'dp' alone, or zero=2/3 with fsdp")
        if plan.replicas is not None:
            problems.append("zero=1 with replica groups: the optimizer would be partitioned over every dp rank while "
                            "gradients are averaged within groups; use replicas=None with zero=1")
        if plan.fsdp.mixed_precision:
            problems.append(f"zero=1 with mixed precision (param_dtype={plan.fsdp.param_dtype!r}, reduce_dtype="
                            f"{plan.fsdp.reduce_dtype!r}): torch applies the policy through FSDP2, whose parameters "
                            f"ZeroRedundancyOptimizer cannot partition; use float32 with zero=1, or zero=2/3")
        return problems
    if fsdp == 1:
        return [f"zero={zero} shards parameters, gradients and optimizer state over the 'fsdp' axis, and the mesh "
                f"{mesh!r} has none of size > 1; add one, e.g. Mesh(fsdp=2, ...) (with dp in front: HSDP), or "
                f"zero=1 over dp"]
    keep = zero == 3
    if plan.fsdp.written and plan.fsdp.reshard_after_forward != keep:  # a default the user did not write is the stage's
        return [f"zero={zero} {'frees' if keep else 'keeps'} gathered parameters after the forward, but the plan has "
                f"fsdp reshard_after_forward={plan.fsdp.reshard_after_forward}; set FSDPOptions(reshard_after_forward="
                f"{keep}) or leave it out (plan file: fsdp: {{reshard_after_forward: {str(keep).lower()}}}, or no "
                f"such key), or zero={2 if keep else 3}"]
    return []


def _data_axes_text(mesh: Mesh) -> str:
    """The data axes a batch splits over, as ``dp=2 x fsdp=1`` (``ep`` only when the mesh has it)."""
    return " x ".join(f"{a}={mesh.size_of(a)}" for a in DATA_AXES if a != "ep" or a in mesh)


__all__ = ["RECOMPUTE", "ZERO_STAGES", "zero_problems", "FSDPOptions", "Plan", "param_shapes"]
