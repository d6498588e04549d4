"""The decode step of a tensor-parallel model on plain tensors: each rank's local shards, one ``all_reduce``
per row-parallel layer, no DTensor dispatch.

Under DTensor every operator of a step goes through sharding propagation and redistribution
checks; at decode (one token per sequence) that overhead is most of the step. As gpt-fast and
vLLM do, :class:`PlainDecoder` reads each parameter's local shard once (``DTensor.to_local``; the
split — column-parallel ``Shard(0)``, row-parallel ``Shard(1)``, vocabulary-parallel embedding, or
whole — is read from the parameter's placements, so it is what the plan made) and runs the
model's decode forward itself: q/k/v and gate/up column-parallel, o/down row-parallel followed by
one ``all_reduce`` over ``tp``, the output head column-parallel and its logits all-gathered.
Training keeps DTensor; this reads the same storage, so the two paths always hold the same weights.

Speed without a second copy of the weights: the q/k/v (and gate/up) shards are concatenated once
into one tensor and the parameters' local tensors are made views of it (their values unchanged),
so one matmul does the three projections; at the few rows of a decode step each product is computed
as ``h @ weight.T`` (``F.linear``) or as ``(weight @ h.T).T``, whichever this rank timed faster at that many
rows (:meth:`PlainDecoder._product`); the KV cache is allocated once
(``[layers, slots, local kv heads, max_len, head_dim]``) and written in place; rotary tables are
computed once for every position.

Families: the reference GPT (dense) and transformers' Llama and Qwen2 (full attention, rotary
positions, SwiGLU). :func:`plain_problems` says why another model cannot decode this way.
Slots are cache rows: a step runs rows ``first_slot .. first_slot + batch`` each at its own position,
so sequences of different lengths share a batch (a mask hides each row's unused positions), and
:meth:`PlainDecoder.prefill` fills several slots with prompts of different lengths in one forward.

>>> from shardkit.models.gpt import build_tiny_gpt
>>> decoder = PlainDecoder(build_tiny_gpt().eval(), slots=2, max_len=16)
>>> decoder.step(torch.tensor([[1, 2, 3], [4, 5, 6]]), 0).shape
torch.Size([2, 256])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..plan import UsageError
from .devices import clock

#: transformers model types whose decoder layers :class:`PlainDecoder` runs (Llama's layer, Qwen2's with q/k/v biases).
HF_TYPES = ("llama", "qwen2")
WHOLE, COLWISE, ROWWISE = "whole", "colwise", "rowwise"
#: Rows (batch x new positions) up to which a product's two forms are timed; more rows: ``F.linear``.
TIMED_ROWS = 16


def plain_problems(model: nn.Module) -> list[str]:
    """Why :class:`PlainDecoder` cannot run ``model`` (empty: it can).

    >>> from shardkit.models.gpt import build_tiny_gpt_moe
    >>> plain_problems(build_tiny_gpt_moe())[0][:60]
    'plain decode runs the reference GPT with dense MLPs and tran'
    """
    from ..models.gpt import GPT

    if isinstance(model, GPT):
        return [] if not model.config.experts else [_families(type(model).__name__ + " with experts")]
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in HF_TYPES or not hasattr(getattr(model, "model", None), "layers"):
        return [_families(type(model).__name__)]
    windows = [t for t in (getattr(config, "layer_types", None) or ()) if t != "full_attention"]
    if windows or getattr(config, "use_sliding_window", False):
        return [f"plain decode runs full attention only, but {type(model).__name__} has sliding-window layers"]
    return []


def _families(what: str) -> str:
    return (f"plain decode runs the reference GPT with dense MLPs and transformers' {', '.join(HF_TYPES)} models, "
            f"not {what}")


@dataclass
class _Linear:
    """One projection's local weight and bias, and how it is split over ``tp``."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    split: str


class PlainDecoder:
    """``model`` (sharded over ``tp`` by ``sk.shard``, or whole) as plain tensors with its own KV cache
    of ``slots`` rows of ``max_len`` positions; :meth:`step` returns the last position's logits.

    ``model`` must be in eval mode with no gradients needed (generation); every rank of ``tp``
    builds one and calls :meth:`step` with the same arguments. ``model`` may be one pipeline stage of
    ``sk.shard`` (its layers only; :class:`~shardkit.runtime.plain_pipeline.PlainPipeline` runs the stages).
    """

    def __init__(self, model: nn.Module, slots: int, max_len: int):
        problems = plain_problems(model)
        if problems:
            raise UsageError(problems[0])
        from ..models.gpt import GPT

        self.gpt = isinstance(model, GPT)
        self.group, self.tp_rank, self.tp = None, 0, 1
        for p in model.parameters():
            if isinstance(p, DTensor):
                self._group_of(p)
                break
        body = model if self.gpt else model.model
        self.layers = [self._layer(layer) for layer in body.layers]
        if not self.layers:
            raise UsageError("plain decode runs a model, or a pipeline stage, of at least one decoder layer")
        first = self.layers[0]
        self.head_dim = model.config.dim // model.config.heads if self.gpt else \
            getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
        self.q_size, self.kv_size = first["q"], first["kv"]
        self.heads, self.kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        self.scale = None if self.gpt else self.head_dim ** -0.5  # each family's own: SDPA's default, transformers' scaling
        # a pipeline stage (sk.shard prunes the others' modules to None) has the embedding on the first stage,
        # the final norm and the head on the last: None elsewhere (step then takes or returns hidden states)
        embed, norm = (model.embed, model.norm_f) if self.gpt else (body.embed_tokens, body.norm)
        self.embed, self.vocab_start = (None, None) if embed is None else self._embedding(embed)
        self.head = None if model.lm_head is None else self._linear(model.lm_head)
        if (norm is None) != (self.head is None):
            raise UsageError("plain decode needs the final norm and the output head on one pipeline stage")
        self.vocab = model.config.vocab if self.gpt else model.config.vocab_size
        anchor = first["qkv"].weight.new_zeros(())  # the dtype and device of the cache and the rotary tables
        if self.gpt:
            self.pos_embed = None if embed is None else self._local(model.pos_embed.weight)[0]
            self.norm = None if norm is None else (self._local(norm.weight)[0], self._local(norm.bias)[0], norm.eps)
        else:
            self.norm = None if norm is None else (self._local(norm.weight)[0], None, norm.variance_epsilon)
            cos, sin = body.rotary_emb(anchor, torch.arange(max_len, device=anchor.device)[None])
            self.cos, self.sin = cos[0], sin[0]
        self.slots, self.max_len = slots, max_len
        shape = (len(self.layers), slots, self.kv_heads, max_len, self.head_dim)
        self.keys = torch.zeros(shape, dtype=anchor.dtype, device=anchor.device)
        self.values = torch.zeros_like(self.keys)
        self._gathered = None
        self._transposed: dict[int, bool] = {}  # rows -> whether (weight @ h.T).T is faster here

    # -- reading the shards ----------------------------------------------------------------------
    def _group_of(self, p: DTensor) -> None:
        mesh = p.device_mesh
        if mesh.ndim != 1:
            raise UsageError(f"plain decode splits over one mesh axis ('tp'), but the model's parameters lie on a "
                             f"{mesh.ndim}-D mesh {mesh.mesh_dim_names}; shard it with Mesh(tp=N) only")
        self.group = mesh.get_group()
        self.tp_rank, self.tp = dist.get_rank(self.group), mesh.size()

    def _local(self, p: torch.Tensor) -> tuple[torch.Tensor, str]:
        """The tensor this rank holds of ``p`` (the DTensor's own local tensor, not a copy) and its split."""
        if not isinstance(p, DTensor):
            return p, WHOLE  # the parameter itself: fusing below re-points its data
        placement = p.placements[0]
        if isinstance(placement, Replicate):
            return p._local_tensor, WHOLE  # the storage itself: fusing below re-points it
        if isinstance(placement, Shard) and placement.dim in (0, p.dim() - 1):
            return p._local_tensor, COLWISE if placement.dim == 0 else ROWWISE
        raise UsageError(f"plain decode reads whole, row- or column-split weights, but a parameter of shape "
                         f"{list(p.shape)} is placed {p.placements}")

    def _linear(self, module: nn.Module) -> _Linear:
        weight, split = self._local(module.weight)
        if weight.dim() == 1 or split not in (WHOLE, COLWISE, ROWWISE):
            raise UsageError(f"plain decode: {type(module).__name__}'s weight is split as {split}")
        bias = None if module.bias is None else self._local(module.bias)[0]
        return _Linear(weight, bias, split)

    def _fused(self, modules: list[nn.Module]) -> _Linear:
        """One projection for ``modules`` (each split alike): their weights concatenated once, each
        parameter's local tensor then a view of the result, so no second copy is kept."""
        parts = [self._linear(m) for m in modules]
        splits = {p.split for p in parts}
        if splits - {WHOLE, COLWISE} or len(splits) > 1:
            raise UsageError(f"plain decode needs {', '.join(type(m).__name__ for m in modules)} projections "
                             f"split alike over tp (column-parallel or whole), got {[p.split for p in parts]}")
        weight = _share([p.weight for p in parts])
        biases = [p.bias for p in parts]
        bias = None if all(b is None for b in biases) else _share(
            [b if b is not None else p.weight.new_zeros(p.weight.shape[0]) for b, p in zip(biases, parts)])
        return _Linear(weight, bias, parts[0].split)

    def _layer(self, layer: nn.Module) -> dict:
        if self.gpt:
            attn, mlp = layer.attn, layer.mlp
            norms = [(self._local(n.weight)[0], self._local(n.bias)[0], n.eps) for n in (layer.norm1, layer.norm2)]
            up = self._fused([mlp.up_proj])
        else:
            attn, mlp = layer.self_attn, layer.mlp
            norms = [(self._local(n.weight)[0], None, n.variance_epsilon)
                     for n in (layer.input_layernorm, layer.post_attention_layernorm)]
            up = self._fused([mlp.gate_proj, mlp.up_proj])
        qkv = self._fused([attn.q_proj, attn.k_proj, attn.v_proj])
        q = self._local(attn.q_proj.weight)[0].shape[0]
        kv = self._local(attn.k_proj.weight)[0].shape[0]
        out, down = self._linear(attn.o_proj), self._linear(mlp.down_proj)
        for name, linear in (("o", out), ("down", down)):
            if linear.split != (ROWWISE if qkv.split == COLWISE else WHOLE):
                raise UsageError(f"plain decode: with q/k/v {qkv.split}, the {name} projection must be "
                                 f"{'row-parallel' if qkv.split == COLWISE else 'whole'}, got {linear.split}")
        return {"norms": norms, "qkv": qkv, "q": q, "kv": kv, "out": out, "up": up, "down": down}

    def _embedding(self, module: nn.Embedding) -> tuple[torch.Tensor, int | None]:
        weight, split = self._local(module.weight)
        if split == WHOLE:
            return weight, None
        if split != COLWISE:
            raise UsageError("plain decode: the token embedding must be whole or split over its vocabulary (rows)")
        return weight, self.tp_rank * math.ceil(module.weight.shape[0] / self.tp)

    # -- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, ids: torch.Tensor, past: int | torch.Tensor, first_slot: int = 0,
             kv_len: int | None = None) -> torch.Tensor:
        """Run ``ids [batch, new]`` in slots ``first_slot ..``, after ``past`` cached positions (an int:
        every row alike; a ``[batch]`` tensor: each row its own, ``kv_len`` then ``max(past) + new`` if the caller
        knows it);
        returns the last position's logits ``[batch, vocab]`` on every rank.

        A pipeline stage without the embedding takes hidden states ``[batch, new, hidden]`` as ``ids``; one
        without the head returns its hidden states ``[batch, new, hidden]`` (:mod:`.plain_pipeline`)."""
        return self.forward(ids, past, first_slot, kv_len)

    @torch.no_grad()
    def prefill(self, prompts: list[Sequence[int]], first_slot: int = 0) -> torch.Tensor:
        """Prompts of any lengths into slots ``first_slot ..`` in one forward; returns each prompt's last position's
        logits ``[len(prompts), vocab]``.

        The prompts are right-padded to the longest: under the causal mask a real position never attends a
        later one, so no row sees its padding; the padding's keys and values lie beyond the row's length,
        where every later step masks them (per-row positions) until they are overwritten.

        >>> from shardkit.models.gpt import build_tiny_gpt
        >>> decoder = PlainDecoder(build_tiny_gpt().eval(), slots=2, max_len=16)
        >>> decoder.prefill([[1, 2, 3], [4, 5]]).shape
        torch.Size([2, 256])
        """
        ids, last = self.padded(prompts, first_slot)
        return self.forward(ids, 0, first_slot, None, last)

    def padded(self, prompts: list[Sequence[int]], first_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``prompts`` right-padded to the longest, ``[len(prompts), longest]`` on the cache's device, and each
        one's last position; refused where they do not fit the slots from ``first_slot``."""
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1 or max(lengths) > self.max_len or first_slot + len(prompts) > self.slots:
            raise UsageError(f"prefill: {len(prompts)} prompts of 1 to {self.max_len} tokens from slot {first_slot} "
                             f"of {self.slots}, got lengths {lengths}")
        ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = torch.as_tensor(prompt)
        device = self.keys.device
        return ids.to(device), torch.tensor(lengths, device=device) - 1

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, past: int | torch.Tensor, first_slot: int = 0, kv_len: int | None = None,
                last: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`step`'s forward; the logits (or, on a stage without the head, the hidden states of every new
        position) of position ``last[row]`` of each row (``None``: the last)."""
        batch, new = ids.shape[:2]
        rows = slice(first_slot, first_slot + batch)
        device = ids.device
        written = None  # per-row positions: the rows of the flat ``[slots * kv heads * max_len, head_dim]`` cache
        if isinstance(past, int):
            kv_len = past + new
            positions = torch.arange(past, kv_len, device=device)
            mask, causal = (None, new > 1) if past == 0 or new == 1 else \
                (torch.arange(kv_len, device=device) <= positions[:, None], False)
        else:
            kv_len = int(past.max()) + new if kv_len is None else kv_len
            positions = past[:, None] + torch.arange(new, device=device)
            visible = torch.arange(kv_len, device=device) <= positions[:, None, :, None]  # [batch, 1, new, kv_len]
            # additive, once a step (not converted by every layer's attention); the same values as the boolean mask
            mask = torch.zeros(visible.shape, dtype=self.keys.dtype, device=device).masked_fill_(~visible, -math.inf)
            causal = False
            heads = torch.arange(self.kv_heads, device=device)[None, :, None]
            written = (((first_slot + torch.arange(batch, device=device))[:, None, None] * self.kv_heads + heads)
                       * self.max_len + positions[:, None, :]).flatten()  # [batch, kv heads, new], as k's rows
        x = self._embed(ids, positions) if self.embed is not None else ids
        if self.gpt:
            rope = None
        else:
            cos, sin = self.cos[positions], self.sin[positions]
            rope = (cos.unsqueeze(-3), sin.unsqueeze(-3))  # over heads: [.., 1, new, head_dim]
        q_size, kv_size, head_dim = self.q_size, self.kv_size, self.head_dim
        gqa = self.heads != self.kv_heads
        for i, layer in enumerate(self.layers):
            h = self._norm(x, *layer["norms"][0])
            qkv = self._product(h, layer["qkv"].weight, layer["qkv"].bias)
            q = qkv[..., :q_size].view(batch, new, -1, head_dim).transpose(1, 2)
            k = qkv[..., q_size:q_size + kv_size].view(batch, new, -1, head_dim).transpose(1, 2)
            v = qkv[..., q_size + kv_size:].view(batch, new, -1, head_dim).transpose(1, 2)
            if rope is not None:
                q = q * rope[0] + _rotate_half(q) * rope[1]
                k = k * rope[0] + _rotate_half(k) * rope[1]
            keys, values = self.keys[i], self.values[i]
            if written is None:
                keys[rows, :, past:kv_len] = k
                values[rows, :, past:kv_len] = v
            else:  # one row copy per (row, head, position), at an index computed once a step
                keys.view(-1, head_dim).index_copy_(0, written, k.reshape(-1, head_dim))
                values.view(-1, head_dim).index_copy_(0, written, v.reshape(-1, head_dim))
            a = F.scaled_dot_product_attention(q, keys[rows, :, :kv_len], values[rows, :, :kv_len], attn_mask=mask,
                                               is_causal=causal, scale=self.scale, enable_gqa=gqa)
            x = x + self._project(a.transpose(1, 2).reshape(batch, new, -1), layer["out"])
            h = self._norm(x, *layer["norms"][1])
            up = self._product(h, layer["up"].weight, layer["up"].bias)
            if self.gpt:
                h = F.gelu(up)
            else:
                half = up.shape[-1] // 2
                h = F.silu(up[..., :half]) * up[..., half:]
            x = x + self._project(h, layer["down"])
        if self.head is None:  # a pipeline stage before the last: every new position's hidden states
            return x
        x = x[:, -1] if last is None else x[torch.arange(batch, device=device), last]
        x = self._norm(x, *self.norm)
        return self._logits(self._product(x, self.head.weight))

    def _product(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``h @ weight.T (+ bias)``: as ``F.linear``, or as ``(weight @ h.T).T`` where this rank timed that faster
        at this many rows.

        Why not always ``F.linear``: at the 2-6 rows of a batched decode step, MKL's float32 GEMM on the
        machine of ``docs/benchmarks.md`` (an AMD EPYC) computes the second form 1.2-2.7x faster (the same at
        1 row, slower from 8 rows and in bfloat16), and which one wins depends on the BLAS and the CPU; so
        each row count up to :data:`TIMED_ROWS` is timed once, on the CPU, and the faster form kept.
        """
        rows = h.numel() // h.shape[-1]
        if not self._transposed_at(rows):
            return F.linear(h, weight, bias)
        flat = h.reshape(rows, -1).t()
        out = torch.mm(weight, flat) if bias is None else torch.addmm(bias[:, None], weight, flat)
        return out.t().contiguous().view(*h.shape[:-1], -1)

    def _transposed_at(self, rows: int) -> bool:
        choice = self._transposed.get(rows)
        if choice is None:
            choice = 1 < rows <= TIMED_ROWS and self.keys.device.type == "cpu" and self._faster_transposed(rows)
            self._transposed[rows] = choice
        return choice

    def _faster_transposed(self, rows: int) -> bool:
        """Whether ``(weight @ h.T).T`` beats ``F.linear`` by a tenth at ``rows`` rows on the first layer's
        products (q/k/v, up, down): the best of five interleaved runs of each."""
        weights = [self.layers[0][name].weight for name in ("qkv", "up", "down")]
        inputs = [torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
        best = {True: math.inf, False: math.inf}
        for _ in range(5):
            for transposed in (False, True):
                start = clock()
                for w, h in zip(weights, inputs):
                    torch.mm(w, h.t()).t().contiguous() if transposed else F.linear(h, w)
                best[transposed] = min(best[transposed], clock() - start)
        return best[True] < 0.9 * best[False]

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.vocab_start is None:
            x = F.embedding(ids, self.embed)
        else:  # vocabulary-parallel: each rank looks up its own rows, the others' ids give zeros, summed
            local = ids - self.vocab_start
            outside = (local < 0) | (local >= self.embed.shape[0])
            x = F.embedding(local.masked_fill(outside, 0), self.embed).masked_fill_(outside[..., None], 0.0)
            dist.all_reduce(x, group=self.group)
        return x + self.pos_embed[positions] if self.gpt else x

    def _project(self, h: torch.Tensor, linear: _Linear) -> torch.Tensor:
        """A row-parallel (or whole) projection: partial sums all-reduced before the bias."""
        out = self._product(h, linear.weight)
        if linear.split == ROWWISE:
            dist.all_reduce(out, group=self.group)
        return out if linear.bias is None else out + linear.bias

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
        if self.gpt:
            return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
        h = x.float()  # transformers' RMSNorm, step for step (the same rounding as its generate)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def _logits(self, local: torch.Tensor) -> torch.Tensor:
        if self.head.split != COLWISE or self.tp == 1:
            return local
        chunk = math.ceil(self.vocab / self.tp)  # torch.chunk's split: the last ranks may hold fewer rows
        if local.shape[-1] < chunk:
            local = F.pad(local, (0, chunk - local.shape[-1]))
        if self._gathered is None or self._gathered[0].shape != local.shape:
            self._gathered = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(self._gathered, local.contiguous(), group=self.group)
        return torch.cat(self._gathered, dim=-1)[:, :self.vocab]

    def move(self, source: int, target: int) -> None:
        """Copy slot ``source``'s cached keys and values into slot ``target`` (compacting a batch)."""
        self.keys[:, target] = self.keys[:, source]
        self.values[:, target] = self.values[:, source]

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's KV cache (every slot, every position)."""
        return self.keys.nbytes + self.values.nbytes


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _share(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The concatenation of ``tensors`` along dim 0, each of them re-pointed to its slice of it (same values)."""
    if len(tensors) == 1:
        return tensors[0]
    first, rows = tensors[0], sum(t.shape[0] for t in tensors)
    if _adjacent(tensors):  # fused by an earlier decoder: the same storage, read as one tensor again
        return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
    fused = torch.cat(tensors, dim=0)
    start = 0
    for t in tensors:
        t.data = fused[start:start + t.shape[0]]
        start += t.shape[0]
    return fused


def _adjacent(tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` are contiguous and lie one after the other in one storage."""
    storage, offset = tensors[0].untyped_storage().data_ptr(), tensors[0].storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return False
        offset += t.numel()
    return True


__all__ = ["PlainDecoder", "plain_problems"]
