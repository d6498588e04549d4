"""TensorMemoryPeak: the most tensor memory held at once, from the profiler's allocation events."""

import pytest
import torch

from shardkit.observe.memory import TensorMemoryPeak

MIB = 2**20


def test_peak_counts_tensors_held_together_not_one_after_another():
    with TensorMemoryPeak() as sequential:
        for _ in range(3):
            block = torch.ones(MIB)  # 4 MiB, freed when rebound
            del block
    with TensorMemoryPeak() as together:
        blocks = [torch.ones(MIB) for _ in range(3)]
        del blocks
    assert 4 * MIB <= sequential.peak_bytes() < 4 * MIB + 64 * 1024
    assert 12 * MIB <= together.peak_bytes() < 12 * MIB + 64 * 1024


def test_peak_is_only_available_after_the_block():
    mem = TensorMemoryPeak()
    with pytest.raises(RuntimeError, match="after the with-block"):
        mem.peak_bytes()
