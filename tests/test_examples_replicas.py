"""The replica-group examples run on the shared 8-process world and match one-process simulations."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

# The examples' job functions are pickled by module name; worlds start after collection, so their
# processes inherit this path and can import the example modules.
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

TIGHT = 1e-10  # float64 everywhere: only summation order differs from the simulation


def _example(name: str):
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def world8(world):
    return world(8)


def test_ensemble_members_are_independent_and_their_average_matches(world8):
    summary = _example("ensemble").main(world=world8)
    assert summary["max_weight_diff"] < TIGHT
    assert summary["max_prediction_diff"] < TIGHT
    assert summary["max_ensemble_diff"] < TIGHT
    assert summary["min_distance_between_members"] > 1e-3  # eight different models, not one
    assert all(last < first for first, last in summary["first_and_last_loss"])
    assert summary["ensemble_test_mse"] < np.mean(summary["member_test_mse"])


def test_federated_averaging_matches_single_process_simulation(world8):
    summary = _example("federated_averaging").main(world=world8)
    assert summary["max_weight_diff"] < TIGHT
    assert summary["clients_equal_after_averaging"]
    assert min(summary["spread_before_averaging"]) > 1e-4  # clients drift apart between averagings
    for losses in summary["losses"]:
        assert losses[-1] < losses[0]


def test_codistillation_matches_two_models_trained_together(world8):
    summary = _example("codistillation").main(world=world8)
    assert summary["max_weight_diff"] < TIGHT
    for losses in summary["task_losses"]:
        assert losses[-1] < 0.7 * losses[0]
    assert min(summary["accuracy"]) > 0.6


def test_tensor_parallel_from_grouped_variables_matches_one_process(world8):
    summary = _example("tp_grouped_dp").main(world=world8)
    assert summary["max_weight_diff"] < TIGHT
    assert summary["max_loss_diff"] < TIGHT
    first, last = summary["first_and_last_loss"]
    assert last < 0.7 * first
