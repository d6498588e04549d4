"""Every point-to-point exchange pairs its sends and receives in one batch (NCCL's rule), recorded on gloo.

NCCL needs the sends and receives that must progress together in one group: a send posted in a
batch of its own, its receive in a later batch of the other rank, waits for that batch, and a
cycle of such waits (a ring) hangs once messages outgrow NCCL's buffers. Each worker records
every batch it posts (``torch.distributed.batch_isend_irecv``, and torch's schedules'
``_batch_p2p``, which posts homogeneous batches op by op) while ring attention runs forward and
backward, a pipeline steps and generates; :func:`pairing_problems` then matches every send with
its receive (per pair of ranks, in order: how gloo and NCCL match them), joins the batches that
must therefore run together, and refuses a byte count that differs, a message without its other
half, and any cycle of waits (a rank's batch can only start after its previous one). A structural
scan keeps bare point-to-point calls out of the package: they all go through ``runtime/p2p.py``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from model_zoo import build_gpt4, tokens
from torch.distributed.pipelining import schedules

from shardkit.models.gpt import gpt_loss
from shardkit.plan import Mesh, Pipeline, Plan
from shardkit.runtime.apply import shard
from shardkit.runtime.generate import generate
from shardkit.runtime.ring_attention import ring_attention, shard_sequence

SRC = Path(__file__).resolve().parents[1] / "src" / "shardkit"
#: torch.distributed's point-to-point functions; only runtime/p2p.py calls them.
P2P_NAMES = {"isend", "irecv", "send", "recv", "batch_isend_irecv", "P2POp", "send_object_list", "recv_object_list"}
HOME = SRC / "runtime" / "p2p.py"

Op = tuple[str, int, int]  # ("send" | "recv", peer's global rank, bytes)


# -- the check ----------------------------------------------------------------------------------
def pairing_problems(batches: list[list[list[Op]]]) -> list[str]:
    """Why the ranks' batches (``batches[rank][i]``: the ops of rank's i-th batch) could hang on NCCL (empty: none)."""
    problems: list[str] = []
    sends, recvs = defaultdict(list), defaultdict(list)  # (src, dst) -> [(batch, bytes)] in posting order
    for rank, mine in enumerate(batches):
        for i, ops in enumerate(mine):
            for kind, peer, nbytes in ops:
                (sends[rank, peer] if kind == "send" else recvs[peer, rank]).append((i, nbytes))
    parent: dict = {}

    def find(node):
        while parent.setdefault(node, node) != node:
            node = parent[node]
        return node

    for pair in sorted(set(sends) | set(recvs)):
        src, dst = pair
        out, into = sends.get(pair, []), recvs.get(pair, [])
        if len(out) != len(into):
            problems.append(f"rank {src} sends {len(out)} messages to rank {dst}, which receives {len(into)}")
        for (i, sent), (j, received) in zip(out, into):
            if sent != received:
                problems.append(f"rank {src}'s batch {i} sends {sent} bytes to rank {dst}, whose batch {j} receives "
                                f"{received}")
            parent[find((src, i))] = find((dst, j))  # these two batches progress together
    waits = defaultdict(set)  # group of batches -> the groups that wait for it
    for rank, mine in enumerate(batches):
        for i in range(1, len(mine)):
            before, after = find((rank, i - 1)), find((rank, i))
            if before == after:
                problems.append(f"rank {rank}'s batch {i - 1} can only finish with its batch {i}, which it posts after")
            waits[before].add(after)
    members = defaultdict(list)
    for rank, mine in enumerate(batches):
        for i in range(len(mine)):
            members[find((rank, i))].append(f"{rank}:{i}")
    state: dict = {}
    path: list = []

    def cycle(node) -> list | None:  # depth-first search for a cycle of waits
        state[node] = "open"
        path.append(node)
        for nxt in sorted(waits[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):]
            found = cycle(nxt) if nxt not in state else None
            if found:
                return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(waits):
        found = None if problems or node in state else cycle(node)
        if found:
            problems.append("batches (rank:batch) wait on each other in a cycle: " +
                            " -> ".join("+".join(members[n]) for n in found))
    return problems


RING = [("send", 1, 64), ("recv", 1, 64)]


def test_the_check_accepts_paired_batches_and_refuses_what_could_hang():
    assert pairing_problems([[RING], [[("send", 0, 64), ("recv", 0, 64)]]]) == []
    assert pairing_problems([[[("send", 1, 8)], [("send", 1, 8)]], [[("recv", 0, 8)], [("recv", 0, 8)]]]) == []
    # the ring attention backward of before: the accumulator sent alone, received in the next step's batch
    old = [[RING, [("send", 1, 128)], [("recv", 1, 128)]] for _ in range(2)]
    for rank in (0, 1):
        old[rank] = [[(kind, 1 - rank, n) for kind, _, n in ops] for ops in old[rank]]
    assert pairing_problems(old) == ["batches (rank:batch) wait on each other in a cycle: 0:2+1:1 -> 0:1+1:2"]
    # every rank sends first, then receives, in two batches: a cycle around a ring of three
    three = [[[("send", (r + 1) % 3, 8)], [("recv", (r - 1) % 3, 8)]] for r in range(3)]
    assert pairing_problems(three) == ["batches (rank:batch) wait on each other in a cycle: 0:1+2:0 -> 1:0+2:1 -> 0:0+1:1"]
    assert pairing_problems([[[("send", 1, 8)]], [[("recv", 0, 4)]]]) == [
        "rank 0's batch 0 sends 8 bytes to rank 1, whose batch 0 receives 4"]
    assert pairing_problems([[[("send", 1, 8)]], []]) == ["rank 0 sends 1 messages to rank 1, which receives 0"]


# -- recorded on gloo ---------------------------------------------------------------------------
class _Recorder:
    """Records each batch posted through ``batch_isend_irecv`` or torch's schedules' ``_batch_p2p`` (once)."""

    def __init__(self):
        self.batches: list[list[Op]] = []
        self.depth = 0
        self.saved = (dist.batch_isend_irecv, schedules._batch_p2p)

    def _wrap(self, post):
        def recorded(ops, *args, **kwargs):
            if self.depth == 0 and ops:
                self.batches.append([("send" if op.op is dist.isend else "recv", op.peer,
                                      op.tensor.numel() * op.tensor.element_size()) for op in ops])
            self.depth += 1
            try:
                return post(ops, *args, **kwargs)
            finally:
                self.depth -= 1
        return recorded

    def __enter__(self):
        dist.batch_isend_irecv, schedules._batch_p2p = (self._wrap(f) for f in self.saved)
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv, schedules._batch_p2p = self.saved
        dist.barrier()  # every rank's part done before the next part's batches start


def _record_everything(ctx):
    """Each part's batches on this rank: ring attention forward and backward on sp=4, a 1F1B step and
    greedy generation on pp=4."""
    recorded = {}
    sp_rank, group = ctx.coordinates()["sp"], ctx.mesh["sp"].get_group()
    g = torch.Generator().manual_seed(0)
    q, k, v = (shard_sequence(torch.randn(1, 2, 16, 8, generator=g), sp_rank, 4, dim=2).requires_grad_()
               for _ in range(3))
    with _Recorder() as ring:
        ring_attention(q, k, v, group).sum().backward()
    recorded["ring attention"] = ring.batches
    model = shard(build_gpt4(), Plan(mesh=Mesh(pp=4), pipeline=Pipeline(schedule="1f1b", microbatches=4)), ctx)
    with _Recorder() as step:
        model.step(*tokens(4, 8), gpt_loss)
    recorded["pipeline step"] = step.batches
    with _Recorder() as decoding:
        generate(model, tokens(2, 4)[0], max_new_tokens=3)
    recorded["generation"] = decoding.batches
    return recorded


@pytest.fixture(scope="module")
def recorded(world):
    return world(4).run(_record_everything, plan=Plan(mesh=Mesh(sp=4)))


@pytest.mark.parametrize("part", ["ring attention", "pipeline step", "generation"])
def test_every_send_meets_its_receive_in_one_batch(recorded, part):
    batches = [rank[part] for rank in recorded]
    assert all(batches), f"{part}: a rank posted no batch: {[len(b) for b in batches]}"
    assert pairing_problems(batches) == []


def test_no_bare_point_to_point_call_outside_runtime_p2p():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        if path == HOME or not any(name in text for name in P2P_NAMES):
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            names = [node.attr] if isinstance(node, ast.Attribute) else \
                [a.name for a in node.names] if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.startswith("torch.distributed") else []
            found += [f"{path.relative_to(SRC)}:{node.lineno} {name}" for name in names if name in P2P_NAMES
                      and not (isinstance(node, ast.Attribute) and _not_torch(node.value))]
    assert found == [], "point-to-point calls outside runtime/p2p.py (use p2p.exchange): " + ", ".join(found)


def _not_torch(value: ast.expr) -> bool:
    """Whether an attribute's owner is plainly not torch.distributed (``p2p.send`` is shardkit's own)."""
    return isinstance(value, ast.Name) and value.id not in ("dist", "c10d", "distributed")
