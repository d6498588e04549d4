"""Is ``sk.estimate``'s activation memory right? Its prediction against the measured peak, one process.

For the reference GPT and two transformers families (Qwen2, also with eager attention, which
saves the attention probabilities; Llama: small configs built here, no hub), batch 4 x 64 tokens, float32 on CPU, each of ``recompute`` none, selective and full
(``sk.recompute``, what ``sk.shard`` applies for the plan's ``recompute``):

- **measured**: the peak bytes of live tensors allocated during one forward + backward
  (torch's profiler, ``TensorMemoryPeak``: CPU's analogue of ``torch.cuda.max_memory_allocated``),
  after a warm-up step that left every gradient allocated (so the peak is what the step adds
  on top of parameters and gradients: the activations, the loss's transients and the
  backward's own);
- **predicted**: what ``sk.estimate``'s memory model for ``Plan(recompute=mode)`` adds to the state
  (parameters, gradients, optimizer) with every gradient allocated ahead, as measured: the step's peak,
  the largest of its phases (``shardkit.planner.memory.step_peak`` of ``step_phases``: the tensors saved
  for the backward, the loss's and the head's gradients, a block's backward).

The baseline is the measurement, in the same run; the ratio predicted / measured is printed.

    python benchmarks/memory_model.py [--batch 4] [--seq 64]
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

import shardkit as sk
from shardkit.observe.memory import TensorMemoryPeak
from shardkit.plan.text import format_bytes

MODES = ("none", "selective", "full")
BATCH, SEQ = 4, 64


def build_gpt() -> torch.nn.Module:
    """shardkit's reference GPT: 4 layers, dim 128, 4 heads, vocabulary 256."""
    from shardkit.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=256, layers=4, dim=128, heads=4, seq_len=128))


def build_qwen2(attention: str = "sdpa") -> torch.nn.Module:
    """A small Qwen2 (biases on q, k, v; grouped-query attention), 4 layers, hidden 128."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
        vocab_size=256, max_position_embeddings=128, attn_implementation=attention))


def build_qwen2_eager() -> torch.nn.Module:
    """:func:`build_qwen2` with transformers' eager attention, which saves its ``[heads, seq, seq]``
    probabilities (what selective recompute frees)."""
    return build_qwen2("eager")


def build_llama() -> torch.nn.Module:
    """A small Llama (gated MLP, grouped-query attention, untied head), 4 layers, hidden 128."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
        vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False, attn_implementation="sdpa"))


MODELS = {"gpt": build_gpt, "qwen2": build_qwen2, "qwen2 eager": build_qwen2_eager, "llama": build_llama}


def _loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    out = model(inputs)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def measured_peak(build, mode: str, batch: int = BATCH, seq: int = SEQ) -> int:
    """Peak bytes of tensors one forward + backward of ``build()`` under recompute ``mode`` adds to
    its parameters and (already allocated) gradients."""
    model = sk.recompute(build(), mode)
    vocab = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).num_embeddings
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    _loss(model, inputs, targets).backward()  # warm-up: every gradient allocated, accumulated into from now on
    with TensorMemoryPeak() as peak:
        _loss(model, inputs, targets).backward()
    return peak.peak_bytes()


def predicted(build, mode: str, batch: int = BATCH, seq: int = SEQ) -> int:
    """``sk.estimate``'s bytes of what a forward + backward holds beyond parameters and gradients (its
    memory model's largest phase, ``step_peak``: its total counts no gradient before the backward)."""
    from shardkit.planner.costs import Costs, Setting
    from shardkit.planner.memory import step_peak

    with torch.device("meta"):
        model = build()
    plan = sk.Plan(sk.Mesh(dp=1), recompute=mode).resolved(1)
    return step_peak(Costs.of(model, seq, 1, None, rules=plan.rules), Setting.of(plan), batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--seq", type=int, default=SEQ)
    args = parser.parse_args()
    torch.set_num_threads(1)
    console = Console(width=160)
    table = Table("model", "recompute", "measured peak", "predicted", "predicted / measured", "within 10%",
                  title=f"activation memory of one forward + backward, batch {args.batch} x {args.seq}, float32, CPU")
    ratios = []
    for name, build in MODELS.items():
        for mode in MODES:
            peak, guess = measured_peak(build, mode, args.batch, args.seq), predicted(build, mode, args.batch, args.seq)
            ratios.append(guess / peak)
            table.add_row(name, mode, format_bytes(peak, digits=2), format_bytes(guess, digits=2),
                          f"{guess / peak:.2f}", "yes" if abs(guess / peak - 1) <= 0.10 else "no")
    console.print(table)
    console.print(f"predicted / measured: {min(ratios):.2f} to {max(ratios):.2f}; "
                  f"{sum(abs(r - 1) <= 0.10 for r in ratios)} of {len(ratios)} within 10%")


if __name__ == "__main__":
    main()
