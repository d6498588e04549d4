"""The plain-tensor decode path (runtime/plain_decode.py) against DTensor's, under tp=2 and in one process."""

from __future__ import annotations

import functools

import pytest
import torch
from model_zoo import build_qwen2

from shardkit.models.gpt import GPT_RULES, build_tiny_gpt, build_tiny_gpt_moe
from shardkit.models.hf import LLAMA_RULES, build_tiny_llama
from shardkit.plan import Mesh, Plan, UsageError
from shardkit.runtime.apply import shard
from shardkit.runtime.generate import Decoder, generate
from shardkit.runtime.plain_decode import PlainDecoder, plain_problems
from shardkit.serving.engine import Engine
from shardkit.serving.requests import GenerationRequest, Inbox

PROMPT = torch.tensor([[3, 141, 59, 26, 53], [58, 97, 93, 238, 46]])
NEXT = [torch.tensor([[7], [9]]), torch.tensor([[120], [4]]), torch.tensor([[33], [250]])]
#: at tp=2 (the GPT's q/k/v biases split with their weights); Qwen2 (q/k/v biases too) in one process below
MODELS = {"gpt": (build_tiny_gpt, GPT_RULES), "llama": (build_tiny_llama, LLAMA_RULES)}


def _logits(decoder_step, plain: bool) -> list[torch.Tensor]:
    """The last position's logits of the prompt, then of each token of NEXT (the second of them at per-row
    positions, as the engine passes them)."""
    out = [decoder_step(PROMPT, 0)]
    for i, ids in enumerate(NEXT):
        past = PROMPT.shape[1] + i
        out.append(decoder_step(ids, torch.tensor([past, past]) if plain and i == 1 else past))
    return out


def _dtensor_step(model):
    decoder = Decoder(model)
    return lambda ids, past: decoder.step(ids)[:, -1]


def _both_paths(ctx, names):
    out = {}
    for name in names:
        build, rules = MODELS[name]
        model = shard(build(), Plan(mesh=Mesh(tp=2), rules=rules), ctx).eval()
        plain = PlainDecoder(model, slots=2, max_len=16)  # re-points q/k/v, gate/up shards: DTensor must still agree
        out[name] = (_logits(plain.step, True), _logits(_dtensor_step(model), False), plain.kv_heads)
    return out


@pytest.fixture(scope="module")
def tp_logits(world):
    return world(2).run(_both_paths, list(MODELS), plan=Plan(mesh=Mesh(tp=2)), timeout=300)


BF16_PROMPTS, BF16_NEW = [[3, 141, 59, 26, 53], [58, 97]], 6


@functools.cache
def _hf_bf16() -> tuple[list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """transformers in bfloat16, each prompt alone: its greedy tokens, and the logits before each of them in
    bfloat16 and float32 (the same weights)."""
    tokens, in_bf16, in_float32 = [], [], []
    model = build_tiny_llama().eval()
    with torch.no_grad():
        for prompt in BF16_PROMPTS:
            ids = torch.tensor([prompt])
            out = model.to(torch.bfloat16).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                    max_new_tokens=BF16_NEW, eos_token_id=None, pad_token_id=0)
            tokens.append(out[0, len(prompt):].tolist())
            before = slice(len(prompt) - 1, -1)
            in_bf16.append(model(out).logits[0, before].float())
            in_float32.append(model.float()(out).logits[0, before])
    return tokens, in_bf16, in_float32


def _bf16_paths(ctx, tokens):
    """tp=2, bfloat16: the plain decoder's logits along ``tokens`` (both prompts prefilled together, then per-row
    steps), and sk.generate's greedy tokens of each prompt."""
    model = shard(build_tiny_llama().to(torch.bfloat16), Plan(mesh=Mesh(tp=2), rules=LLAMA_RULES), ctx).eval()
    decoder = PlainDecoder(model, slots=2, max_len=16)
    logits = [decoder.prefill(BF16_PROMPTS)]
    lengths = torch.tensor([len(p) for p in BF16_PROMPTS])
    for i in range(BF16_NEW - 1):
        logits.append(decoder.step(torch.tensor([[t[i]] for t in tokens]), lengths + i))
    made = [generate(model, torch.tensor([p]), max_new_tokens=BF16_NEW, eos_token_id=None)[0, len(p):].tolist()
            for p in BF16_PROMPTS]
    return torch.stack(logits, 1).float(), made


@pytest.mark.parametrize("name", list(MODELS))
def test_plain_decode_under_tp_equals_the_dtensor_path_and_one_process(tp_logits, name):
    build = MODELS[name][0]
    with torch.no_grad():
        single = _logits(_dtensor_step(build().eval()), False)
    for rank in tp_logits:
        plain, dtensor, kv_heads = rank[name]
        assert kv_heads == 1 if name != "gpt" else kv_heads == 2  # each rank caches its own heads only
        for p, d, s in zip(plain, dtensor, single):
            torch.testing.assert_close(p, d, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(p, s, atol=1e-5, rtol=1e-5)


def test_plain_decode_of_qwen2_equals_its_own_forward():
    model = build_qwen2().eval()
    plain, dtensor = _logits(PlainDecoder(model, slots=2, max_len=16).step, True), _logits(_dtensor_step(model), False)
    for p, d in zip(plain, dtensor):
        torch.testing.assert_close(p, d, atol=1e-5, rtol=1e-5)


def test_rows_at_different_positions_share_a_step():
    model = build_tiny_llama().eval()
    decoder = PlainDecoder(model, slots=2, max_len=16)
    decoder.step(PROMPT[:1], 0)  # slot 0: five tokens; slot 1: three
    decoder.step(PROMPT[1:, :3], 0, first_slot=1)
    both = decoder.step(torch.tensor([[7], [8]]), torch.tensor([5, 3]), kv_len=6)
    with torch.no_grad():
        alone = [model(torch.cat([PROMPT[:1], torch.tensor([[7]])], 1)).logits[:, -1],
                 model(torch.cat([PROMPT[1:, :3], torch.tensor([[8]])], 1)).logits[:, -1]]
    torch.testing.assert_close(both, torch.cat(alone), atol=1e-5, rtol=1e-5)


def test_plain_decode_names_what_it_cannot_run():
    assert plain_problems(build_tiny_llama()) == []
    with pytest.raises(UsageError, match="dense MLPs.*not GPT with experts"):
        PlainDecoder(build_tiny_gpt_moe(), slots=1, max_len=8)


@pytest.mark.parametrize("transposed", [False, True])
def test_prompts_of_different_lengths_prefill_together_as_each_alone(transposed):
    model = build_tiny_llama().eval()
    decoder = PlainDecoder(model, slots=3, max_len=16)
    decoder._transposed.update({15: transposed, 3: transposed})  # each product's form at 3 x 5 and 3 rows, not timed
    prompts = [PROMPT[0].tolist(), [58, 97], PROMPT[1, :4].tolist()]  # padded to 5: the second row's 3 padding
    first = decoder.prefill(prompts)                                  # positions hold keys a later step must mask
    nxt = decoder.step(torch.tensor([[7], [8], [9]]), torch.tensor([5, 2, 4]), kv_len=6)
    with torch.no_grad():
        for row, (prompt, token) in enumerate(zip(prompts, (7, 8, 9))):
            alone = model(torch.tensor([prompt + [token]])).logits[0]
            torch.testing.assert_close(first[row], alone[-2], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(nxt[row], alone[-1], atol=1e-5, rtol=1e-5)
    with pytest.raises(UsageError, match="prefill: 1 prompts of 1 to 16 tokens from slot 3 of 3"):
        decoder.prefill([[1]], first_slot=3)


def _sure(hf_logits: torch.Tensor, allowed: float) -> int:
    """The greedy steps before transformers' first near-tie: top two closer than ``allowed``."""
    top2 = hf_logits.topk(2).values
    return int((top2[:, 0] - top2[:, 1] > allowed).long().cumprod(0).sum())


def _allowed(in_bf16: list[torch.Tensor], in_float32: list[torch.Tensor]) -> float:
    """What bfloat16 allows on this model: twice its own distance from float32 (under tp=2 the row-parallel
    partial sums are rounded to bfloat16 before the all_reduce)."""
    return 2 * max(float((b - f).abs().max()) for b, f in zip(in_bf16, in_float32))


def test_bfloat16_decoding_under_tp_agrees_with_transformers_in_bfloat16(world):
    """Logits within what bfloat16 allows of transformers' in bfloat16, and sk.generate's greedy tokens equal for
    as long as transformers' top two are further apart than that."""
    tokens, in_bf16, in_float32 = _hf_bf16()
    allowed = _allowed(in_bf16, in_float32)
    logits, made = world(2).run(_bf16_paths, tokens, plan=Plan(mesh=Mesh(tp=2)), timeout=300)[0]
    for row, (expected, hf) in enumerate(zip(tokens, in_bf16)):
        assert float((logits[row] - hf).abs().max()) <= allowed
        sure = _sure(hf, allowed)
        assert sure >= 2 and made[row][:sure] == expected[:sure]


def test_the_engine_in_bfloat16_agrees_with_transformers_in_bfloat16():
    tokens, in_bf16, in_float32 = _hf_bf16()
    inbox, events = Inbox(max_queue=2), []
    for i, prompt in enumerate(BF16_PROMPTS):  # both join at the first step: prefilled together
        inbox.submit(GenerationRequest(str(i), tuple(prompt), BF16_NEW), events.append)
    inbox.close()
    Engine(build_tiny_llama().to(torch.bfloat16), inbox, slots=2, max_len=16, quiet=True).run()
    allowed = _allowed(in_bf16, in_float32)
    for i, (expected, hf) in enumerate(zip(tokens, in_bf16)):
        made = [e.token for e in events if e.request_id == str(i) and e.token is not None]
        sure = _sure(hf, allowed)
        assert sure >= 2 and made[:sure] == expected[:sure]
