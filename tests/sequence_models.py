"""Models with layers that mix positions (convolutions over time, scans, recurrences, shifts), for the
context-parallel and sequence-parallel tests. Top-level builders and modules, so they pickle into workers.

Most are the reference GPT with one mixer added before its first block (the GPT family knows its
attention, so context parallel accepts everything else); LFM2 and Jamba are transformers' own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.models.gpt import GPT, GPTConfig
from shardkit.plan import LayoutMap

DIM = 32


class CumulativeSum(nn.Module):
    """A scaled running sum of every position so far (a cumulative sum over the sequence)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cumsum(dim=1) * 0.05


class CumulativeMean(nn.Module):
    """The running mean of every position so far: the cumulative sum divided by a count made from the length."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).unsqueeze(-1)
        return x.cumsum(dim=1) / steps


class Recurrent(nn.Module):
    """A GRU over the sequence."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(DIM, DIM, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


class TimeConv(nn.Module):
    """A depthwise convolution over the sequence: ``padding`` on both sides, the first ``T`` outputs kept.
    With ``padding = kernel - 1`` it is causal (LFM2's and Mamba's short convolutions), with
    ``kernel // 2`` centred (each position reads the ones after it)."""

    def __init__(self, kernel: int = 3, padding: int = 2, dilation: int = 1, depthwise: bool = True):
        super().__init__()
        self.conv = nn.Conv1d(DIM, DIM, kernel, padding=padding, dilation=dilation, groups=DIM if depthwise else 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)


class TimeConv2d(nn.Module):
    """A 2-D convolution whose first spatial dim is the sequence (a 3 x 1 kernel, centred)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, (3, 1), padding=(1, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.unsqueeze(1)).squeeze(1)


class TokenShift(nn.Module):
    """RWKV's token shift: each position gets the one before it (padding on the sequence dim)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 0, 1, -1))


class Rolled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.roll(x, 1, dims=1)


class Spectral(nn.Module):
    """FNet's mixing: an FFT over the sequence."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fft(x.float(), dim=1).real.to(x.dtype)


class Pooled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool1d(x.transpose(1, 2), 3, stride=1, padding=1).transpose(1, 2)


class TopPositions(nn.Module):
    """Mixture-of-depths style routing: only the top half of positions by score (a top-k over the sequence)."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = self.score(x).squeeze(-1).topk(x.shape[1] // 2, dim=1).indices
        return torch.zeros_like(x).scatter(1, top.unsqueeze(-1).expand(-1, -1, x.shape[-1]),
                                           x.gather(1, top.unsqueeze(-1).expand(-1, -1, x.shape[-1])))


class Loop(nn.Module):
    """A recurrence written as a Python loop over positions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state, outs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            state = 0.5 * state + x[:, t]
            outs.append(state)
        return torch.stack(outs, dim=1)


class MeanPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1, keepdim=True).expand_as(x)


class SlicedTable(nn.Module):
    """A learned table of positions sliced by the sequence's length (``table[:T]``), not by the positions given."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(32, DIM) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[:x.shape[1]]


class WithMixer(nn.Module):
    """``block(x + mixer(x))``: a GPT block with a mixer in front."""

    def __init__(self, block: nn.Module, mixer: nn.Module):
        super().__init__()
        self.mixer = mixer
        self.block = block

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        return self.block(x + self.mixer(x), cache)


MIXERS = {"cumsum": CumulativeSum, "cummean": CumulativeMean, "gru": Recurrent, "centred_conv": lambda: TimeConv(3, 1),
          "conv2d": TimeConv2d, "token_shift": TokenShift, "roll": Rolled,
          "fft": Spectral, "pool": Pooled, "topk": TopPositions, "loop": Loop, "mean": MeanPool, "sliced_table": SlicedTable}


#: GPT_RULES for a GPT whose first block is wrapped in :class:`WithMixer` (``layers.0.block.attn...``).
MIXER_GPT_RULES = LayoutMap([
    (r"layers\.\d+\.(block\.)?attn\.[qkv]_proj\.weight", ("tp", None)),
    (r"layers\.\d+\.(block\.)?attn\.[qkv]_proj\.bias", ("tp",)),
    (r"layers\.\d+\.(block\.)?mlp\.up_proj\.weight", ("tp", None)),
    (r"layers\.\d+\.(block\.)?mlp\.up_proj\.bias", ("tp",)),
    (r"layers\.\d+\.(block\.)?(attn\.o_proj|mlp\.down_proj)\.weight", (None, "tp")),
    (r"lm_head\.weight", ("tp", None)),
    (r".*", None),
])


def build_gpt_with(mixer: str = "cumsum", layers: int = 2) -> GPT:
    """The reference GPT (dim 32, 2 heads, 32 positions) with ``MIXERS[mixer]`` before its first block."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=layers, dim=DIM, heads=2, seq_len=32))
    factory = MIXERS.get(mixer) or CAUSAL[mixer]
    model.layers[0] = WithMixer(model.layers[0], factory())
    return model


#: Causal convolutions context parallel makes whole (the previous ``dilation x (kernel - 1)`` positions).
CAUSAL = {"causal_conv": lambda: TimeConv(3, 2), "causal_conv_dilated": lambda: TimeConv(3, 4, dilation=2),
          "causal_conv_dense": lambda: TimeConv(4, 3, depthwise=False)}


def build_gpt_cumsum() -> GPT:
    return build_gpt_with("cumsum")


def build_gpt_token_shift() -> GPT:
    return build_gpt_with("token_shift")


def build_gpt_causal_conv() -> GPT:
    return build_gpt_with("causal_conv")


def build_gpt_causal_conv_dilated() -> GPT:
    return build_gpt_with("causal_conv_dilated")


def build_gpt_causal_conv_dense() -> GPT:
    return build_gpt_with("causal_conv_dense")


def lfm2_config(**overrides):
    """LFM2: short causal convolutions (kernel 3) in layers 0 and 2, attention in 1 and 3."""
    from transformers import Lfm2Config

    sizes = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=256, max_position_embeddings=64,
                 layer_types=["conv", "full_attention", "conv", "full_attention"], attn_implementation="sdpa")
    return Lfm2Config(**{**sizes, **overrides})


def build_lfm2():
    from transformers import Lfm2ForCausalLM

    torch.manual_seed(0)
    return Lfm2ForCausalLM(lfm2_config())


def build_jamba():
    """Jamba: a Mamba layer (causal convolution and a selective scan) then attention with experts."""
    from transformers import JambaConfig, JambaForCausalLM

    torch.manual_seed(0)
    return JambaForCausalLM(JambaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=256, max_position_embeddings=64, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_expand=2, mamba_dt_rank=8,
        attn_implementation="sdpa"))


class SplitAtTheEnd(nn.Module):
    """A sequence split where its second piece is empty (``tensor_split`` at the length, as transformers
    5.25's Mamba scan splits off the positions it would step one by one), the pieces joined again."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        whole, rest = torch.tensor_split(x, [x.shape[1]], dim=1)
        return torch.cat([2 * whole, rest], dim=1)


def build_gpt_split_at_the_end() -> GPT:
    model = build_gpt_with("cumsum")
    model.layers[0].mixer = SplitAtTheEnd()
    return model
