"""``sk.estimate``'s activation memory against the measured peak of live tensors of one forward +
backward (torch's profiler), for each recompute mode, on the reference GPT and transformers'
Qwen2 and Llama (the builders of ``benchmarks/memory_model.py``, which prints the whole table)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import memory_model  # noqa: E402  (the benchmark's builders and measurement, not copies of them)

CASES = [("gpt", "none"), ("qwen2 eager", "selective"), ("llama", "full"), ("gpt", "full")]


@pytest.mark.parametrize(("model", "mode"), CASES)
def test_activation_estimate_is_within_ten_percent_of_the_measured_peak(model, mode):
    torch.set_num_threads(1)
    build = memory_model.MODELS[model]
    measured = memory_model.measured_peak(build, mode)
    predicted = memory_model.predicted(build, mode)
    assert abs(predicted / measured - 1) <= 0.10, (model, mode, predicted, measured)


def test_selective_recompute_saves_at_least_what_the_estimate_credits_it_with():
    # eager attention saves [heads, seq, seq] probabilities, which selective recompute frees: the case is not
    # the same as none, and the estimate never promises more saving than is measured
    build = memory_model.build_qwen2_eager
    measured = memory_model.measured_peak(build, "none") - memory_model.measured_peak(build, "selective")
    predicted = memory_model.predicted(build, "none") - memory_model.predicted(build, "selective")
    assert 0 < predicted <= measured, (predicted, measured)


def test_dropout_is_priced_as_one_fused_kernel_not_cpus_three():
    from shardkit.planner.counters import OpCounter

    booked = []
    x = torch.randn(1000)
    with OpCounter(lambda traffic, calls=1: booked.append((traffic, calls))):
        torch.nn.functional.dropout(x, 0.1, training=True)
    # a GPU's native_dropout: the input read, the output and a one-byte mask written, one kernel
    assert sum(t for t, _ in booked) == 4000 + 4000 + 1000 and sum(c for _, c in booked) == 1, booked
