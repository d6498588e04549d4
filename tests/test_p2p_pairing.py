"""Every point-to-point exchange pairs its sends and receives in one batch (NCCL's rule), recorded on gloo.

NCCL needs the sends and receives that must progress together in one group: a send posted in a
batch of its own, its receive in a later batch of the other rank, waits for that batch, and a
cycle of such waits (a ring) hangs once messages outgrow NCCL's buffers. Each worker records
every batch it posts (``batch_isend_irecv``, a blocking ``send``/``recv``, and torch's schedules'
``_batch_p2p``, which posts a batch of only sends or only receives op by op) while every user of
point-to-point in shardkit runs on one world of 4 (:func:`_record_everything`: ring attention, the
causal convolutions' halo, the bandwidth probe, pipelines under 1F1B and under torch's own
interleaved-1f1b and zbv schedules with a tied embedding, generation through single and virtual
stages, the serving engine's plain pipeline, an export to rank 0); :func:`pairing_problems` then
matches every send with its receive (per pair of ranks, in order: how gloo and NCCL match them),
joins the batches that must therefore run together, and refuses a byte count that differs, a
message without its other half, and any cycle of waits (a rank's batch can only start after its
previous one). torch's multi-stage schedules post each send and each receive alone; they pass
because their order closes no cycle. A structural scan keeps bare point-to-point calls out of the
package: they all go through ``runtime/p2p.py``.
"""
from __future__ import annotations

import ast
import inspect
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from model_zoo import build_gpt4, tokens
from sequence_models import build_lfm2
from torch.distributed.pipelining import schedules

from shardkit.checkpoint.export import export_hf
from shardkit.models.gpt import gpt_loss
from shardkit.models.hf import hf_loss
from shardkit.observe import probes
from shardkit.plan import Mesh, Pipeline, Plan
from shardkit.runtime.apply import shard
from shardkit.runtime.generate import generate
from shardkit.runtime.plain_pipeline import PlainPipeline
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
    """Records each batch of point-to-point operations as it is posted: a ``batch_isend_irecv``, a
    blocking ``send``/``recv`` (torch's pipeline warm-up), and torch's schedules' ``_batch_p2p``, which
    posts a batch of only sends (or only receives) op by op (one ``isend``/``irecv`` each), a mixed one
    as one ``batch_isend_irecv``. Patched in both ``torch.distributed`` and ``distributed_c10d`` (whose
    ``send_object_list`` calls its own names); a call made inside another is not recorded again."""

    NAMES = ("batch_isend_irecv", "send", "recv")

    def __init__(self):
        self.batches: list[list[Op]] = []
        self.depth = 0
        self.saved = [(module, name, getattr(module, name)) for module in (dist, c10d) for name in self.NAMES]
        self.saved.append((schedules, "_batch_p2p", schedules._batch_p2p))

    def _record(self, ops: list[Op]) -> None:
        if self.depth == 0 and ops:
            self.batches.append(ops)

    def _wrap(self, name, post):
        def recorded(*args, **kwargs):
            if name in ("send", "recv"):
                self._record([_blocking(name, post, *args, **kwargs)])
            else:
                ops = [("send" if op.op is dist.isend else "recv", op.peer, op.tensor.numel() * op.tensor.element_size())
                       for op in args[0]]
                homogeneous = name == "_batch_p2p" and len({kind for kind, _, _ in ops}) == 1
                for batch in ([[op] for op in ops] if homogeneous else [ops]):
                    self._record(batch)
            self.depth += 1
            try:
                return post(*args, **kwargs)
            finally:
                self.depth -= 1
        return recorded

    def __enter__(self):
        for module, name, post in self.saved:
            setattr(module, name, self._wrap(name, post))
        return self

    def __exit__(self, *exc):
        for module, name, post in self.saved:
            setattr(module, name, post)
        dist.barrier()  # every rank's part done before the next part's batches start


def _blocking(kind: str, post, *args, **kwargs) -> Op:
    """A blocking ``send(tensor, dst, group, tag, group_dst)`` or ``recv(tensor, src, group, tag, group_src)``
    as one op (its peer's global rank)."""
    bound = inspect.signature(post).bind(*args, **kwargs).arguments
    peer, group_peer = (bound.get("dst"), bound.get("group_dst")) if kind == "send" else \
        (bound.get("src"), bound.get("group_src"))
    tensor = bound["tensor"]
    return kind, c10d._canonicalize_group_rank(bound.get("group"), peer, group_peer, return_global=True), \
        tensor.numel() * tensor.element_size()


def build_llama_tied8() -> torch.nn.Module:
    """The tied Llama of the model zoo with eight layers (four devices of two virtual stages each)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        vocab_size=128, max_position_embeddings=32, tie_word_embeddings=True, attn_implementation="sdpa"))


def _record_everything(ctx, folder: str):
    """Each part's batches on this rank, all on one world of 4: ring attention forward and backward, and
    a step of LFM2 (its causal convolutions' halo exchange, and ring attention) on sp=4; on pp=4 a 1F1B
    step, greedy generation (the plain pipeline), the serving engine's plain pipeline (logits back to the
    first stage) and an export to rank 0; torch's interleaved-1f1b and zbv steps of a Llama whose
    embedding is tied to its head, and generation through their virtual stages (each stage's output
    with its header); the bandwidth probe's ring step. Also what proves each part ran what it names."""
    recorded, facts = {}, {}
    sp_rank, group = ctx.coordinates()["sp"], ctx.mesh["sp"].get_group()
    g = torch.Generator().manual_seed(0)
    q, k, v = (shard_sequence(torch.randn(1, 2, 16, 8, generator=g), sp_rank, 4, dim=2).requires_grad_()
               for _ in range(3))
    with _Recorder() as ring:
        ring_attention(q, k, v, group).sum().backward()
    recorded["ring attention"] = ring.batches
    lfm2 = shard(build_lfm2(), Plan(mesh=Mesh(sp=4)), ctx)
    facts["halo modules"] = sum(hasattr(m, "_shardkit_halo") for m in lfm2.modules())
    with _Recorder() as halo:
        lfm2.step(*ctx.shard_batch(*tokens(2, 32)), hf_loss)
    recorded["causal convolution halo"] = halo.batches
    with _Recorder() as probe:
        probes._p2p((torch.zeros(64), torch.empty(64)), ctx.rank, ctx.world_size)
    recorded["bandwidth probe"] = probe.batches

    model = shard(build_gpt4(), Plan(mesh=Mesh(pp=4), pipeline=Pipeline(schedule="1f1b", microbatches=4)), ctx)
    with _Recorder() as step:
        model.step(*tokens(4, 8), gpt_loss)
    recorded["pipeline step"] = step.batches
    with _Recorder() as decoding:
        generate(model, tokens(2, 4)[0], max_new_tokens=3)
    recorded["generation"] = decoding.batches
    with _Recorder() as serving:
        engine = PlainPipeline(model, slots=2, max_len=16, to_first=True)
        logits = engine.prefill([[1, 2, 3], [4, 5]])
        engine.step(logits.argmax(-1, keepdim=True) if logits is not None else torch.zeros(2, 1, dtype=torch.long),
                    torch.tensor([3, 2]))
    recorded["plain pipeline to the first stage"] = serving.batches
    facts["serving logits"] = None if logits is None else tuple(logits.shape)
    with _Recorder() as exported:
        export_hf(folder, model)
    recorded["export to rank 0"] = exported.batches

    for schedule in ("interleaved-1f1b", "zbv"):
        plan = Plan(mesh=Mesh(pp=4), pipeline=Pipeline(schedule=schedule, microbatches=4, virtual_stages=2))
        tied = shard(build_llama_tied8(), plan, ctx)
        facts[schedule] = {"stages": tied.local_stages, "tied": tied.tied_copies,
                           "schedule": type(tied._sk_runtime.schedule).__name__}
        inputs = tokens(4, 8, vocab=128)[0]
        with _Recorder() as step:
            tied.step(inputs, inputs.roll(-1, dims=1), hf_loss)
        recorded[f"{schedule} step"] = step.batches
        with _Recorder() as decoding:
            generate(tied, inputs[:2, :4], max_new_tokens=3)
        recorded[f"{schedule} generation"] = decoding.batches
    return recorded, facts


@pytest.fixture(scope="module")
def everything(world, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("export") / "out")
    # about a minute on 2 busy cores; gloo's send waits for its receive, so an exchange that waits for its sends
    # before posting the receives hangs here: the timeout makes that a failure with every rank's stack
    return world(4).run(_record_everything, folder, plan=Plan(mesh=Mesh(sp=4)), timeout=300)


@pytest.fixture(scope="module")
def recorded(everything):
    return [rank for rank, _ in everything]


PARTS = ["ring attention", "causal convolution halo", "bandwidth probe", "pipeline step", "generation",
         "plain pipeline to the first stage", "export to rank 0", "interleaved-1f1b step", "interleaved-1f1b generation",
         "zbv step", "zbv generation"]


@pytest.mark.parametrize("part", PARTS)
def test_every_send_meets_its_receive_in_one_batch(recorded, part):
    batches = [rank[part] for rank in recorded]
    assert all(batches), f"{part}: a rank posted no batch: {[len(b) for b in batches]}"
    assert pairing_problems(batches) == []


def test_the_parts_ran_what_they_name(everything):
    """The halo is exchanged (a middle rank sends to both neighbours in one batch, which ring attention never
    does), torch's own multi-stage schedules ran with the tie across devices (interleaved: stage 0 on rank 0,
    stage 7 on rank 3; zbv: both on rank 0, one parameter), and the serving path's logits reached rank 0."""
    recorded, facts = everything[1][0], everything[1][1]
    assert facts["halo modules"] == 2
    assert any({peer for kind, peer, _ in ops if kind == "send"} == {0, 2} for ops in recorded["causal convolution halo"])
    assert facts["interleaved-1f1b"]["schedule"] == "ScheduleInterleaved1F1B"
    assert facts["zbv"]["schedule"] == "ScheduleZBVZeroBubble"
    ranks = [f for _, f in everything]
    assert [f["interleaved-1f1b"]["stages"] for f in ranks] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [f["zbv"]["stages"] for f in ranks] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [bool(f["interleaved-1f1b"]["tied"]) for f in ranks] == [False, False, False, True]
    assert [f["zbv"]["tied"] for f in ranks] == [{}] * 4
    assert [f["serving logits"] for f in ranks] == [(2, 256), None, None, (2, 256)]


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
