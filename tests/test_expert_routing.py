"""Router losses and balancing over the whole batch under data ranks (``ep``, ``dp``, ``fsdp``),
against one process: the loss of every step, the auxiliary loss every rank reports, step 0's
gradients, the weights after 3 steps and every bias-balanced router's bias (equal on every rank);
the edge cases of expert parallelism with both on; and what ``sk.validate`` refuses.

One job per world runs every case (the worlds are the session's, shared with
``tests/test_expert_parallel.py``); the one-process references run here.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import shardkit as sk
from shardkit.models.gpt import GPT, GPTConfig, gpt_loss, tiny_moe_config
from shardkit.models.hf import hf_loss, tiny_mixtral_config, tiny_qwen2_moe_config
from shardkit.models.routing import load_balancing_loss_func
from shardkit.planner.meta import meta_model

STEPS, LR, COEF, RATE = 3, 0.5, 0.1, 0.05


def build_balanced_gpt_moe(**overrides) -> GPT:
    """The tiny MoE GPT with Mixtral's auxiliary loss and DeepSeek-V3's bias balancing."""
    torch.manual_seed(0)
    settings = {**tiny_moe_config().__dict__, "router_aux_loss_coef": COEF, "balance": "bias",
                "bias_update_rate": RATE, **overrides}
    return GPT(GPTConfig(**settings))


def build_one_sided_balanced() -> GPT:
    """Every token to experts 0 and 1 (a large bias on their choice): under ep=4 the ranks holding
    experts 2 and 3 receive no rows, and one expert pair takes every token."""
    model = build_balanced_gpt_moe(bias_update_rate=1e-3)
    for layer in model.layers:
        layer.mlp.gate.expert_bias[:2] = 30.0
    return model


def build_aux_mixtral():
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(tiny_mixtral_config(output_router_logits=True, router_aux_loss_coef=COEF))


def build_aux_qwen2_moe():
    from transformers import Qwen2MoeForCausalLM

    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(tiny_qwen2_moe_config(output_router_logits=True, router_aux_loss_coef=COEF))


def build_biased_deepseek_v3(bias: bool = True):
    """transformers DeepSeek-V3, tiny: sigmoid scores, 2 expert groups, a shared expert, and a fixed
    ``e_score_correction_bias`` (transformers does not update it) that changes the choice."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                              n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                              first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    generator = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(4, generator=generator) * 0.1 * bias)
    return model


HF_LOSS = partial(hf_loss, aux_loss_coef=COEF)
BUILDERS = {"gpt": (build_balanced_gpt_moe, gpt_loss), "one-sided": (build_one_sided_balanced, gpt_loss),
            "top-k=E": (partial(build_balanced_gpt_moe, top_k=4), gpt_loss),
            "mixtral": (build_aux_mixtral, HF_LOSS), "qwen2-moe": (build_aux_qwen2_moe, HF_LOSS),
            "deepseek-v3": (build_biased_deepseek_v3, hf_loss)}

#: (model, mesh, (samples, seq)) per world size: one 4-process world (``dp=2,ep=2`` is ep=2 with
#: another data axis; ``ep=4`` has ep as its only data axis, the experts outside data parallelism).
CASES = {
    4: [("gpt", "fsdp=2,ep=2", (8, 16)), ("gpt", "dp=2,ep=2", (8, 16)), ("mixtral", "fsdp=2,ep=2", (8, 16)),
        ("qwen2-moe", "fsdp=2,ep=2", (8, 16)), ("deepseek-v3", "fsdp=2,ep=2", (8, 16)),
        ("one-sided", "ep=4", (8, 16)), ("top-k=E", "ep=4", (4, 8)), ("gpt", "ep=4", (4, 1))],
}


def _batch(samples: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (samples, seq + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every router's bias: the GPT's (updated each step) and DeepSeek-V3's (fixed in transformers)."""
    return {n: b.detach().clone().cpu() for n, b in model.named_buffers()
            if n.endswith(("expert_bias", "e_score_correction_bias"))}


class _Recording:
    """``loss_fn`` that keeps each step's auxiliary loss (transformers' ``output.aux_loss``, the GPT's
    ``model.aux_loss``)."""

    def __init__(self, model: torch.nn.Module, loss_fn):
        self.model, self.loss_fn, self.aux = model, loss_fn, []

    def __call__(self, output, targets):
        aux = getattr(output, "aux_loss", None) if not isinstance(output, torch.Tensor) else self.model.aux_loss
        if aux is not None:
            self.aux.append(float(aux.detach()))
        return self.loss_fn(output, targets)


def _run(model: torch.nn.Module, loss_fn, inputs, targets, step) -> dict:
    """3 SGD steps through ``sk.optimizer`` (which updates the biases after each step)."""
    from shardkit.runtime.apply import full_grads

    optimizer = sk.optimizer(model, torch.optim.SGD, lr=LR)
    recording, losses, grads = _Recording(model, loss_fn), [], None
    for index in range(STEPS):
        optimizer.zero_grad()
        losses.append(float(step(model, inputs, targets, recording)))
        if index == 0:
            grads = full_grads(model) if hasattr(model, "_sk_plan") else {
                n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
    return {"losses": losses, "aux": recording.aux, "grads": grads, "biases": _biases(model)}


def _train_cases(ctx, cases):
    """Every case on this rank; after the first, a step of 2 micro-batches (refused: the message)."""
    from shardkit.runtime.apply import full_state_dict

    out = []
    for i, (name, mesh, shape) in enumerate(cases):
        build, loss_fn = BUILDERS[name]
        plan = sk.Plan(mesh=sk.Mesh.parse(mesh))
        model = sk.shard(build(), plan, ctx)
        inputs, targets = (t.chunk(plan.mesh.data_size)[plan.mesh.data_index(ctx.rank)] for t in _batch(*shape))
        found = _run(model, loss_fn, inputs, targets, lambda m, x, y, f: m.step(x, y, f))
        found["weights"] = full_state_dict(model)
        found["received"] = sum(sum(m._sk_rows.received) for m in model.modules() if hasattr(m, "_sk_rows"))
        if ctx.rank != 0:
            found["grads"] = found["weights"] = None
        if i == 0:
            try:
                model.step(inputs, targets, loss_fn, accumulate=2)
            except sk.UsageError as exc:
                found["accumulate"] = str(exc)
        out.append(found)
    return out


def _one_process(name: str, shape: tuple[int, int]) -> dict:
    build, loss_fn = BUILDERS[name]
    model = build()

    def step(m, x, y, f):
        loss = f(m(x), y)
        loss.backward()
        return loss.detach()

    found = _run(model, loss_fn, *_batch(*shape), step)
    found["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return found


def _masked_aux_job(ctx):
    """transformers' loss with an attention mask, each rank holding 2 of 8 samples (padding differs per rank)."""
    from shardkit.models.routing import BatchTotal, batch_total
    from shardkit.runtime.router_balance import _summed

    logits, mask = _masked_inputs()
    rows = slice(2 * ctx.rank, 2 * ctx.rank + 2)
    mine = tuple(layer.view(8, 5, 4)[rows].reshape(-1, 4).requires_grad_() for layer in logits)
    with batch_total(BatchTotal(partial(_summed, [None]), ranks=ctx.world_size)):
        aux = load_balancing_loss_func(mine, 4, 2, mask[rows])
    aux.backward()
    return float(aux.detach()), [g.grad for g in mine]


def _masked_inputs() -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    logits = tuple(torch.randn(40, 4, generator=generator) for _ in range(2))
    mask = (torch.rand(8, 5, generator=generator) > 0.3).long()
    mask[0] = 0  # a rank's sample of nothing but padding
    return logits, mask


@pytest.fixture(scope="module")
def results(world):
    found = world.run_cases(CASES, _train_cases)
    found["masked"] = world(4).run(_masked_aux_job)
    return found


ALL = [c for cases in CASES.values() for c in cases]


@pytest.mark.parametrize("case", ALL, ids=[f"{c[0]}-{c[1]}-{c[2][0]}x{c[2][1]}" for c in ALL])
def test_routing_matches_one_process(results, case):
    name, mesh, shape = case
    ranks, ref = results[case], _one_process(name, shape)
    first = ranks[0]
    assert first["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    for rank in ranks:  # the whole batch's auxiliary loss on every rank, not the rank's own
        assert rank["aux"] == pytest.approx(ref["aux"], abs=1e-5)
        assert rank["losses"] == pytest.approx(first["losses"], abs=1e-6)
    assert len(ref["aux"]) == (STEPS if name != "deepseek-v3" else 0)
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    diff, where = max((float((first["grads"][n] - g).abs().max()), n) for n, g in ref["grads"].items())
    assert diff <= 1e-5 + 1e-4 * scale, (diff, where)
    diff, where = max((float((first["weights"][n] - w).abs().max()), n) for n, w in ref["weights"].items())
    assert diff <= 1e-5, (diff, where)
    assert ref["biases"].keys() == first["biases"].keys()
    for n, bias in ref["biases"].items():
        for rank in ranks:  # the same bias on every rank, one process's
            assert torch.equal(rank["biases"][n], first["biases"][n]), n
        torch.testing.assert_close(first["biases"][n], bias, rtol=0, atol=1e-7)


def test_the_checks_are_sensitive():
    """A rank's own auxiliary loss differs from the whole batch's, the biases moved, and DeepSeek-V3's
    bias changes its routing: the comparisons above would catch a per-rank loss or a missing update."""
    inputs, _ = _batch(8, 16)
    model = build_aux_mixtral()
    with torch.no_grad():
        whole, part = (float(model(x).aux_loss) for x in (inputs, inputs[:2]))
    assert abs(whole - part) > 1e-3
    ref = _one_process("gpt", (8, 16))
    assert all(float(b.abs().max()) > 0 for b in ref["biases"].values())
    with torch.no_grad():
        assert not torch.allclose(build_biased_deepseek_v3()(inputs).logits, build_biased_deepseek_v3(False)(inputs).logits)


def test_experts_idle_and_one_expert_pair_take_every_token_with_balancing_on(results):
    """Experts 0 and 1 take every token: the ranks holding 2 and 3 receive no rows (and match one process above)."""
    assert [rank["received"] > 0 for rank in results["one-sided", "ep=4", (8, 16)]] == [True, True, False, False]
    ref = _one_process("one-sided", (8, 16))
    assert all(b[:2].min() > 29 and float(b[2:].max()) == pytest.approx(STEPS * 1e-3) for b in ref["biases"].values())


def test_masked_aux_loss_is_the_whole_batch_one(results):
    """With an attention mask (padding differs per rank, one sample all padding) the value on every
    rank and the mean of the ranks' gradients are one process's."""
    logits, mask = _masked_inputs()
    whole = tuple(layer.clone().requires_grad_() for layer in logits)
    aux = load_balancing_loss_func(whole, 4, 2, mask)
    aux.backward()
    ranks = results["masked"]
    for value, _ in ranks:
        assert value == pytest.approx(float(aux), abs=1e-6)
    for layer, grad in enumerate(whole):
        mean = torch.cat([rank[1][layer].view(2, 5, 4) for rank in ranks]).reshape(40, 4) / len(ranks)
        torch.testing.assert_close(mean, grad.grad, rtol=1e-5, atol=1e-7)


def test_accumulation_with_an_aux_loss_is_refused_by_name(results):
    for rank in results[ALL[0]]:
        assert "load_balancing_loss_func" in rank.get("accumulate", "") and "use accumulate=1" in rank["accumulate"]


# -- refusals before launch --------------------------------------------------------------------------------------------
def _problems(plan: sk.Plan, build) -> str:
    with pytest.raises(sk.PlanError) as info:
        sk.validate(plan, meta_model(build))
    return str(info.value)


def build_switch_loss_gpt() -> GPT:
    """The balanced GPT whose module's load-balancing function is replaced by another formula."""
    return build_balanced_gpt_moe(balance="none")


def test_an_unknown_router_loss_is_refused_under_a_split_batch(monkeypatch):
    import shardkit.models.gpt as gpt_module

    monkeypatch.setattr(gpt_module, "load_balancing_loss_func", lambda logits, e, k: 2 * logits[0].mean())
    text = _problems(sk.Plan(mesh=sk.Mesh(dp=2)), build_switch_loss_gpt)
    assert "GPT's forward computes a router loss with shardkit.models.gpt.load_balancing_loss_func, which is not " \
           "transformers' load-balancing formula" in text and "dp=2" in text
    sk.validate(sk.Plan(mesh=sk.Mesh(tp=1)), meta_model(build_switch_loss_gpt))  # one data rank: nothing to keep whole


def test_pipelines_and_full_recompute_are_refused_by_name():
    pipeline = sk.Pipeline(stages=2, microbatches=2)
    text = _problems(sk.Plan(mesh=sk.Mesh(pp=2), pipeline=pipeline), build_balanced_gpt_moe)
    assert "computes a router auxiliary loss (shardkit.models.gpt.load_balancing_loss_func)" in text
    assert "routers ['layers.0.mlp.gate', 'layers.1.mlp.gate'] balance their experts with a bias" in text
    text = _problems(sk.Plan(mesh=sk.Mesh(dp=2), recompute="full"), build_balanced_gpt_moe)
    assert "recompute='full' runs every block's forward twice, counting it twice" in text


def test_shardkit_train_refuses_accumulation_with_an_aux_loss_before_launch(capsys, no_processes):
    from shardkit.cli import main

    argv = ["train", "--model", "test_expert_routing:build_balanced_gpt_moe", "--mesh", "fsdp=2,ep=2",
            "--seq-len", "16", "--batch-size", "8"]
    assert main(argv + ["--grad-accum", "2"]) == 2
    err = capsys.readouterr().err
    assert "--grad-accum 2: GPT's forward computes a router auxiliary loss (shardkit.models.gpt.load_balancing_loss_" \
           "func)" in err and "use one micro-batch per step" in err
