"""The decode step at tp=2: shardkit's plain-tensor path against a hand-written plain-tensor
tensor-parallel decode (the named baseline) and against the DTensor path.

A transformers Llama of about 250M parameters (hidden 1024, 16 layers, 16 heads, 8 KV heads,
intermediate 2816, vocabulary 32000; float32 by default) is sharded with ``sk.shard`` over
``Mesh(tp=2)`` in a local gloo world of 2 processes (one intra-op thread each). In the same
processes three decoders continue the same prompt (``--batch`` rows of ``--prompt`` tokens):

- **plain**: :class:`shardkit.runtime.plain_decode.PlainDecoder` as ``sk.generate`` runs it (every row at
  one position);
- **plain, per-row**: the same, each row given its own position as the serving engine does (a mask,
  the cache written at an index), here all rows at the same one;
- **hand-written** (the baseline, in this file): the same local shards as plain tensors, written
  the way one writes it by hand (gpt-fast style): separate q/k/v and gate/up matmuls, a
  preallocated cache written at one position, one ``all_reduce`` after o_proj and down_proj, a
  vocabulary-parallel embedding and an all-gathered output head;
- **DTensor**: :class:`shardkit.runtime.generate.Decoder` on the DTensor model (``sk.generate``'s
  decode before the plain path: torch's dispatch on every operator).

Each round runs ``--new`` decode steps, one step of each variant in turn (so load on the shared
machine hits all of them alike; a barrier, untimed, before each step, so that no step absorbs the
ranks' skew from the step before it), the order rotated at every step (each variant follows each
other as often: a step run just after the DTensor step's many allocations was 3-5% slower, whichever
it was); per variant, the median step time over every round is kept. The first step's
logits of plain and hand-written are printed. Printed: tokens/s (batch / step time) and each variant's
speed as a fraction of hand-written's (the target: plain at least 0.95) and of DTensor's.

    python benchmarks/decode.py [--new 32] [--rounds 5] [--batch 1] [--prompt 32] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import shardkit as sk
from shardkit.models.hf import LLAMA_RULES, build_llama, tiny_llama_config
from shardkit.runtime.devices import clock
from shardkit.runtime.generate import Decoder
from shardkit.runtime.plain_decode import PlainDecoder

SIZES = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
             intermediate_size=2816, vocab_size=32000, max_position_embeddings=2048)


class HandDecoder:
    """A Llama decode step by hand on one tp rank's local shards (the baseline)."""

    def __init__(self, model, batch: int, max_len: int):
        def local(p):
            return p.to_local() if hasattr(p, "to_local") else p.detach()

        body, config = model.model, model.config
        self.group = model.lm_head.weight.device_mesh.get_group()
        self.rank, self.tp = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.layers = [(local(b.input_layernorm.weight), local(b.self_attn.q_proj.weight),
                        local(b.self_attn.k_proj.weight), local(b.self_attn.v_proj.weight),
                        local(b.self_attn.o_proj.weight), local(b.post_attention_layernorm.weight),
                        local(b.mlp.gate_proj.weight), local(b.mlp.up_proj.weight), local(b.mlp.down_proj.weight))
                       for b in body.layers]
        self.embed, self.norm, self.head = local(body.embed_tokens.weight), local(body.norm.weight), \
            local(model.lm_head.weight)
        self.start = self.rank * self.embed.shape[0]
        kv_heads = self.layers[0][2].shape[0] // self.head_dim
        self.cache = [(torch.zeros(batch, kv_heads, max_len, self.head_dim),
                       torch.zeros(batch, kv_heads, max_len, self.head_dim)) for _ in self.layers]
        cos, sin = body.rotary_emb(torch.zeros(()), torch.arange(max_len)[None])
        self.cos, self.sin = cos[0], sin[0]
        self.gathered = [torch.empty(batch, self.head.shape[0]) for _ in range(self.tp)]

    def rms(self, x, w):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * h

    def rope(self, x, pos):
        half = x.shape[-1] // 2
        return x * self.cos[pos] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * self.sin[pos]

    @torch.no_grad()
    def step(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        """One token per row (``ids [batch, 1]``) at position ``pos``: logits ``[batch, vocab]``."""
        b, d = ids.shape[0], self.head_dim
        local = ids - self.start
        outside = (local < 0) | (local >= self.embed.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.embed).masked_fill_(outside[..., None], 0.0)
        dist.all_reduce(x, group=self.group)
        for (n1, wq, wk, wv, wo, n2, wg, wu, wd), (ck, cv) in zip(self.layers, self.cache):
            h = self.rms(x, n1)
            q = self.rope(F.linear(h, wq).view(b, 1, -1, d).transpose(1, 2), pos)
            k = self.rope(F.linear(h, wk).view(b, 1, -1, d).transpose(1, 2), pos)
            ck[:, :, pos] = k[:, :, 0]
            cv[:, :, pos] = F.linear(h, wv).view(b, -1, d)
            a = F.scaled_dot_product_attention(q, ck[:, :, :pos + 1], cv[:, :, :pos + 1], enable_gqa=True)
            o = F.linear(a.transpose(1, 2).reshape(b, 1, -1), wo)
            dist.all_reduce(o, group=self.group)
            x = x + o
            h = self.rms(x, n2)
            o = F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)
            dist.all_reduce(o, group=self.group)
            x = x + o
        logits = F.linear(self.rms(x[:, -1], self.norm), self.head)
        dist.all_gather(self.gathered, logits, group=self.group)
        return torch.cat(self.gathered, dim=-1)

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """The prompt one position at a time (the baseline times decode steps only)."""
        for pos in range(prompt.shape[1]):
            logits = self.step(prompt[:, pos:pos + 1], pos)
        return logits


#: The variants, in the table's order.
VARIANTS = ("plain", "plain, per-row", "hand-written", "DTensor")


def _last_position(decoder: Decoder):
    return lambda ids, pos: decoder.step(ids)[:, -1]


def _per_row(decoder: PlainDecoder, batch: int):
    """The engine's call: each row's own position (a ``[batch]`` tensor), ``kv_len`` given."""
    return lambda ids, pos: decoder.step(ids, torch.full((batch,), pos), kv_len=pos + 1)


def measure(ctx, batch: int, prompt_len: int, new: int, rounds: int, dtype: str) -> dict:
    torch.set_num_threads(1)
    model = sk.shard(build_llama(tiny_llama_config(**SIZES)).to(getattr(torch, dtype)), ctx.plan, ctx).eval()
    prompt = torch.randint(0, SIZES["vocab_size"], (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    agree = None
    for _ in range(rounds):
        plain = PlainDecoder(model, slots=batch, max_len=prompt_len + new + 1)
        per_row = PlainDecoder(model, slots=batch, max_len=prompt_len + new + 1)
        hand = HandDecoder(model, batch, prompt_len + new + 1) if dtype == "float32" else None
        dtensor = Decoder(model)
        steps = {"plain": plain.step, "plain, per-row": _per_row(per_row, batch), "DTensor": _last_position(dtensor)}
        first = {"plain": plain.step(prompt, 0), "plain, per-row": per_row.prefill(prompt.tolist()),
                 "DTensor": dtensor.step(prompt)[:, -1]}
        if hand is not None:
            steps["hand-written"], first["hand-written"] = hand.step, hand.prefill(prompt)
            agree = float((first["plain"] - first["hand-written"]).abs().max())
        ids = {name: logits.argmax(-1, keepdim=True) for name, logits in first.items()}
        order = list(steps)
        for pos in range(prompt_len, prompt_len + new):
            turn = pos % len(order)  # rotated: each variant follows each other as often
            for name in order[turn:] + order[:turn]:  # one step of each in turn: the machine's load hits all alike
                step = steps[name]
                dist.barrier()  # untimed: no step absorbs the ranks' skew from the one before
                start = clock()
                ids[name] = step(ids[name], pos).argmax(-1, keepdim=True)
                times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items() if t} | {"max |plain - hand|": agree}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    plan = sk.Plan(mesh=sk.Mesh(tp=2), rules=LLAMA_RULES)
    result = sk.launch(measure, plan, args.batch, args.prompt, args.new, args.rounds, args.dtype)[0]
    params = sum(p.numel() for p in sk.meta_model(lambda: build_llama(tiny_llama_config(**SIZES))).parameters())
    table = Table(title=f"decode step at tp=2 (2 gloo processes), Llama {params / 1e6:.0f}M {args.dtype}, batch "
                        f"{args.batch}, prompt {args.prompt}, {args.new} steps x {args.rounds} rounds (median)")
    bases = [name for name in ("hand-written", "DTensor") if name in result]
    for column in ("decoder", "ms / step", "tokens/s", *(f"speed vs {name}" for name in bases)):
        table.add_column(column, justify="right")
    for name in VARIANTS:
        if name in result:
            seconds = result[name]
            table.add_row(name, f"{seconds * 1e3:.1f}", f"{args.batch / seconds:.2f}",
                          *(f"{result[base] / seconds:.3f}" for base in bases))
    Console(width=160).print(table)
    if result["max |plain - hand|"] is not None:
        print(f"first logits, max |plain - hand-written| = {result['max |plain - hand|']:.2e}")


if __name__ == "__main__":
    main()
