"""Loss parity: every strategy is the same computation, so the same seed and global batch give the same losses."""

import numpy as np
import pytest

from conftest import PARITY_STRATEGIES as STRATEGIES, run_steps


@pytest.fixture(scope="module")
def trajectories():
    from conftest import MICRO

    overrides = MICRO + ["model.dropout=0.1"]  # dropout too: its masks must not depend on the sharding
    return {name: run_steps(overrides, degrees)[0] for name, degrees in STRATEGIES.items()}


def test_loss_decreases(trajectories):
    losses = trajectories["1 device"]
    assert len(losses) == 20
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "1 device"])
def test_strategy_matches_single_device(trajectories, name):
    ref, got = trajectories["1 device"], trajectories[name]
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    np.testing.assert_allclose(got[19], ref[19], rtol=1e-3)


def test_same_config_twice_is_bit_identical(trajectories):
    from conftest import MICRO

    again = run_steps(MICRO + ["model.dropout=0.1"], STRATEGIES["DP 2 x FSDP 2 x TP 2"])[0]
    assert again == trajectories["DP 2 x FSDP 2 x TP 2"]  # exact float equality, every step
