"""A training run's metrics on disk: TensorBoard event files and a JSON-lines file, in one folder.

TensorBoard is written by torch's own :class:`torch.utils.tensorboard.SummaryWriter`; the same
values go to ``metrics.jsonl``, one JSON object per logged step (``{"step": 3, "loss": ...}``),
for scripts that read no event files. A nested value (``{"memory_bytes": {"rank0": ...}}``)
becomes one TensorBoard tag per key (``memory_bytes/rank0``). Only one process should write.

>>> import json, tempfile
>>> folder = tempfile.mkdtemp()
>>> with MetricsWriter(folder) as writer:
...     writer.write(1, {"loss": 2.5, "memory_bytes": {"rank0": 1024}})
>>> json.loads(open(f"{folder}/{METRICS_FILE}").readline())
{'step': 1, 'loss': 2.5, 'memory_bytes': {'rank0': 1024}}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

#: The JSON-lines file in the log folder.
METRICS_FILE = "metrics.jsonl"

Scalars = Mapping[str, "float | int | Scalars"]


class MetricsWriter:
    """Writes each step's scalars to TensorBoard and to ``metrics.jsonl`` in ``log_dir`` (appending,
    so a resumed run continues the same files)."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.board = SummaryWriter(str(self.log_dir))
        self.lines = (self.log_dir / METRICS_FILE).open("a")

    def write(self, step: int, scalars: Scalars) -> None:
        """One step's values: a line of ``metrics.jsonl`` and one TensorBoard scalar per value."""
        self.lines.write(json.dumps({"step": step, **scalars}) + "\n")
        self.lines.flush()
        for tag, value in _flat(scalars):
            self.board.add_scalar(tag, value, step)
        self.board.flush()

    def close(self) -> None:
        self.board.close()
        self.lines.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _flat(scalars: Scalars, prefix: str = "") -> list[tuple[str, float]]:
    out = []
    for key, value in scalars.items():
        if isinstance(value, Mapping):
            out += _flat(value, f"{prefix}{key}/")
        else:
            out.append((f"{prefix}{key}", value))
    return out


__all__ = ["METRICS_FILE", "MetricsWriter"]
