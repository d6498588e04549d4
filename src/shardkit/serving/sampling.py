"""The next token of each row of a running batch, as its request's :class:`~.requests.Sampling` says.

Greedy rows take the argmax (transformers' ``do_sample=False``); sampled rows apply, in
transformers' order, temperature, top-k and top-p (the smallest set of likeliest tokens whose
probability reaches ``top_p``, at least one kept) and draw from their own generator, seeded by the
request's ``seed``: a request's draws do not depend on what else shares its batch.

>>> logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
>>> choose(logits, [Sampling(), Sampling(temperature=1.0, top_k=1, seed=0)], [None, generator_for(Sampling(seed=0))])
[1, 0]
"""

from __future__ import annotations

import torch

from .requests import Sampling


def generator_for(sampling: Sampling) -> torch.Generator | None:
    """A request's own generator (``None`` when greedy); seeded by ``sampling.seed``, else from the OS."""
    if sampling.temperature == 0:
        return None
    generator = torch.Generator()
    if sampling.seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling.seed)
    return generator


def choose(logits: torch.Tensor, samplings: list[Sampling], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits [rows, vocab]``; ``-1`` for a row whose logits hold nan or +inf.

    The logits come to the host once: the requests' generators are CPU generators (a seeded request
    draws the same tokens on any device), and one copy is the step's only sync."""
    logits = logits.float().cpu()
    bad = (logits.isnan() | logits.isposinf()).any(dim=-1)
    tokens = logits.argmax(dim=-1)
    for i, (sampling, generator) in enumerate(zip(samplings, generators)):
        if sampling.temperature > 0 and not bad[i]:
            tokens[i] = _sample(logits[i], sampling, generator)
    return tokens.masked_fill(bad, -1).tolist()


def _sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    scores = logits / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:  # transformers' TopPLogitsWarper: drop the unlikeliest tokens summing to <= 1 - top_p
        ordered, index = scores.sort()
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
        drop[-1] = False
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, index, drop), float("-inf"))
    return int(torch.multinomial(scores.softmax(dim=-1), 1, generator=generator))


__all__ = ["choose", "generator_for"]
