"""Pipeline: how layers are split into stages and scheduled (filled out by the pipeline work)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .mesh import Mesh


@dataclass(frozen=True)
class Pipeline:
    """Pipeline stages and schedule over the ``pp`` axis."""

    stages: int | None = None
    schedule: str = "1f1b"
    microbatches: int = 1

    def check_mesh(self, mesh: Mesh) -> list[str]:
        if self.stages is not None and self.stages != mesh.size_of("pp"):
            return [f"pipeline has {self.stages} stages but mesh axis 'pp' has size {mesh.size_of('pp')}"]
        return []

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Pipeline:
        return cls(**data)
