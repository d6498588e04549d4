"""The pipeline issue's example model: manual ``sk.stage`` scopes in ``__init__`` (the
PyTorch analogue of ``ipu_shard(i)``). Shared by the pipeline spec and world tests; a module
of its own so worker processes can unpickle ``build_scoped``."""

import torch
from torch import nn

import shardkit as sk


class Block(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class ScopedNet(nn.Module):
    def __init__(self):
        super().__init__()
        with sk.stage(0):
            self.embed = nn.Embedding(256, 16)
            self.block1 = Block()
        with sk.stage(1):
            self.block2 = Block()
            self.head = nn.Linear(16, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.block2(self.block1(self.embed(idx))))


def build_scoped() -> ScopedNet:
    torch.manual_seed(0)
    return ScopedNet()
