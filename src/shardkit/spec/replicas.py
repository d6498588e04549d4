"""Replica groups over the data-parallel replicas (filled out by the replica-group work)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .mesh import Mesh


@dataclass(frozen=True)
class ReplicaGrouping:
    """Groups of replicas: ``group_size`` replicas, ``stride`` apart."""

    replication_factor: int
    group_size: int | None = None
    stride: int = 1

    def check_mesh(self, mesh: Mesh) -> list[str]:
        if self.replication_factor != mesh.size_of("dp"):
            return [f"replicas.replication_factor={self.replication_factor} but mesh axis 'dp' has size {mesh.size_of('dp')}"]
        return []

    def to_dict(self) -> dict[str, Any]:
        return {"replication_factor": self.replication_factor, "group_size": self.group_size, "stride": self.stride}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaGrouping:
        return cls(**data)
