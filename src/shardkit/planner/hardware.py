"""What a device can do, as data the estimator reads: memory, peak FLOP/s by dtype, memory
bandwidth, the fixed cost of an operator call, how much communication overlaps compute, and each
collective's alpha-beta cost within and across nodes (:class:`Hardware`).

Presets for datasheet machines (:data:`PRESETS`), files written by ``shardkit calibrate``, or
your own file: all are the same strict format (a key given twice, an unknown key, a missing
field, a wrong type or a non-positive number is an error naming the field)::

    >>> h = Hardware.preset("h100-80g")
    >>> h.peak_flops("bfloat16") / 1e12, h.devices_per_node
    (989.4, 8)
    >>> link = h.link("all_reduce", across_nodes=True)
    >>> round(link.seconds(2**30, factor=2 * 7 / 8, steps=2 * 7) * 1e3, 2)   # 1 GiB, ring of 8
    50.19
    >>> Hardware.from_dict({**h.to_dict(), "memory": "80GB"})
    Traceback (most recent call last):
        ...
    shardkit.plan.errors.PlanError: hardware: field 'memory' must be a whole number of bytes (an integer), got str '80GB'

The cost of one collective over ``n`` devices on a link is
``steps * latency + factor * S / bandwidth`` (:meth:`Link.seconds`, :func:`ring_terms`), where
``S`` is the whole tensor's bytes (all-reduce: the tensor; all-gather: the gathered output;
reduce-scatter: its input; point-to-point: the message) and ``bandwidth`` is the *bus bandwidth*
one device reaches, as NCCL-tests reports it (``busbw = factor * S / t``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..plan.dtypes import FLOATING, dtype_name
from ..plan.errors import PlanError, UsageError
from ..plan.files import known_keys, mapping, read_file
from .links import (
    COLLECTIVES,
    STANDS_IN,
    Link,
    collective_kind,
    describe,
    number,
    positive_number,
    ring_terms,
)

#: The dtypes every :class:`Hardware` gives a peak for: the plan's floating dtypes.
DTYPES = FLOATING
#: The suffixes of hardware files.
SUFFIXES = (".json", ".yaml", ".yml")
_FIELDS = ("name", "memory", "flops", "devices_per_node", "intra_node", "inter_node", "matmul_efficiency",
           "matmul_latency", "attention_efficiency", "memory_bandwidth", "op_overhead", "dtensor_overhead", "dtensor_collective", "skew",
           "sync_idle", "overlap", "shared_compute", "cores_per_node", "reserved")
#: Fields added after files were first written: a file without them reads as the value given here
#: (a file of ``shardkit calibrate`` written before had no DTensor probe: the presets' figure).
_DTENSOR_OVERHEAD = 1e-5  # the presets' (the comments of the presets below)
_DTENSOR_COLLECTIVE = 1e-4
_OPTIONAL = {"matmul_latency": 0.0, "attention_efficiency": 1.0, "dtensor_overhead": _DTENSOR_OVERHEAD,
             "dtensor_collective": _DTENSOR_COLLECTIVE, "skew": 0.0, "sync_idle": 0.0, "cores_per_node": 0}
_LINK_FIELDS = ("bandwidth", "latency")
_NESTED = {"flops": DTYPES, "intra_node": COLLECTIVES, "inter_node": COLLECTIVES}  # mapping fields: their keys


@dataclass(frozen=True)
class Hardware:
    """One kind of device and its links: what the planner's estimates are computed for.

    - ``memory``: bytes of device memory per device (what the driver reports); ``reserved`` of
      them hold no tensors (CUDA context, NCCL buffers);
    - ``flops``: peak FLOP/s per dtype name, ``float32``, ``bfloat16`` and ``float16``;
      ``matmul_efficiency``: the fraction of it a large matrix product reaches in practice
      (1.0 for a calibrated machine, whose ``flops`` are measured); ``matmul_latency``: seconds
      of fixed device time per matrix product, so that a product of ``F`` FLOPs takes
      ``F / (peak x matmul_efficiency) + matmul_latency``: its efficiency grows with its size
      (:meth:`matmul_efficiency_at`); ``attention_efficiency``: the fraction of that rate a fused
      attention kernel (SDPA's flash or memory-efficient one) reaches, forward and backward, on its
      FLOPs as torch counts them (1.0 in the presets; measured by ``shardkit calibrate``);
    - ``memory_bandwidth``: bytes/s one device reads and writes in a large elementwise op (no
      efficiency is applied to it: a preset's is the datasheet's, a calibrated one's measured);
    - ``op_overhead``: seconds of fixed cost per operator call, the part of it not hidden by
      asynchronous execution (a GPU's kernel launch, a CPU's Python and dispatch);
      ``dtensor_overhead``: seconds an operator on a DTensor costs on top of it (DTensor's
      Python dispatch: unwrapping, sharding propagation, wrapping), paid by every operator on
      a DTensor, views included; ``dtensor_collective``: seconds a collective DTensor launches
      (a ``redistribute``: its plan, the functional collective, its wrapper and wait) costs on top of
      the same collective called directly, paid by each of tensor parallel's collectives;
    - ``skew``: how far ranks drift apart while they compute, in seconds per square root of a
      second of compute (a random walk's spread): a blocking collective after ``c`` seconds of
      compute waits ``skew x sqrt(c)`` for the last rank to arrive (processes sharing cores drift
      by the scheduler's slices; measured by ``shardkit calibrate``, 0 in the presets); ``sync_idle``:
      seconds a blocking collective leaves the devices idle beyond its link's latency (processes sharing
      cores, each woken in turn as its messages arrive; measured, 0 in the presets);
    - ``overlap``: the fraction in [0, 1] of communication time that can run while computing
      (about 1.0 on GPUs, whose NCCL runs on streams of its own; measured on gloo);
    - ``shared_compute``: whether the devices are processes sharing fewer cores (a local CPU
      world larger than the machine's cores): a device left idle, in a pipeline's bubble, lends
      its cores to the others (false on GPUs); ``cores_per_node``: the cores they share (0: not
      known, as in files written before it): a pipeline's fill and drain, with fewer stages
      computing than cores, leave cores idle all the same;
    - ``devices_per_node``; ``intra_node`` and ``inter_node``: one :class:`Link` per collective
      in :data:`COLLECTIVES`; ``reduce_scatter`` may be left out (files written before it was
      measured), and then runs on ``all_gather``'s link, as a ring would.

    ``op_overhead``, ``dtensor_overhead``, ``dtensor_collective``, ``matmul_latency``, ``skew``, ``sync_idle``,
    ``overlap``, ``shared_compute`` and ``cores_per_node`` default to an ideal device's 0.0, 0.0, 0.0, 0.0, 0.0,
    0.0, 1.0, false and 0 in Python, ``attention_efficiency`` to 1.0 (files require every field but
    ``matmul_latency``, ``attention_efficiency``, ``dtensor_overhead``, ``dtensor_collective``, ``skew``,
    ``sync_idle`` and ``cores_per_node``, which files written before them lack:
    :data:`_OPTIONAL`); ``memory_bandwidth`` has no default, as devices differ by 100x.

    >>> a100 = Hardware.preset("a100-80g")
    >>> a100.usable_memory / 2**30, a100.memory_bandwidth / 1e9, a100.op_overhead, a100.overlap
    (79.0, 2039.0, 4e-06, 1.0)
    """

    name: str
    memory: int
    flops: Mapping[str, float]
    devices_per_node: int
    intra_node: Mapping[str, Link]
    inter_node: Mapping[str, Link]
    memory_bandwidth: float
    matmul_efficiency: float = 1.0
    reserved: int = 0
    op_overhead: float = 0.0
    overlap: float = 1.0
    matmul_latency: float = 0.0
    attention_efficiency: float = 1.0
    dtensor_overhead: float = 0.0
    dtensor_collective: float = 0.0
    skew: float = 0.0
    sync_idle: float = 0.0
    shared_compute: bool = False
    cores_per_node: int = 0

    def __post_init__(self) -> None:
        for side in ("intra_node", "inter_node"):  # a collective left out runs on the link that stands in for it
            links = getattr(self, side)
            missing = {c: links[s] for c, s in STANDS_IN.items() if c not in links and s in links} \
                if isinstance(links, Mapping) else {}
            if missing:
                object.__setattr__(self, side, {**links, **missing})
        problems = _field_problems(self)
        if problems:
            raise PlanError([f"Hardware: {p}" for p in problems])
        for name in _NESTED:  # copies, so a caller's later change to its mapping changes nothing here
            object.__setattr__(self, name, dict(getattr(self, name)))
        # by value, although the mappings are dicts; computed once: the estimator's link cache hashes it per call
        object.__setattr__(self, "_hash", hash(json.dumps(self.to_dict(), sort_keys=True)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def usable_memory(self) -> int:
        """Bytes of device memory tensors can use: ``memory - reserved``."""
        return self.memory - self.reserved

    def link(self, collective: str, across_nodes: bool) -> Link:
        """The :class:`Link` ``collective`` runs on."""
        links = self.inter_node if across_nodes else self.intra_node
        return links[collective_kind(collective, "Hardware.link")]

    def matmul_efficiency_at(self, flops: float, dtype: Any) -> float:
        """The fraction of ``dtype``'s peak a matrix product of ``flops`` FLOPs reaches:
        ``matmul_efficiency x F / (F + matmul_efficiency x peak x matmul_latency)``, the fixed
        time per product amortised over its FLOPs (the planner prices a part's products as their
        FLOPs at ``matmul_efficiency`` plus ``matmul_latency`` each).

        >>> a100 = Hardware.preset("a100-80g")
        >>> [round(a100.matmul_efficiency_at(2 * n**3, "bfloat16"), 2) for n in (1024, 2048, 4096, 8192)]
        [0.57, 0.81, 0.85, 0.86]
        """
        if flops <= 0:
            raise UsageError(f"Hardware.matmul_efficiency_at(flops={flops!r}): give a product's FLOPs, > 0")
        ceiling = self.matmul_efficiency
        return ceiling * flops / (flops + ceiling * self.peak_flops(dtype) * self.matmul_latency)

    def peak_flops(self, dtype: Any) -> float:
        """Peak FLOP/s for ``dtype`` (a name such as ``"bfloat16"`` or a ``torch.dtype``)."""
        name = dtype_name(dtype)
        if name not in self.flops:
            raise UsageError(f"Hardware.peak_flops: no peak for dtype {dtype!r}; valid: {', '.join(DTYPES)}")
        return self.flops[name]

    # -- files ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (the file format): every field, links as ``{bandwidth, latency}``."""
        data = {name: getattr(self, name) for name in _FIELDS}
        data["flops"] = {dtype: self.flops[dtype] for dtype in DTYPES}
        data.update({side: _links_to_dict(data[side]) for side in ("intra_node", "inter_node")})
        return data

    @classmethod
    def from_dict(cls, data: Any, what: str = "hardware") -> Hardware:
        """A :class:`Hardware` from parsed JSON/YAML: every field required, every problem named
        (``what`` starts each message, e.g. the file's name)."""
        data = mapping(data, what, "{name: ..., memory: ..., flops: {...}, ...}")
        problems = _unknown(data, _FIELDS, what)
        problems += [f"missing field {name!r}" for name in _FIELDS
                     if name not in data and name not in _NESTED and name not in _OPTIONAL]
        for name in _NESTED:
            problems += _nested_missing(data, name)
        problems += _dict_value_problems(data)
        if problems:
            raise PlanError([p if p.startswith(what) else f"{what}: {p}" for p in problems])
        links = {side: {c: Link(**data[side][c]) for c in COLLECTIVES if c in data[side]}
                 for side in ("intra_node", "inter_node")}
        scalars = {name: data.get(name, _OPTIONAL.get(name)) for name in _FIELDS if name not in _NESTED}
        return cls(flops=dict(data["flops"]), **scalars, **links)

    def save(self, path: str | Path) -> None:
        """Write ``path`` (``.json``, ``.yaml``, ``.yml``; :meth:`load` reads it back equal) whole or not at all:
        a temporary file renamed over it, so a killed process leaves the old file, never half a new one."""
        import os
        import tempfile

        path = Path(path)
        _check_suffix(path, "Hardware.save")
        if path.suffix == ".json":
            text = json.dumps(self.to_dict(), indent=2) + "\n"
        else:
            import yaml

            text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
        try:
            with os.fdopen(handle, "w") as out:
                out.write(text)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)

    @classmethod
    def load(cls, path: str | Path) -> Hardware:
        """Read a hardware file (``.json``, ``.yaml``, ``.yml``), strictly."""
        path = Path(path)
        _check_suffix(path, "Hardware.load")
        return cls.from_dict(read_file(path, "hardware"), f"hardware file {str(path)!r}")

    @classmethod
    def preset(cls, name: str) -> Hardware:
        """A datasheet machine from :data:`PRESETS`."""
        if name not in PRESETS:
            raise UsageError(f"unknown hardware preset {name!r}; known presets: {', '.join(PRESETS)}")
        return PRESETS[name]


def hardware(spec: str | Path | Hardware) -> Hardware:
    """The :class:`Hardware` ``spec`` names: an instance, a preset name, or a file path
    (``.json``, ``.yaml`` or ``.yml``).

    >>> hardware("h200-141g").memory / 2**30
    140.4013671875
    >>> hardware("h100")
    Traceback (most recent call last):
        ...
    shardkit.plan.errors.UsageError: unknown hardware 'h100': a preset (a100-80g, h100-80g, h200-141g) or a file ending in .json, .yaml or .yml
    """
    if isinstance(spec, Hardware):
        return spec
    if isinstance(spec, Path) or (isinstance(spec, str) and spec.endswith(SUFFIXES)):
        return Hardware.load(spec)
    if isinstance(spec, str) and spec in PRESETS:
        return PRESETS[spec]
    raise UsageError(f"unknown hardware {spec!r}: a preset ({', '.join(PRESETS)}) or a file ending in "
                     f"{', '.join(SUFFIXES[:-1])} or {SUFFIXES[-1]}")


# -- checks: each returns a problem naming the field, or None -------------------------------------


def _integer(value: Any, where: str, minimum: int, unit: str) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"field {where!r} must be a whole number of {unit} (an integer), got {describe(value)}"
    if value < minimum:
        return f"field {where!r} must be >= {minimum}, got {value}"
    return None


def _scalar_problems(values: Mapping[str, Any]) -> list[str]:
    """Problems of the fields that are not mappings (only those present are checked)."""
    checks = {
        "name": lambda v: None if isinstance(v, str) and v.strip() else
        f"field 'name' must be a non-empty string, got {describe(v)}",
        "memory": lambda v: _integer(v, "memory", 1, "bytes"),
        "devices_per_node": lambda v: _integer(v, "devices_per_node", 1, "devices"),
        "matmul_efficiency": lambda v: positive_number(v, "matmul_efficiency") or (
            None if v <= 1 else f"field 'matmul_efficiency' must be a fraction in (0, 1], got {v!r}"),
        "attention_efficiency": lambda v: positive_number(v, "attention_efficiency") or (
            None if v <= 1 else f"field 'attention_efficiency' must be a fraction in (0, 1], got {v!r}"),
        "memory_bandwidth": lambda v: positive_number(v, "memory_bandwidth"),
        "op_overhead": lambda v: number(v, "op_overhead", 0.0),
        "dtensor_overhead": lambda v: number(v, "dtensor_overhead", 0.0),
        "dtensor_collective": lambda v: number(v, "dtensor_collective", 0.0),
        "skew": lambda v: number(v, "skew", 0.0),
        "sync_idle": lambda v: number(v, "sync_idle", 0.0),
        "matmul_latency": lambda v: number(v, "matmul_latency", 0.0),
        "overlap": lambda v: number(v, "overlap", 0.0) or (
            None if v <= 1 else f"field 'overlap' must be a fraction in [0, 1], got {v!r}"),
        "shared_compute": lambda v: None if isinstance(v, bool) else
        f"field 'shared_compute' must be true or false, got {describe(v)}",
        "reserved": lambda v: _integer(v, "reserved", 0, "bytes"),
        "cores_per_node": lambda v: _integer(v, "cores_per_node", 0, "cores"),
    }
    problems = [problem for name, check in checks.items() if name in values and (problem := check(values[name]))]
    memory, reserved = values.get("memory"), values.get("reserved")
    if not problems and memory is not None and reserved is not None and reserved >= memory:
        problems.append(f"field 'reserved' ({reserved}) must be less than field 'memory' ({memory})")
    return problems


def _field_problems(hw: Hardware) -> list[str]:
    """Every problem of a constructed Hardware's fields."""
    problems = _scalar_problems({name: getattr(hw, name) for name in _FIELDS})
    for name, keys in _NESTED.items():
        value = getattr(hw, name)
        if not isinstance(value, Mapping):
            problems.append(f"field {name!r} must be a mapping with keys {list(keys)}, got {describe(value)}")
            continue
        problems += _unknown(value, keys, f"field {name!r}")
        problems += [f"missing field '{name}.{key}'" for key in keys if key not in value]
        for key in keys:
            if key not in value:
                continue
            if name == "flops":
                problems += [p for p in [positive_number(value[key], f"flops.{key}")] if p]
            elif not isinstance(value[key], Link):
                problems.append(f"field '{name}.{key}' must be a Link, got {describe(value[key])}")
    return problems


def _unknown(data: Mapping[str, Any], valid: tuple[str, ...], where: str) -> list[str]:
    try:
        known_keys(data, valid, where)
    except PlanError as exc:
        return exc.problems
    return []


def _nested_missing(data: Mapping[str, Any], name: str) -> list[str]:
    """Missing keys of a nested mapping, named down to its leaves."""
    keys = _NESTED[name]
    leaves = _LINK_FIELDS if name != "flops" else ()
    if name not in data:
        return [f"missing field '{name}' (a mapping with keys {list(keys)})"]
    value = data[name]
    if not isinstance(value, Mapping):
        return [f"field {name!r} must be a mapping with keys {list(keys)}, got {describe(value)}"]
    problems = _unknown(value, keys, f"field {name!r}")
    for key in keys:
        path = f"{name}.{key}"
        if key not in value and not (leaves and STANDS_IN.get(key) in value):
            problems.append(f"missing field {path!r}" + (f" (a mapping with keys {list(leaves)})" if leaves else ""))
        elif leaves and key in value:
            link = value[key]
            if not isinstance(link, Mapping):
                problems.append(f"field {path!r} must be a mapping with keys {list(leaves)}, got {describe(link)}")
                continue
            problems += _unknown(link, leaves, f"field {path!r}")
            problems += [f"missing field '{path}.{leaf}'" for leaf in leaves if leaf not in link]
    return problems


def _dict_value_problems(data: Mapping[str, Any]) -> list[str]:
    """Type and value problems of the fields present in parsed data."""
    problems = _scalar_problems(data)
    flops = data.get("flops")
    if isinstance(flops, Mapping):
        problems += [p for d in DTYPES if d in flops and (p := positive_number(flops[d], f"flops.{d}"))]
    for side in ("intra_node", "inter_node"):
        links = data.get(side)
        if not isinstance(links, Mapping):
            continue
        for c in COLLECTIVES:
            link = links.get(c)
            if isinstance(link, Mapping):
                checks = ((positive_number, "bandwidth"), (lambda v, w: number(v, w, 0.0), "latency"))
                problems += [p for check, leaf in checks
                             if leaf in link and (p := check(link[leaf], f"{side}.{c}.{leaf}"))]
    return problems


def _links_to_dict(links: Mapping[str, Link]) -> dict[str, dict[str, float]]:
    return {c: {"bandwidth": links[c].bandwidth, "latency": links[c].latency} for c in COLLECTIVES}


def _check_suffix(path: Path, caller: str) -> None:
    if path.suffix not in SUFFIXES:
        raise UsageError(f"{caller}({str(path)!r}): a hardware file ends in {', '.join(SUFFIXES)}, "
                         f"got {path.suffix or 'no suffix'!r}")


# -- presets --------------------------------------------------------------------------------------
# Sources: NVIDIA A100 datasheet (A100 SXM4 80GB: 312 TFLOP/s dense bf16/fp16, 19.5 TFLOP/s fp32,
# 156 TF32; NVLink3 600 GB/s total = 300 GB/s each way), NVIDIA H100 datasheet (H100 SXM5: 989.4
# TFLOP/s dense bf16/fp16, 67 fp32, 494.7 TF32; NVLink4 900 GB/s total = 450 GB/s each way), NVIDIA
# H200 datasheet (H200 SXM: 141 GB HBM3e, the H100's compute and NVLink). Inter-node: DGX A100 has
# 8x 200 Gb/s HDR InfiniBand (25 GB/s per GPU), DGX H100/H200 8x 400 Gb/s NDR (50 GB/s per GPU).
#
# Choices, each with its reason and source, in docs/hardware.md ("Presets"):
# plain fp32 (not TF32); the driver's memory, 1 GiB reserved; matmul_efficiency the published maximum
# achievable rate (A100 0.859) or 0.8 (H100/H200, as measured on an H200 here); matmul_latency and
# op_overhead a launch's 4 us; bus bandwidth 75 % (all-reduce) and 80 % (the rest) of the link's one-way
# peak, as NCCL-tests reach; 2 us a ring step within a node, 6 us across; the datasheet's HBM bandwidth;
# dtensor_overhead 10 us as measured on CPU, dtensor_collective 100 us an order of magnitude; overlap 1.0.
_BUS_EFFICIENCY = {"all_reduce": 0.75, "all_gather": 0.80, "reduce_scatter": 0.80, "p2p": 0.80}
_INTRA_LATENCY, _INTER_LATENCY = 2e-6, 6e-6
_GPU_OP_OVERHEAD = 4e-6
_GPU_MATMUL_LATENCY = 4e-6
_MIB = 2**20


def _links(peak_one_way: float, latency: float) -> dict[str, Link]:
    return {c: Link(bandwidth=_BUS_EFFICIENCY[c] * peak_one_way, latency=latency) for c in COLLECTIVES}


def _preset(name: str, memory_mib: int, fp32: float, half: float, hbm: float, nvlink: float,
            network: float, matmul_efficiency: float = 0.8) -> Hardware:
    return Hardware(name=name, memory=memory_mib * _MIB,
                    flops={"float32": fp32, "bfloat16": half, "float16": half}, devices_per_node=8,
                    intra_node=_links(nvlink, _INTRA_LATENCY), inter_node=_links(network, _INTER_LATENCY),
                    memory_bandwidth=hbm, matmul_efficiency=matmul_efficiency, reserved=1024 * _MIB,
                    op_overhead=_GPU_OP_OVERHEAD, overlap=1.0, matmul_latency=_GPU_MATMUL_LATENCY,
                    dtensor_overhead=_DTENSOR_OVERHEAD, dtensor_collective=_DTENSOR_COLLECTIVE)


#: Datasheet machines by name (sources and choices in the comments above and docs/hardware.md).
PRESETS: dict[str, Hardware] = {
    "a100-80g": _preset("a100-80g", 81920, 19.5e12, 312e12, 2039e9, 300e9, 25e9, matmul_efficiency=0.859),
    "h100-80g": _preset("h100-80g", 81559, 67e12, 989.4e12, 3350e9, 450e9, 50e9),
    "h200-141g": _preset("h200-141g", 143771, 67e12, 989.4e12, 4800e9, 450e9, 50e9),
}

__all__ = ["COLLECTIVES", "DTYPES", "PRESETS", "Hardware", "Link", "hardware", "ring_terms"]
