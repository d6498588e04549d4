"""Run by tests/test_torchrun.py under torchrun: sk.launch joins that world instead of spawning.

With the argument ``fail``, rank 1 raises after a collective while rank 0 waits in the next one.
With ``hang``, rank 0 naps past the job's 3 s timeout while rank 1 waits for it in a barrier.
With ``auto``, after the launch, ``shardkit train --plan auto`` in the same world (``$SHARDKIT_CACHE``
set by the test), then its plan once more (the kept hardware read back); each rank prints what it
measured, wrote and chose (MEASURE, WROTE, PLAN lines)."""

import os
import sys
import time

import torch
import torch.distributed as dist

import shardkit as sk
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt, gpt_loss


def work(ctx):
    model = sk.shard(build_tiny_gpt(), ctx.plan)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    loss = model.step(*ctx.shard_batch(tokens[:, :-1], tokens[:, 1:]), gpt_loss)
    return ctx.rank, ctx.world_size, round(loss.item(), 6), dist.get_backend()


def fail_on_rank_1(ctx):
    total = torch.ones(1)
    dist.all_reduce(total)
    if ctx.rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.all_reduce(total)  # rank 0 waits here for a peer that is gone


def nap_forever():
    time.sleep(600)


def hang_on_rank_0(ctx):
    if ctx.rank == 0:
        nap_forever()
    dist.barrier()  # rank 1 waits here for rank 0


def say(line: str) -> None:
    """One marker line for the test, whole on a line of its own: both ranks share torchrun's stdout, and
    rank 0's tables reach it in pieces (CI once found rank 0's table glued to rank 1's line), so the
    line goes out in one write (atomic on a pipe up to 4096 bytes) between newlines."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"\n{line}\n".encode())


def plan_auto_twice() -> None:
    """``shardkit train --plan auto`` (a short calibration: 0.02 s a point), then its plan again."""
    import shardkit.cli.train as train_cli
    import shardkit.observe.calibrate as calibrate
    import shardkit.observe.probes as probes
    from shardkit.cli import build_parser, main

    rank = os.environ["RANK"]
    measure, write, auto_plan = calibrate.measure, calibrate.write_atomically, train_cli.auto_plan

    def counted_measure(*args, **kwargs):
        say(f"MEASURE rank {rank}")
        kwargs.update(seconds_per_size=0.02, matmul_sizes=(32, 64), message_sizes=(4096, 2**16, 2**20))
        return measure(*args, **kwargs)

    def counted_write(hardware, file):
        say(f"WROTE rank {rank} {file.name} {hardware.name}")
        write(hardware, file)

    def counted_plan(config):
        config = auto_plan(config)
        say(f"PLAN rank {rank} {config.plan.mesh!r} accum {config.grad_accum}")
        return config

    probes.MAX_MESSAGE_BYTES = 2**24  # the sweep's growth bounded: a loaded machine's flat times stop at 16 MiB
    calibrate.measure, calibrate.write_atomically = counted_measure, counted_write
    train_cli.auto_plan = counted_plan
    argv = ["train", "--plan", "auto", "--model", "gpt-tiny", "--steps", "2", "--batch-size", "4",
            "--data-mb", "0.05"]
    say(f"TRAINED rank {rank} {main(argv)}")
    train_cli.build_config(build_parser().parse_args(argv))  # the hardware kept: read by rank 0, broadcast


if __name__ == "__main__":
    if sys.argv[1:] == ["fail"]:
        sk.launch(fail_on_rank_1, sk.Plan(mesh=sk.Mesh(dp=-1)))
    if sys.argv[1:] == ["hang"]:
        sk.launch(hang_on_rank_0, sk.Plan(mesh=sk.Mesh(dp=-1)), timeout=3)
    results = sk.launch(work, sk.Plan(mesh=sk.Mesh(tp=-1), rules=GPT_RULES))
    if dist.get_rank() == 0:
        say(f"RESULTS {results}")
    if sys.argv[1:] == ["auto"]:
        plan_auto_twice()
