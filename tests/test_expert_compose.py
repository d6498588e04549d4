"""Expert parallelism composed with the other axes, against one process: ``tp`` (attention and
dense layers over ``tp``, experts over ``ep``), ``pp`` (each stage's experts over ``ep``),
activation recompute (each exchange repeated in the backward), a bf16 mixed-precision policy
(the exchange carries bf16) and HSDP (``dp x fsdp x ep``); and what stays refused by name.

One job per world runs every case (a world costs seconds to start on 2 cores); the
one-process references run here.
"""

from __future__ import annotations

import gc
import re
import time
from dataclasses import replace

import pytest
import torch
from model_zoo import with_expert_tp_entries

import shardkit as sk
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt_moe, gpt_loss
from shardkit.models.hf import build_tiny_mixtral, build_tiny_qwen2_moe, hf_loss
from shardkit.planner.meta import meta_model
from shardkit.runtime.precision import Precision, mixed_precision_backward

STEPS, LR = 3, 0.5
POLICY = sk.FSDPOptions(param_dtype="bfloat16", reduce_dtype="float32")


def build_bf16_gpt_moe() -> torch.nn.Module:
    """The tiny MoE GPT built in bfloat16."""
    return build_tiny_gpt_moe().to(torch.bfloat16)


BUILDERS = {"gpt-moe": (build_tiny_gpt_moe, gpt_loss), "mixtral": (build_tiny_mixtral, hf_loss),
            "qwen2-moe": (build_tiny_qwen2_moe, hf_loss), "gpt-moe-bf16": (build_bf16_gpt_moe, gpt_loss)}


def _tp_rules(model_name: str) -> sk.LayoutMap:
    """Attention and dense layers over ``tp``; the experts whole (``ep`` splits them)."""
    if model_name.startswith("gpt-moe"):
        return GPT_RULES
    hf = sk.LayoutMap.from_hf(meta_model(BUILDERS[model_name][0]))  # transformers' plan splits experts over tp
    return sk.LayoutMap([(pattern, layout) for pattern, layout in hf.items() if "experts" not in pattern])


def _plan(name: str, mesh: str) -> sk.Plan:
    model_name, *options = name.split("@")
    parsed = sk.Mesh.parse(mesh)
    return sk.Plan(mesh=parsed, rules=_tp_rules(model_name) if "tp" in parsed else None,
                   pipeline=sk.Pipeline(schedule="1f1b", microbatches=2) if "pp" in parsed else None,
                   recompute="full" if "recompute" in options else "none",
                   sequence_parallel="seqpar" in options,
                   fsdp=POLICY if "policy" in options else sk.FSDPOptions())


#: (model, mesh) per world size. ``@recompute``: every block recomputed; ``@policy``: :data:`POLICY`;
#: ``@seqpar``: Megatron sequence parallel (``sequence_parallel=True``, with ``tp``).
CASES = {
    4: [("gpt-moe", "tp=2,ep=2"), ("mixtral", "tp=2,ep=2"), ("qwen2-moe", "tp=2,ep=2"), ("gpt-moe-bf16", "tp=2,ep=2"),
        ("gpt-moe", "pp=2,ep=2"), ("mixtral", "pp=2,ep=2"), ("qwen2-moe", "pp=2,ep=2"),
        ("gpt-moe@recompute", "fsdp=2,ep=2"), ("gpt-moe@policy", "fsdp=2,ep=2"), ("gpt-moe@policy", "ep=4")],
    8: [("gpt-moe", "dp=2,fsdp=2,ep=2")],
}
ALL = [c for cases in CASES.values() for c in cases]
ROUTER = re.compile(r"\.(gate|router)\.(weight|bias)$")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class _KeptExchanges:
    """Weak references to the storage of every exchange's output (forward, recomputed and
    backward) while it is entered: how many are still alive after a step."""

    def __init__(self) -> None:
        from shardkit.runtime import expert_parallel

        self.module, self.original, self.refs = expert_parallel, expert_parallel._all_to_all, []

    def _recording(self, *args):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = self.original(*args)
        self.refs.append(StorageWeakRef(out.untyped_storage()))
        return out

    def __enter__(self) -> _KeptExchanges:
        self.module._all_to_all = self._recording
        return self

    def __exit__(self, *exc) -> None:
        self.module._all_to_all = self.original

    def alive(self) -> int:
        gc.collect()
        return sum(not ref.expired() for ref in self.refs)


def _train_cases(ctx, cases):
    """Every case on this rank: 3 SGD steps sharded. Returns, per case, the losses, step 0's full
    gradients and the final full weights of the parameters this rank holds, its router gradients,
    the all-to-all calls of the last step, the dtypes of the rows exchanged and of the experts'
    parameters, with recompute, per step, the exchanged buffers still alive after it and all exchanged,
    and the (token, slot) rows each MoE layer sent in the last step."""
    from shardkit.observe.comm import CommCounter
    from shardkit.runtime.apply import full_grads, full_state_dict

    out = []
    for name, mesh in cases:
        start = time.perf_counter()
        build, loss_fn = BUILDERS[name.split("@")[0]]
        plan = _plan(name, mesh)
        ctx = replace(ctx, plan=plan)  # a pipeline's runtime reads its mesh from the job's plan
        model = sk.shard(build(), plan, ctx)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        inputs, targets = ctx.shard_batch(*_batch())  # the rank's samples (and with sp its chunks of them)
        losses, grads, routers, exchanges, kept = [], {}, {}, 0, []
        for step in range(STEPS):
            optimizer.zero_grad()
            with CommCounter() as comm, _KeptExchanges() as exchanged:
                losses.append(model.step(inputs, targets, loss_fn).item())
            if step == 0:
                grads = full_grads(model)
                routers = {n: _local(p.grad).clone() for n, p in model.named_parameters() if ROUTER.search(n)}
            # the last step's: torch's pipeline stages run a first forward on meta tensors to infer shapes
            exchanges = comm.summary().get("all_to_all_single", (0, 0))[0]
            optimizer.step()
            if plan.recompute != "none":
                kept.append((exchanged.alive(), len(exchanged.refs)))
        rows = {m._sk_rows.dtype for m in model.modules() if hasattr(m, "_sk_rows")}
        experts = {p.dtype for n, p in model.named_parameters() if ".experts." in n}
        sent = [sum(m._sk_rows.sent) for m in model.modules() if hasattr(m, "_sk_rows")]
        out.append((losses, grads, full_state_dict(model), routers, exchanges, rows, experts, kept, sent,
                    time.perf_counter() - start))
    return out


def _reference(name: str):
    """One process: the losses, step 0's gradients and the final weights of 3 SGD steps (under the
    plan's mixed-precision policy, as :func:`~shardkit.runtime.precision.mixed_precision_backward`)."""
    build, loss_fn = BUILDERS[name.split("@")[0]]
    model = build()
    precision = Precision.of(_plan(name, "ep=2").fsdp)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    inputs, targets = _batch()
    losses, grads = [], None
    for step in range(STEPS):
        optimizer.zero_grad()
        losses.append(mixed_precision_backward(model, inputs, targets, loss_fn, precision).item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def results(world):
    found = world.run_cases(CASES, _train_cases)
    for case, runs in found.items():
        print(f"{case}: {max(run[-1] for run in runs):.1f} s")
    return found


def _merged(ranks: list, field: int) -> dict[str, torch.Tensor]:
    """The full tensors of every rank (a pipeline stage holds only its own parameters)."""
    merged: dict[str, torch.Tensor] = {}
    for rank in ranks:
        merged.update(rank[field])
    return merged


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert a.keys() == b.keys()
    return max((float((a[n] - b[n]).abs().max()), n) for n in a)


@pytest.mark.parametrize("case", ALL, ids=[f"{c[0]}-{c[1]}" for c in ALL])
def test_expert_parallel_composed_matches_one_process(results, case):
    check_matches_one_process(case, results[case])


def check_matches_one_process(case: tuple[str, str], ranks: list) -> None:
    """Every rank's losses, the merged step-0 gradients, the final weights and (unsplit over
    fsdp) every rank's router gradient equal one process's."""
    name, mesh = case
    losses, grads, weights = _reference(name)
    low = "bf16" in name or "policy" in name  # sk.verify's mixed-precision tolerances, else its float32 ones
    loss_tol, grad_rel, weight_tol = (0.031 * losses[0], 0.078, 0.01 * LR) if low else (1e-5, 1e-4, 1e-5)
    for rank in ranks:  # every rank reports the same global loss
        assert rank[0] == pytest.approx(losses, abs=loss_tol)
    sharded_grads = _merged(ranks, 1)
    grad_diff, where = _max_diff(sharded_grads, grads)
    scale = max(float(g.abs().max()) for g in grads.values())
    assert grad_diff <= 1e-5 + grad_rel * scale, (grad_diff, where)
    assert any(float(g.abs().max()) > 0 for n, g in sharded_grads.items() if ".experts." in n)
    sharded_weights = _merged(ranks, 2)
    print(f"{case}: loss {max(abs(a - b) for a, b in zip(ranks[0][0], losses)):.1e}, grad {grad_diff:.1e} "
          f"(largest {scale:.2f}), weight {_max_diff(sharded_weights, weights)[0]:.1e}")
    for weight, value in weights.items():  # bf16 weights: also one rounding step of their own (2^-7 of |w|)
        bound = weight_tol + (2 ** -7 * value.abs() if value.dtype == torch.bfloat16 else 0)
        assert ((sharded_weights[weight] - value).abs() <= bound).all(), weight
    if "fsdp" not in mesh:  # the router's gradient is whole and equal to one process's on every rank
        tolerance = dict(rtol=0.078, atol=1e-3) if low else dict(rtol=1e-4, atol=1e-6)
        for rank in ranks:
            assert rank[3]
            for router, grad in rank[3].items():
                torch.testing.assert_close(grad, grads[router], **tolerance)


@pytest.mark.parametrize("case", ALL, ids=[f"{c[0]}-{c[1]}" for c in ALL])
def test_every_exchange_happens_once_per_layer_or_twice_recomputed(results, case):
    """Per MoE layer a rank holds and micro-batch: the counts, the rows out and back (3), and the
    rows' two exchanges in the backward; recomputing a block repeats its 3 forward exchanges."""
    name, mesh = case
    per_layer = 5 + (3 if "recompute" in name else 0)
    microbatches = 2 if "pp" in mesh else 1
    for rank in results[case]:
        held = {n.split(".experts.")[0] for n in rank[2] if ".experts." in n}
        assert rank[4] == per_layer * len(held) * microbatches


def test_the_exchange_carries_the_compute_dtype_and_experts_keep_theirs(results):
    """Under a bf16 policy the rows travel in bf16, the experts' parameters stay float32 (their
    FSDP2 unit, or with ``ep`` alone the forward, casts them); a bf16 model exchanges bf16."""
    for mesh in ("fsdp=2,ep=2", "ep=4"):
        for rank in results["gpt-moe@policy", mesh]:
            assert rank[5] == {torch.bfloat16} and rank[6] == {torch.float32}
    for rank in results["gpt-moe", "tp=2,ep=2"]:
        assert rank[5] == {torch.float32}
    for rank in results["gpt-moe-bf16", "tp=2,ep=2"]:
        assert rank[5] == {torch.bfloat16}


def test_recomputed_exchanges_keep_no_buffers_alive(results):
    """torchtitan #1467: torch's all_to_all_single_autograd under checkpointing kept exchanged
    buffers alive. Every exchange's output (2 per layer forward, 2 recomputed, 2 backward) is
    freed by the end of its step."""
    for rank in results["gpt-moe@recompute", "fsdp=2,ep=2"]:
        assert rank[7] == [(0, 2 * 6)] * STEPS


# -- refusals before launch --------------------------------------------------------------------------------------------
def _problems(plan: sk.Plan, build) -> str:
    with pytest.raises(sk.PlanError) as info:
        sk.validate(plan, meta_model(build))
    return str(info.value)


def test_experts_split_over_tp_by_a_rule_are_refused_by_parameter():
    """A plan splitting the experts over tp (transformers 5.24's own did); with ep they are whole on their rank."""
    rules = sk.LayoutMap.from_hf(with_expert_tp_entries(meta_model(build_tiny_mixtral)))
    text = _problems(sk.Plan(mesh=sk.Mesh(tp=2, ep=2), rules=rules), build_tiny_mixtral)
    assert ("parameter 'model.layers.0.mlp.experts.down_proj' of MoE layer 'model.layers.0.mlp.experts' is split "
            "over ['tp'] by layout (None, None, 'tp'), but with ep=2 each expert is held whole") in text


def test_what_ep_does_not_compose_with_yet_is_refused_by_name():
    text = _problems(sk.Plan(mesh=sk.Mesh(dp=2, ep=2), replicas=sk.ReplicaGrouping(2, group_size=2)),
                     build_tiny_gpt_moe)
    assert "replica groups with ep=2: gradients of experts are not averaged within groups" in text
