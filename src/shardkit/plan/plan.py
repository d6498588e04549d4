"""Plan: the one serialisable description of how a model is split."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import PlanError, PlanWarning
from .layout import LayoutMap, LayoutResolution, resolve_layouts
from .mesh import AXIS_ROLES, DATA_AXES, Mesh
from .pipeline import Pipeline
from .replicas import ReplicaGrouping

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class FSDPOptions:
    """Options for the ``fsdp`` axis (passed to torch's ``fully_shard``).

    ``param_dtype`` / ``reduce_dtype``: mixed precision (``"bfloat16"``, ``"float16"``,
    ``"float32"`` or ``None`` to keep the parameter dtype).
    """

    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _DTYPES:
                raise PlanError(f"FSDPOptions.{name}={value!r}; valid: None or one of {list(_DTYPES)}")


def param_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """``{dotted name: shape}`` of a module's parameters (works on the meta device), or a copy of a mapping."""
    if isinstance(model, Mapping):
        return {str(k): tuple(int(d) for d in v) for k, v in model.items()}
    if hasattr(model, "named_parameters"):
        return {n: tuple(p.shape) for n, p in model.named_parameters()}
    raise PlanError(f"cannot read parameters from {type(model).__name__}; pass an nn.Module (on the meta device is fine) "
                    f"or a mapping of parameter name -> shape")


@dataclass(frozen=True)
class ValidationReport:
    """What ``Plan.validate`` found: the resolved layouts and the warnings it raised."""

    mesh: Mesh
    layouts: LayoutResolution
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    """How a model is split: mesh, layout rules, FSDP options, pipeline, replica groups.

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

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise PlanError(f"Plan(mesh=...) must be a shardkit Mesh, got {type(self.mesh).__name__}; e.g. Mesh(dp=2)")
        if self.rules is not None and not isinstance(self.rules, LayoutMap):
            object.__setattr__(self, "rules", LayoutMap(self.rules))

    # -- validation ------------------------------------------------------------------------
    def resolved(self, world_size: int) -> Plan:
        """This plan with the mesh's ``-1`` axis inferred from ``world_size``."""
        return Plan(**{**self._fields(), "mesh": self.mesh.resolved(world_size)})

    def validate(self, model: Any, world_size: int | None = None) -> ValidationReport:
        """Check the plan against a model (use the meta device: no memory, no processes).

        Raises :class:`PlanError` naming every offending parameter, axis and size.
        Warns (:class:`PlanWarning`) about rules that match no parameter.
        """
        mesh = self.mesh
        if world_size is not None:
            mesh = mesh.resolved(world_size)
        elif not mesh.is_resolved:
            raise PlanError(f"{mesh!r} has an inferred (-1) axis; pass world_size= to validate it")
        problems: list[str] = []
        rule_axes = self.rules.axes() if self.rules is not None else set()
        for axis in mesh.names:
            if axis == "pp" and mesh[axis] > 1 and self.pipeline is None:
                problems.append(f"mesh axis 'pp' (size {mesh[axis]}) needs a pipeline: add "
                                f"Plan(pipeline=Pipeline(stages={mesh[axis]}, ...)) (CLI: --schedule/--split) or remove the axis")
            elif mesh[axis] > 1 and axis not in DATA_AXES and axis not in rule_axes and not self._axis_used_elsewhere(axis):
                problems.append(
                    f"mesh axis {axis!r} (size {mesh[axis]}) is used by no layout rule, so every {axis} rank would "
                    f"compute the same thing; add rules that split parameters over {axis!r} or remove the axis"
                )
        names = mesh.names
        if "dp" in names and "fsdp" in names and mesh["dp"] > 1 and mesh["fsdp"] > 1:
            late = [a for a in ("fsdp", "sp") if a in names and names.index(a) < names.index("dp") and mesh[a] > 1]
            if late:
                problems.append(f"mesh {mesh!r}: with dp and fsdp together (HSDP), 'dp' must come before {late} "
                                f"(the replicate dim is outermost), e.g. Mesh(dp={mesh['dp']}, fsdp={mesh['fsdp']}, ...)")
        if self.sequence_parallel and mesh.size_of("tp") == 1:
            problems.append("sequence_parallel=True needs a 'tp' axis of size > 1 (Megatron-style SP splits the "
                            "sequence over the tensor-parallel group); for context parallel use an 'sp' mesh axis")
        try:
            layouts = resolve_layouts(param_shapes(model), self.rules, mesh)
        except PlanError as exc:
            problems.extend(exc.problems)
            layouts = None
        if self.pipeline is not None:
            problems.extend(self.pipeline.check_mesh(mesh))
            if hasattr(model, "named_modules"):  # stage assignment needs the module tree, not only shapes
                problems.extend(self.pipeline.check_model(model, mesh))
        if self.replicas is not None:
            problems.extend(self.replicas.check_mesh(mesh))
        if problems:
            raise PlanError(problems)
        assert layouts is not None
        found = [f"layout rule {p!r} matches no parameter (a typo or a renamed module?)" for p in layouts.unused_rules]
        for text in found:
            warnings.warn(text, PlanWarning, stacklevel=2)
        return ValidationReport(mesh, layouts, found)

    def batch_problems(self, batch_size: int, seq_len: int | None = None) -> list[str]:
        """Problems of a global batch under this (resolved) plan: its split over the data
        replicas, into pipeline micro-batches, and of its sequence over ``sp`` / Megatron SP.

        >>> Plan(mesh=Mesh(dp=2, tp=2), rules=LayoutMap([(".*", None)])).batch_problems(3)
        ['batch of 3 samples does not split evenly over 2 data-parallel replicas (dp=2 x fsdp=1); use a multiple of 2']
        """
        data = self.mesh.data_size
        if self.pipeline is not None:
            problems = self.pipeline.check_batch(batch_size, data)
        elif batch_size < 1 or batch_size % data:
            axes = " x ".join(f"{a}={self.mesh.size_of(a)}" for a in DATA_AXES)
            problems = [f"batch of {batch_size} samples does not split evenly over {data} data-parallel replicas "
                        f"({axes}); use a multiple of {data}"]
        else:
            problems = []
        if seq_len is not None:
            from .sequence import sequence_problems

            problems += sequence_problems(self, seq_len)
        return problems

    def _axis_used_elsewhere(self, axis: str) -> bool:
        if axis == "pp":
            return self.pipeline is not None
        if axis == "sp":
            return True  # context parallel splits activations, not parameters
        return False

    def explain(self, model: Any, world_size: int | None = None) -> str:
        """A table per parameter: matched rule, layout, local shape and bytes per device."""
        from ..planner.explain import explain_plan

        return explain_plan(self, model, world_size=world_size)

    # -- serialisation ------------------------------------------------------------------------
    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh.to_dict(),
            "rules": None if self.rules is None else self.rules.to_list(),
            "strict": True if self.rules is None else self.rules.strict,
            "fsdp": {f.name: getattr(self.fsdp, f.name) for f in fields(self.fsdp)},
            "pipeline": None if self.pipeline is None else self.pipeline.to_dict(),
            "replicas": None if self.replicas is None else self.replicas.to_dict(),
            "sequence_parallel": self.sequence_parallel,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        known = {"mesh", "rules", "strict", "fsdp", "pipeline", "replicas", "sequence_parallel"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"plan has unknown keys {unknown}; valid keys: {sorted(known)}")
        if "mesh" not in data:
            raise PlanError("plan has no 'mesh'; e.g. {\"mesh\": {\"fsdp\": 2, \"tp\": 2}}")
        rules = data.get("rules")
        fsdp = data.get("fsdp") or {}
        bad = sorted(set(fsdp) - {f.name for f in fields(FSDPOptions)})
        if bad:
            raise PlanError(f"plan 'fsdp' has unknown keys {bad}; valid: {[f.name for f in fields(FSDPOptions)]}")
        return cls(
            mesh=Mesh.from_dict(data["mesh"]),
            rules=None if rules is None else LayoutMap.from_list(rules, strict=bool(data.get("strict", True))),
            fsdp=FSDPOptions(**fsdp),
            pipeline=None if data.get("pipeline") is None else Pipeline.from_dict(data["pipeline"]),
            replicas=None if data.get("replicas") is None else ReplicaGrouping.from_dict(data["replicas"]),
            sequence_parallel=bool(data.get("sequence_parallel", False)),
        )

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> Plan:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PlanError(f"plan is not valid YAML: {exc}") from None
        if not isinstance(data, Mapping):
            raise PlanError(f"a YAML plan must be a mapping at the top level, got {type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan file: ``.json``, or ``.yaml`` / ``.yml``."""
        path = Path(path)
        text = path.read_text()
        return cls.from_yaml(text) if path.suffix in (".yaml", ".yml") else cls.from_json(text)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.write_text(self.to_yaml() if path.suffix in (".yaml", ".yml") else self.to_json() + "\n")


__all__ = ["AXIS_ROLES", "FSDPOptions", "Plan", "ValidationReport", "param_shapes"]
