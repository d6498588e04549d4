"""A training job's data, checked before launch: the training batches and the held-out ones to evaluate on
(a folder of either kind, or the held-out end of the training data), each problem named by its flag or field.
"""

from __future__ import annotations

from ..io.batch_stream import BatchStream
from ..io.data import TextShards
from ..io.sharded_data import ShardedDataset
from ..plan import PlanError, UsageError
from .config import TrainConfig
from .fields import JobError


def job_data(config: TrainConfig, seq_len: int) -> tuple[BatchStream, BatchStream | None]:
    """The training data and the held-out data to evaluate on (``None``: no evaluation):
    ``eval_holdout`` splits the training data (:meth:`BatchStream.split`), ``eval_data`` is a folder."""
    max_bytes = None if config.data_mb is None else int(config.data_mb * 2**20)
    data = _stream(config, "data", seq_len, max_bytes)
    if config.eval_holdout is not None:
        try:
            data, held = data.split(config.eval_holdout)
        except UsageError as exc:
            raise JobError(f"{config.in_file('eval_holdout')}{config.named('eval_holdout')}: {exc}") from None
    elif config.eval_data is not None:
        held = _stream(config, "eval_data", seq_len, max_bytes)
    else:
        return data, None
    if not isinstance(held.source, ShardedDataset):
        return data, held  # text: random windows, any number of batches
    _check_held_out_size(config, held, seq_len)
    return data, held


def _check_held_out_size(config: TrainConfig, held: BatchStream, seq_len: int) -> None:
    """Sharded held-out data hold at least one global batch, and every evaluation batch once."""
    where = config.in_file("eval_data", "eval_holdout", "batch_size", "eval_batches")
    named = config.named("eval_data" if config.eval_holdout is None else "eval_holdout")
    shards = "" if config.eval_holdout is None else \
        f"the last {len(held.source.shards)} of {len(held.source.manifest.shards)} shards"
    if len(held.source) < config.batch_size:
        raise JobError(f"{where}{named}{shards and ': ' + shards} has {len(held.source)} samples of {seq_len} tokens, "
                       f"fewer than one global batch of {config.batch_size}: give more held-out data or a smaller "
                       f"batch")
    if config.eval_batches * config.batch_size > len(held.source):
        fit = len(held.source) // config.batch_size
        raise JobError(f"{where}{config.named('eval_batches')} x {config.named('batch_size')} = "
                       f"{config.eval_batches * config.batch_size} samples, but {named}{shards and f' ({shards})'} "
                       f"has {len(held.source)} samples of {seq_len} tokens, so evaluation would repeat them; "
                       f"valid: {config.name('eval_batches')} 1..{fit}")


def _stream(config: TrainConfig, name: str, seq_len: int, max_bytes: int | None) -> BatchStream:
    """The batches of ``data`` or ``eval_data`` (default: the standard library's text), checked to hold text;
    a problem names the flag or field."""
    try:
        stream = BatchStream.of(getattr(config, name), seq_len, config.seed, max_bytes=max_bytes)
        if isinstance(stream.source, TextShards):
            stream.source.check()
    except PlanError as exc:
        what = config.named(name) if getattr(config, name) is not None else \
            f"{config.name('data')} (the standard library's sources)"
        raise JobError([f"{config.in_file(name)}{what}: {problem}" for problem in exc.problems]) from None
    return stream


def held_out_problems(config: TrainConfig) -> list[str]:
    """Evaluation settings that cannot run as given: one held-out source, with its interval, outside the
    training data."""
    problems = []
    held_out = [name for name in ("eval_data", "eval_holdout") if getattr(config, name) is not None]
    if len(held_out) == 2:
        problems.append(f"{config.in_file(*held_out)}{config.named('eval_data')} and "
                        f"{config.named('eval_holdout')}: give one, a held-out folder or the fraction of the "
                        f"training data to hold out, not both")
    elif (config.eval_every is None) != (not held_out):
        given = held_out or ["eval_every"]
        problems.append(f"{config.in_file(*given)}{config.named(given[0])}: --eval-every and --eval-data or "
                        f"--eval-holdout (eval.every, eval.data or eval.holdout) come together: evaluate every N "
                        f"steps on a held-out folder or on a held-out fraction of the training data; give "
                        f"--eval-every with one of them, or none")
    if config.eval_every is None and config.given("eval_batches"):
        problems.append(f"{config.in_file('eval_batches')}{config.named('eval_batches')} applies only with "
                        f"--eval-every (eval.every): evaluate every N steps on --eval-data or --eval-holdout, or "
                        f"drop it")
    if config.eval_data is not None and config.data is not None:
        held, train = config.eval_data.resolve(), config.data.resolve()
        where = config.in_file("eval_data", "data")
        if held == train:
            problems.append(f"{where}{config.named('eval_data')} is the training data: give held-out data (e.g. a "
                            f"second folder written by 'shardkit data shard')")
        elif held.is_relative_to(train) or train.is_relative_to(held):
            how = "is inside" if held.is_relative_to(train) else "contains"
            problems.append(f"{where}{config.named('eval_data')} {how} the training data {config.named('data')}, "
                            f"so it would evaluate on training text: give a held-out folder outside it (e.g. a "
                            f"second folder written by 'shardkit data shard') or --eval-holdout F")
    if config.eval_data is not None and not config.eval_data.is_dir():
        problems.append(f"{config.in_file('eval_data')}{config.named('eval_data')}: no such folder")
    return problems


__all__ = ["held_out_problems", "job_data"]
