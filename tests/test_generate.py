"""sk.generate: tensor-parallel decoding with a per-rank KV cache, equal to one process; its refusals."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace

import pytest
import torch
from model_zoo import build_gpt4

import shardkit.cli.generate as generate_cli
import shardkit.runtime.world as world_module
from shardkit.checkpoint.store import save
from shardkit.cli import main
from shardkit.models.gpt import GPT_RULES, build_tiny_gpt
from shardkit.models.hf import GPT2_RULES, LLAMA_RULES, build_tiny_gpt2, build_tiny_llama
from shardkit.plan import Mesh, Pipeline, Plan, PlanError, UsageError
from shardkit.planner.validate import validate
from shardkit.runtime.apply import shard
from shardkit.runtime.generate import Decoder, generate, generation_problems, stop_tokens

PROMPT = torch.tensor([[3, 141, 59, 26, 53], [58, 97, 93, 238, 46]])
NEW = 10
SAMPLING = {"temperature": 1.0, "top_k": 20, "seed": 5}
SCALE = 1.5  # the saved GPT's weights: the built ones times this, so a CLI run that ignored the checkpoint differs
# Stop tokens of the tiny Llama on PROMPT, from its greedy tokens (row 0: 189 73 128 100 ..., row 1: 130 44 207 ...;
# the tests check these premises on transformers' own output):
STOP_BOTH = [100, 207]  # row 1 stops at new token 3, row 0 at 4: generation ends after 4 of NEW tokens
STOP_ONE = 128  # row 0 stops at new token 3, row 1 never: row 0 padded to NEW tokens
STOP_SAMPLED = [181, 41]  # in the sampled tokens (SAMPLING) of both rows, at new tokens 2 and 3
PAD = 0  # a generation_config.pad_token_id, for the run with the model's own eos


def _greedy_without_cache(model: torch.nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    """The plainest greedy loop: the whole sequence re-run at every step (no cache)."""
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def _hf_greedy(model: torch.nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    """transformers' own generate on the whole model (no stop token: every run makes ``new`` tokens)."""
    model.generation_config.eos_token_id = None
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                          pad_token_id=0)


def _hf_stopping(eos: int | list[int], pad: int, ids: torch.Tensor = PROMPT) -> torch.Tensor:
    """transformers' greedy generate on the whole model, stopping at ``eos``, padding with ``pad``."""
    return build_tiny_llama().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                       do_sample=False, eos_token_id=eos, pad_token_id=pad)


def _llama_stops(model: torch.nn.Module) -> dict:
    """A sharded Llama with stop tokens (every rank): every row stopping (also streamed), one row stopping,
    sampling, then the model's own eos and pad set in its generation_config (left changed)."""
    streamed: list[torch.Tensor] = []
    out = {("stop", "both"): generate(model, PROMPT, max_new_tokens=NEW, eos_token_id=STOP_BOTH,
                                      on_token=streamed.append)}
    out["stop", "streamed"] = torch.stack(streamed, dim=1)
    out["stop", "one"] = generate(model, PROMPT, max_new_tokens=NEW, eos_token_id=STOP_ONE)
    out["stop", "sampled"] = generate(model, PROMPT, max_new_tokens=NEW, eos_token_id=STOP_SAMPLED, **SAMPLING)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = STOP_ONE, PAD
    out["stop", "default"] = generate(model, PROMPT, max_new_tokens=NEW)
    return out


def _check_stops(ranks: list[dict]) -> None:
    """Every rank's stopped tokens equal transformers' (and one process's, sampled), shorter lengths included."""
    both, one, default = _hf_stopping(STOP_BOTH, STOP_BOTH[0]), _hf_stopping(STOP_ONE, STOP_ONE), \
        _hf_stopping(STOP_ONE, PAD)
    new_one = one[:, PROMPT.shape[1]:]
    assert both.shape == (2, PROMPT.shape[1] + 4)  # premises: every row stopped early; only row 0 stopped
    assert STOP_ONE in new_one[0, :-2] and STOP_ONE not in new_one[1] and (default[0, -2:] == PAD).all()
    sampled = generate(build_tiny_llama(), PROMPT, max_new_tokens=NEW, eos_token_id=STOP_SAMPLED, **SAMPLING)
    assert sampled.shape == (2, PROMPT.shape[1] + 3)
    for rank in ranks:
        assert torch.equal(rank["stop", "both"], both)
        assert torch.equal(rank["stop", "streamed"], both[:, PROMPT.shape[1]:])  # pad streamed for a finished row
        assert torch.equal(rank["stop", "one"], one)
        assert torch.equal(rank["stop", "sampled"], sampled)
        assert torch.equal(rank["stop", "default"], default)


def _cache_heads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, int]:
    """(KV heads held by this rank's cache of layer 0, cache bytes) after a prefill of ``ids``."""
    decoder = Decoder(model)
    with torch.no_grad():
        decoder.step(ids)
    return decoder.cache.layers[0].keys.shape[1], decoder.nbytes


def _scaled_gpt() -> torch.nn.Module:
    model = build_tiny_gpt()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(SCALE)
    return model.eval()


class HostReads:
    """Counts the reads of a tensor's values into Python (a device sync on CUDA) while it is entered."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self):
        self.count, self.saved = 0, {name: getattr(torch.Tensor, name) for name in self.NAMES}

    def _counted(self, read):
        def counted(tensor, *args, **kwargs):
            self.count += 1
            return read(tensor, *args, **kwargs)
        return counted

    def __enter__(self):
        for name, read in self.saved.items():
            setattr(torch.Tensor, name, self._counted(read))
        return self

    def __exit__(self, *exc):
        for name, read in self.saved.items():
            setattr(torch.Tensor, name, read)


def reads_per_token(model: torch.nn.Module, **kwargs) -> float:
    """Host reads per generated token of ``generate`` (the difference of 2 and 8 tokens: checks before the loop
    cancel)."""
    counts = []
    for new in (2, 8):
        with HostReads() as reads:
            generate(model, PROMPT, max_new_tokens=new, **kwargs)
        counts.append(reads.count)
    return (counts[1] - counts[0]) / 6


@pytest.mark.parametrize("build,kwargs", [(build_tiny_gpt, {"eos_token_id": STOP_ONE}), (build_tiny_gpt, SAMPLING)])
def test_one_host_read_per_generated_token(build, kwargs):
    assert reads_per_token(build(), **kwargs) == 1


def _tp_generation(ctx, folder):
    """Every tp=2 check in one job: greedy and sampled tokens of Llama and the reference GPT, cache heads;
    then a GPT checkpoint with scaled weights saved in ``folder`` for the command line."""
    out = {}
    for name, build, rules in (("llama", build_tiny_llama, LLAMA_RULES), ("gpt", build_tiny_gpt, GPT_RULES)):
        model = shard(build(), Plan(mesh=Mesh(tp=2), rules=rules), ctx)
        streamed = []
        out[name, "greedy"] = generate(model, PROMPT, max_new_tokens=NEW, on_token=streamed.append)
        out[name, "streamed"] = torch.stack(streamed, dim=1)
        out[name, "sampled"] = generate(model, PROMPT, max_new_tokens=NEW, **SAMPLING)
        out[name, "cache"] = _cache_heads(model, PROMPT)
        out[name, "training"] = model.training
        out[name, "reads"] = reads_per_token(model, eos_token_id=STOP_ONE)
        if name == "llama":
            out.update(_llama_stops(model))
    gpt2 = shard(build_tiny_gpt2(), Plan(mesh=Mesh(tp=2), rules=GPT2_RULES), ctx)  # fused, permuted c_attn
    out["gpt2", "greedy"] = generate(gpt2, PROMPT, max_new_tokens=NEW)
    with torch.no_grad():  # a weight of the last block made nan on every rank: each rank stops with the same error
        gpt2.transformer.h[-1].mlp.c_proj.bias.fill_(float("nan"))
    try:
        generate(gpt2, PROMPT, max_new_tokens=NEW)
    except UsageError as exc:
        out["gpt2", "nan"] = str(exc)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(SCALE)
    save(folder, model, step=1)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tmp_path_factory.mktemp("generate") / "gpt"


@pytest.fixture(scope="module")
def tp_results(world, checkpoint):
    return world(2).run(_tp_generation, checkpoint, plan=Plan(mesh=Mesh(tp=2)), timeout=300)


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_every_rank_generates_the_same_tokens(tp_results, name):
    for kind in ("greedy", "sampled"):
        assert torch.equal(tp_results[0][name, kind], tp_results[1][name, kind])
    assert torch.equal(tp_results[0][name, "streamed"], tp_results[0][name, "greedy"][:, PROMPT.shape[1]:])
    assert tp_results[0][name, "training"]  # the model's mode is given back
    assert [rank[name, "reads"] for rank in tp_results] == [1, 1]  # one host read per token on each rank


def test_llama_greedy_under_tp_equals_transformers_generate(tp_results):
    expected = _hf_greedy(build_tiny_llama(), PROMPT, NEW)
    assert expected.shape == (2, PROMPT.shape[1] + NEW)
    assert torch.equal(tp_results[0]["llama", "greedy"], expected)


def test_llama_under_tp_stops_at_eos_as_transformers_generate(tp_results):
    _check_stops(tp_results)


def test_gpt2_greedy_under_tp_equals_transformers_generate(tp_results):
    assert torch.equal(tp_results[0]["gpt2", "greedy"], _hf_greedy(build_tiny_gpt2(), PROMPT, NEW))


def test_nan_logits_stop_every_rank_with_the_reason(tp_results):
    for rank in tp_results:
        assert "logits for new token 1 of prompt(s) [0, 1] are nan or +inf" in rank["gpt2", "nan"]
        assert "stopped after 0 new tokens" in rank["gpt2", "nan"]


def test_gpt_greedy_under_tp_equals_a_single_process_loop(tp_results):
    assert torch.equal(tp_results[0]["gpt", "greedy"], _greedy_without_cache(build_tiny_gpt().eval(), PROMPT, NEW))


@pytest.mark.parametrize("name,build", [("llama", build_tiny_llama), ("gpt", build_tiny_gpt)])
def test_sampling_under_tp_equals_one_process_with_the_same_seed(tp_results, name, build):
    single = generate(build(), PROMPT, max_new_tokens=NEW, **SAMPLING)
    assert torch.equal(tp_results[0][name, "sampled"], single)
    assert not torch.equal(single, generate(build(), PROMPT, max_new_tokens=NEW))  # it did sample
    assert torch.equal(single, generate(build(), PROMPT, max_new_tokens=NEW, **SAMPLING))  # seeded


@pytest.mark.parametrize("name,build,local_heads", [("llama", build_tiny_llama, 1), ("gpt", build_tiny_gpt, 2)])
def test_each_rank_caches_only_its_own_kv_heads(tp_results, name, build, local_heads):
    heads, nbytes = _cache_heads(build(), PROMPT)
    assert heads == 2 * local_heads
    for rank in (0, 1):
        assert tp_results[rank][name, "cache"] == (local_heads, nbytes // 2)


# -- one process: the reference GPT's cache, argument checks, refusals ---------------------------
def test_gpt_cache_gives_the_logits_of_the_whole_sequence():
    model = build_tiny_gpt()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = model.kv_cache()
    pieces = [model(ids[:, :5], cache=cache), model(ids[:, 5:9], cache=cache)]
    pieces += [model(ids[:, i:i + 1], cache=cache) for i in range(9, 12)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), model(ids), atol=1e-5, rtol=1e-5)
    assert cache.length == 12


def test_gqa_with_fewer_kv_heads_than_tp_ranks_is_refused_before_launch():
    with pytest.raises(PlanError, match=r"4 query heads and 2 key/value heads.*valid tp sizes: \[1, 2\]"):
        validate(Plan(mesh=Mesh(tp=4), rules=LLAMA_RULES), build_tiny_llama(), 4)


@pytest.mark.parametrize("plan,expected", [
    (Plan(mesh=Mesh(sp=2, tp=2)), r"mesh axis 'sp' has size 2"),
    (Plan(mesh=Mesh(tp=2), sequence_parallel=True), r"sequence_parallel=True\) .* one token"),
])
def test_plans_generate_cannot_run_are_refused_with_the_reason(plan, expected):
    with pytest.raises(PlanError, match=expected):
        raise PlanError(generation_problems(plan))
    model = build_tiny_gpt()
    model.plan = plan  # as sk.shard leaves it: generate refuses before any collective
    with pytest.raises(PlanError, match=expected):
        generate(model, PROMPT, max_new_tokens=2)


@pytest.mark.parametrize("ids,kwargs,expected", [
    (PROMPT.float(), {"max_new_tokens": 2}, r"input_ids must be a torch.int64 or torch.int32 tensor .*torch.float32"),
    (PROMPT[0], {"max_new_tokens": 2}, r"int32 tensor \[batch, prompt\].*shape \[5\]"),
    (PROMPT, {"max_new_tokens": 0}, r"max_new_tokens must be a positive integer, got 0"),
    (PROMPT, {"max_new_tokens": True}, r"max_new_tokens must be a positive integer, got True"),
    (PROMPT, {"max_new_tokens": 2, "temperature": -1.0}, r"temperature must be a finite number >= 0"),
    (PROMPT, {"max_new_tokens": 2, "temperature": float("nan")}, r"temperature must be a finite number"),
    (PROMPT, {"max_new_tokens": 2, "top_k": 5}, r"top_k=5 applies only to sampling"),
    (PROMPT, {"max_new_tokens": 2, "seed": 1}, r"seed=1 applies only to sampling"),
    (PROMPT, {"max_new_tokens": 2, "temperature": 1.0, "top_k": 0}, r"top_k must be a positive integer"),
    (PROMPT.to(torch.uint8), {"max_new_tokens": 2}, r"torch.int64 or torch.int32 tensor.*torch.uint8"),
    (PROMPT[:0], {"max_new_tokens": 2}, r"at least one prompt.*shape \[0, 5\]"),
    (PROMPT, {"max_new_tokens": 2, "temperature": 1.0, "seed": 2**64}, r"seed must be an integer from 0 to 2\*\*64 - 1"),
    (PROMPT, {"max_new_tokens": 2, "temperature": 1.0, "top_k": 257}, r"top_k=257 is more than .* 256"),
    (PROMPT + 200, {"max_new_tokens": 2}, r"ids from 203 to 438.*valid ids: 0 to 255"),
    (PROMPT, {"max_new_tokens": 28}, r"33 positions, but GPT has 32; valid: max_new_tokens <= 27"),
    (PROMPT, {"max_new_tokens": 2, "eos_token_id": True}, r"eos_token_id must be a token id .*, got True"),
    (PROMPT, {"max_new_tokens": 2, "eos_token_id": []}, r"eos_token_id must be .*a non-empty list.*, got \[\]"),
    (PROMPT, {"max_new_tokens": 2, "eos_token_id": -1}, r"eos_token_id must be a token id \(an int >= 0\).*got -1"),
    (PROMPT, {"max_new_tokens": 2, "eos_token_id": [3, "4"]}, r"eos_token_id must be .*, got \[3, '4'\]"),
    (PROMPT, {"max_new_tokens": 2, "eos_token_id": 2.0}, r"eos_token_id must be .*or None \(no stop\), got 2.0"),
    (PROMPT, {"max_new_tokens": 2, "eos_token_id": [3, 256]}, r"eos_token_id=\[3, 256\] holds id 256.*valid ids: 0 to 255"),
])
def test_bad_arguments_are_refused_naming_the_argument(ids, kwargs, expected):
    with pytest.raises(UsageError, match=expected):
        generate(build_tiny_gpt(), ids, **kwargs)


def test_the_default_stop_is_the_models_generation_config_and_none_means_no_stop():
    model = build_tiny_llama()
    assert stop_tokens(model) == ([2], 2) and stop_tokens(build_tiny_gpt()) is None  # the reference GPT: no eos
    model.generation_config.eos_token_id = STOP_ONE  # as transformers: stop there, pad with the eos (no pad set)
    expected = _hf_stopping(STOP_ONE, STOP_ONE, PROMPT[:1])
    assert expected.shape[1] < PROMPT.shape[1] + NEW  # premise: it stopped
    assert torch.equal(generate(model, PROMPT[:1], max_new_tokens=NEW), expected)
    assert torch.equal(generate(model, PROMPT[:1], max_new_tokens=NEW, eos_token_id=None),
                       _hf_greedy(build_tiny_llama(), PROMPT[:1], NEW))


def test_a_tiny_temperature_samples_the_likeliest_token():
    model = build_tiny_gpt()
    greedy = generate(model, PROMPT, max_new_tokens=4)
    assert torch.equal(generate(model, PROMPT, max_new_tokens=4, temperature=1e-45, seed=2**64 - 1), greedy)


def test_nan_weights_in_one_process_are_named():
    model = build_tiny_gpt()
    with torch.no_grad():
        model.lm_head.weight[3].fill_(float("nan"))
    with pytest.raises(UsageError, match=r"new token 1 of prompt\(s\) \[0, 1\] are nan or \+inf"):
        generate(model, PROMPT, max_new_tokens=2)


def test_a_model_without_a_cache_is_refused():
    with pytest.raises(UsageError, match=r"cannot decode Sequential: it needs a transformers model"):
        generate(torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8)), PROMPT % 8, max_new_tokens=1)


# -- pipelines: pp=2, pp=2 x tp=2, a zero-bubble V schedule ---------------------------------------
def _cached_layers(model: torch.nn.Module) -> list[int]:
    """The layers whose cache fills on this rank in a prefill of PROMPT."""
    decoder = Decoder(model)
    with torch.no_grad():
        decoder.step(PROMPT)
    return [i for i, layer in enumerate(decoder.cache.layers) if getattr(layer, "keys", None) is not None]


def _pp_generation(ctx):
    """Greedy and sampled tokens of Llama and the reference GPT under the world's pipeline plan (rules added
    where it has 'tp'), each rank's cached layers; on pp=2 also a 4-layer GPT under the zbv schedule."""
    out = {}
    models = [("llama", build_tiny_llama, LLAMA_RULES), ("gpt", build_tiny_gpt, GPT_RULES)]
    for name, build, rules in models:
        model = shard(build(), replace(ctx.plan, rules=rules) if ctx.plan.mesh.size_of("tp") > 1 else ctx.plan, ctx)
        streamed = []
        out[name, "greedy"] = generate(model, PROMPT, max_new_tokens=NEW, on_token=streamed.append)
        out[name, "streamed"] = torch.stack(streamed, dim=1)
        out[name, "sampled"] = generate(model, PROMPT, max_new_tokens=NEW, **SAMPLING)
        out[name, "layers"] = _cached_layers(model)
        out[name, "reads"] = reads_per_token(model, eos_token_id=STOP_ONE)
        if name == "llama":
            out.update(_llama_stops(model))
    if ctx.plan.mesh.size_of("tp") == 1:
        plan = replace(ctx.plan, pipeline=Pipeline(microbatches=2, schedule="zbv", virtual_stages=2))
        out["zbv", "greedy"] = generate(shard(build_gpt4(), plan, ctx), PROMPT, max_new_tokens=NEW)
    return out


PIPELINE_PLANS = {"pp2": Plan(mesh=Mesh(pp=2), pipeline=Pipeline(microbatches=2)),
                  "pp2xtp2": Plan(mesh=Mesh(pp=2, tp=2), pipeline=Pipeline(microbatches=2))}


@pytest.fixture(scope="module")
def pipeline_runs(world):
    """{plan name: every rank's results} for each plan of PIPELINE_PLANS."""
    return {name: world(plan.mesh.size).run(_pp_generation, plan=plan, timeout=300)
            for name, plan in PIPELINE_PLANS.items()}


@pytest.mark.parametrize("plan", list(PIPELINE_PLANS))
def test_llama_greedy_under_a_pipeline_equals_transformers_generate(pipeline_runs, plan):
    expected = _hf_greedy(build_tiny_llama(), PROMPT, NEW)
    for rank in pipeline_runs[plan]:
        assert torch.equal(rank["llama", "greedy"], expected)
        assert torch.equal(rank["llama", "streamed"], expected[:, PROMPT.shape[1]:])


@pytest.mark.parametrize("plan", list(PIPELINE_PLANS))
def test_llama_under_a_pipeline_stops_at_eos_as_transformers_generate(pipeline_runs, plan):
    _check_stops(pipeline_runs[plan])


@pytest.mark.parametrize("plan", list(PIPELINE_PLANS))
def test_gpt_greedy_under_a_pipeline_equals_a_single_process_loop(pipeline_runs, plan):
    expected = _greedy_without_cache(build_tiny_gpt().eval(), PROMPT, NEW)
    assert all(torch.equal(rank["gpt", "greedy"], expected) for rank in pipeline_runs[plan])


@pytest.mark.parametrize("plan", list(PIPELINE_PLANS))
def test_one_host_read_per_generated_token_under_a_pipeline(pipeline_runs, plan):
    """The receiving stage is sent no header for a decode step's hidden states once it knows their shape."""
    reads = [(rank["llama", "reads"], rank["gpt", "reads"]) for rank in pipeline_runs[plan]]
    assert reads == [(1, 1)] * len(reads), f"host reads per token, by rank: {reads}"


def test_a_zero_bubble_v_pipeline_generates_as_one_process(pipeline_runs):
    expected = _greedy_without_cache(build_gpt4().eval(), PROMPT, NEW)
    assert all(torch.equal(rank["zbv", "greedy"], expected) for rank in pipeline_runs["pp2"])


@pytest.mark.parametrize("plan", list(PIPELINE_PLANS))
@pytest.mark.parametrize("name,build", [("llama", build_tiny_llama), ("gpt", build_tiny_gpt)])
def test_sampling_under_a_pipeline_equals_one_process_with_the_same_seed(pipeline_runs, plan, name, build):
    single = generate(build(), PROMPT, max_new_tokens=NEW, **SAMPLING)
    assert all(torch.equal(rank[name, "sampled"], single) for rank in pipeline_runs[plan])


@pytest.mark.parametrize("plan", list(PIPELINE_PLANS))
@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_each_pipeline_stage_caches_only_its_own_layers(pipeline_runs, plan, name):
    ranks = pipeline_runs[plan]
    assert len(ranks) == PIPELINE_PLANS[plan].mesh.size
    assert sorted({tuple(rank[name, "layers"]) for rank in ranks}) == [(0,), (1,)]  # a stage's tp ranks: one entry


# -- shardkit generate ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generate") / "llama"
    build_tiny_llama().save_pretrained(folder)
    return folder


@pytest.fixture
def cli(world, monkeypatch):
    """``cli(*argv)`` runs ``shardkit generate`` on the shared 2-process world; returns (exit code, every
    rank's new token ids)."""
    seen = []
    launch = world_module.launch

    def borrowed(fn, plan, *args, world_size, timeout):
        seen.append(launch(fn, plan, *args, world=world(world_size), timeout=timeout))
        return seen[-1]

    monkeypatch.setattr("shardkit.runtime.world.launch", borrowed)  # where generate finds it when it runs

    def run(*argv: str) -> tuple[int, list]:
        seen.clear()
        return main(["generate", *argv]), (seen[0] if seen else [])

    return run


def test_cli_generates_from_a_checkpoint_as_one_process_would(tp_results, checkpoint, cli):
    code, ranks = cli("--model", "gpt-tiny", "--checkpoint", str(checkpoint), "--mesh", "tp=2", "--prompt", "hi",
                      "--max-new-tokens", "12")
    assert code == 0
    expected = _greedy_without_cache(_scaled_gpt(), torch.tensor([list(b"hi")]), 12)[0, 2:].tolist()
    assert ranks == [expected, expected]
    assert expected != _greedy_without_cache(build_tiny_gpt().eval(), torch.tensor([list(b"hi")]), 12)[0, 2:].tolist()


def test_cli_generates_from_a_hf_folder_as_transformers_does(hf_folder, cli):
    ids = ",".join(map(str, PROMPT[0].tolist()))
    code, ranks = cli("--model", "llama-tiny", "--hf", str(hf_folder), "--mesh", "tp=2", "--prompt-ids", ids,
                      "--max-new-tokens", str(NEW))
    assert code == 0
    expected = _hf_greedy(build_tiny_llama(), PROMPT[:1], NEW)[0, PROMPT.shape[1]:].tolist()
    assert ranks == [expected, expected]


def test_cli_stops_at_the_models_eos_unless_told_otherwise(hf_folder, cli, tmp_path):
    config = json.loads((hf_folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": STOP_ONE}))
    weights = tmp_path / "weights"  # no generation_config.json, which would take the place of the config's eos
    shutil.copytree(hf_folder, weights, ignore=shutil.ignore_patterns("generation_config.json"))
    ids = ",".join(map(str, PROMPT[0].tolist()))
    argv = ["--model", str(tmp_path / "config.json"), "--hf", str(weights), "--mesh", "tp=2", "--prompt-ids", ids,
            "--max-new-tokens", str(NEW)]
    stopped = _hf_stopping(STOP_ONE, STOP_ONE, PROMPT[:1])[0, PROMPT.shape[1]:].tolist()
    assert len(stopped) < NEW and stopped[-1] == STOP_ONE  # premise
    assert cli(*argv) == (0, [stopped, stopped])  # the model's eos (its config's)
    whole = _hf_greedy(build_tiny_llama(), PROMPT[:1], NEW)[0, PROMPT.shape[1]:].tolist()
    assert cli(*argv, "--no-eos") == (0, [whole, whole])
    later = whole[:whole.index(STOP_BOTH[0]) + 1]  # past the model's eos: the flags replace it
    assert len(later) > len(stopped)  # premise
    assert cli(*argv, "--eos-token-id", "250", "--eos-token-id", str(STOP_BOTH[0])) == (0, [later, later])


def test_cli_takes_the_end_of_sequence_ids_of_the_folders_generation_config(hf_folder, cli, tmp_path):
    """As from_pretrained does: instruct models list their extra eos ids in generation_config.json only."""
    folder = tmp_path / "instruct"
    shutil.copytree(hf_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 250}))
    model = build_tiny_llama()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = [250, STOP_ONE], 0
    model.generation_config.save_pretrained(folder)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder)
    expected = loaded.generate(PROMPT[:1], attention_mask=torch.ones_like(PROMPT[:1]), max_new_tokens=NEW,
                               do_sample=False)[0, PROMPT.shape[1]:].tolist()
    assert len(expected) < NEW and expected[-1] == STOP_ONE  # premise: it stops at the folder's second eos
    ids = ",".join(map(str, PROMPT[0].tolist()))
    assert cli("--model", str(folder / "config.json"), "--hf", str(folder), "--mesh", "tp=2", "--prompt-ids", ids,
               "--max-new-tokens", str(NEW)) == (0, [expected, expected])


@pytest.mark.parametrize("eos", [True, -1, [3, "4"]])
def test_an_odd_eos_in_the_models_own_config_is_refused_naming_it(eos):
    model = build_tiny_llama()
    model.generation_config.eos_token_id = eos
    with pytest.raises(UsageError, match=r"the model's generation_config.eos_token_id is .*, which is no token id"):
        generate(model, PROMPT[:1], max_new_tokens=2)


def test_cli_takes_a_transformers_config_file_as_the_model(hf_folder, cli):
    ids = ",".join(map(str, PROMPT[0].tolist()))
    code, ranks = cli("--model", str(hf_folder / "config.json"), "--hf", str(hf_folder), "--mesh", "tp=2",
                      "--prompt-ids", ids, "--max-new-tokens", "4")
    expected = _hf_greedy(build_tiny_llama(), PROMPT[:1], 4)[0, PROMPT.shape[1]:].tolist()
    assert code == 0 and ranks == [expected, expected]


def test_cli_refuses_a_damaged_checkpoint_before_any_process(tp_results, checkpoint, tmp_path, capsys, no_processes):
    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    part = sorted(damaged.rglob("*.distcp"))[0]
    part.write_bytes(part.read_bytes()[:100])
    assert main(["generate", "--model", "gpt-tiny", "--checkpoint", str(damaged), "--prompt", "hi",
                 "--max-new-tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert f"--checkpoint {damaged}" in err and "is damaged" in err and part.name in err


def test_cli_generates_under_a_pipeline_from_a_checkpoint_and_a_hf_folder(tp_results, checkpoint, hf_folder, cli):
    code, ranks = cli("--model", "gpt-tiny", "--checkpoint", str(checkpoint), "--mesh", "pp=2", "--prompt", "hi",
                      "--max-new-tokens", "12")
    expected = _greedy_without_cache(_scaled_gpt(), torch.tensor([list(b"hi")]), 12)[0, 2:].tolist()
    assert code == 0 and ranks == [expected, expected]
    ids = ",".join(map(str, PROMPT[1].tolist()))
    code, ranks = cli("--model", "llama-tiny", "--hf", str(hf_folder), "--mesh", "pp=2", "--prompt-ids", ids,
                      "--max-new-tokens", str(NEW))
    expected = _hf_greedy(build_tiny_llama(), PROMPT[1:], NEW)[0, PROMPT.shape[1]:].tolist()
    assert code == 0 and ranks == [expected, expected]


@pytest.mark.parametrize("argv,expected", [
    (["--model", "llama-tiny", "--mesh", "tp=4", "--prompt-ids", "1,2"],
     r"invalid plan: .*2 key/value heads, but each rank must hold whole heads; valid tp sizes: \[1, 2\]"),
    (["--model", "llama-tiny", "--mesh", "sp=2", "--prompt-ids", "1,2"], r"--mesh sp=2: .*axis 'sp' has size 2"),
    (["--model", "llama-tiny", "--mesh", "pp=4", "--prompt-ids", "1,2"], r"pipeline has 4 stages but the model has only 2"),
    (["--model", "llama-tiny", "--mesh", "tp=-1", "--prompt-ids", "1"], r"--mesh tp=-1: give every axis its size"),
    (["--model", "llama-tiny", "--prompt-ids", "1,256"], r"--prompt-ids holds id 256.*valid ids: 0 to 255"),
    (["--model", "llama-tiny", "--prompt-ids", "1", "--top-k", "3"], r"--top-k apply only to sampling"),
    (["--model", "llama-tiny", "--prompt", ""], r"--prompt is empty"),
    (["--model", "gpt-small", "--prompt", "hi"], r"another model's parameters"),
    (["--model", "llama-tiny", "--prompt-ids", "1,x"], r"--prompt-ids: must be comma-separated"),
    (["--model", "llama-tiny", "--prompt-ids", "1", "--temperature", "0"], r"--temperature: must be a positive"),
    (["--model", "llama-tiny", "--prompt-ids", "1", "--temperature", "1", "--seed", str(2**64)],
     r"--seed: must be a 64-bit seed"),
    (["--model", "llama-tiny", "--prompt-ids", "1", "--no-eos", "--eos-token-id", "3"],
     r"--eos-token-id: not allowed with argument --no-eos"),
    (["--model", "llama-tiny", "--prompt-ids", "1", "--eos-token-id", "3", "--eos-token-id", "256"],
     r"--eos-token-id 256: model 'llama-tiny' has a vocabulary of 256; valid ids: 0 to 255"),
    (["--model", "llama-tiny", "--prompt-ids", "1", "--eos-token-id", "-1"], r"--eos-token-id: must be an integer >= 0"),
    (["--model", "llama-tiny", "--prompt-ids", "1", "--temperature", "0.8", "--top-k", "400"],
     r"--top-k 400: model 'llama-tiny' has a vocabulary of 256; valid: 1 to 256"),
])
def test_cli_refuses_before_any_process(argv, expected, hf_folder, tp_results, checkpoint, capsys, no_processes):
    weights = ["--checkpoint", str(checkpoint)] if "gpt-small" in argv else ["--hf", str(hf_folder)]
    try:
        code = main(["generate", *argv, *weights, "--max-new-tokens", "3"])
    except SystemExit as exc:  # a flag refused while parsing
        code = exc.code
    assert code == 2
    assert re.search(expected, capsys.readouterr().err)


def test_streamed_text_is_decoded_as_bytes_arrive(capsys):
    stream = generate_cli._Stream(True, True, tuple(b"caf"))
    for byte in "é!".encode():  # é is two bytes: nothing is printed for its first
        stream(torch.tensor([byte]))
    stream.end()
    ids = generate_cli._Stream(True, False, (1, 2))
    ids(torch.tensor([3]))
    ids.end()
    assert capsys.readouterr().out == "café!\n1 2 3\n"


def test_cli_refuses_more_tokens_than_positions(checkpoint, tp_results, capsys, no_processes):
    assert main(["generate", "--model", "gpt-tiny", "--checkpoint", str(checkpoint), "--prompt", "hi",
                 "--max-new-tokens", "31"]) == 2
    assert "--max-new-tokens 31: a prompt of 2 tokens and max_new_tokens=31 need 33 positions, but GPT has 32; " \
           "valid: max_new_tokens <= 30" in capsys.readouterr().err
