"""The plain-tensor decode path (runtime/plain_decode.py) against DTensor's, under tp=2 and in one process."""

from __future__ import annotations

import pytest
import torch
from model_zoo import build_qwen2

from shardkit.models.gpt import GPT_RULES, build_tiny_gpt, build_tiny_gpt_moe
from shardkit.models.hf import LLAMA_RULES, build_tiny_llama
from shardkit.plan import Mesh, Plan, UsageError
from shardkit.runtime.apply import shard
from shardkit.runtime.generate import Decoder
from shardkit.runtime.plain_decode import PlainDecoder, plain_problems

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


def test_prompts_of_different_lengths_prefill_together_as_each_alone():
    model = build_tiny_llama().eval()
    decoder = PlainDecoder(model, slots=3, max_len=16)
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
