"""The start-up calibration on a busy machine: a forward's time is its cost plus interference that only adds
(another process on the core, a descheduled thread), so the shape of the cost model is taken from each block
length's fastest time (engine/costs.py BatchCostModel.calibrated)."""
from __future__ import annotations

import random

import pytest

from leaplm.engine.costs import BatchCostModel

SHAPE = {1: 1.0, 2: 1.3, 3: 1.4, 4: 1.5, 5: 1.6, 6: 1.7}       # a CPU block of T tokens vs one token


def busy_rounds(seed: int, n_rounds: int = 8, quiet_per_t: int = 1) -> list[dict[int, float]]:
    """Rounds of {T: seconds} where most forwards are slowed 1.5x to 10x and each T meets a quiet moment in
    `quiet_per_t` random rounds (not the same round for every T)."""
    rng = random.Random(seed)
    quiet = {T: set(rng.sample(range(n_rounds), quiet_per_t)) for T in SHAPE}
    return [{T: 0.01 * s * (1.0 if j in quiet[T] else rng.uniform(1.5, 10.0)) for T, s in SHAPE.items()}
            for j in range(n_rounds)]


@pytest.mark.parametrize("seed", range(5))
def test_the_shape_is_the_cost_without_interference(seed):
    c = BatchCostModel()
    c.calibrated(1, busy_rounds(seed))
    for T, s in SHAPE.items():
        assert c.cost(1, T) / c.cost(1, 1) == pytest.approx(s, rel=1e-9)


def test_the_level_is_the_median_time_of_one_token_load_included():
    rounds = busy_rounds(0)
    c = BatchCostModel()
    c.calibrated(1, rounds)
    times = sorted(r[1] for r in rounds)
    assert times[0] < c.level[1] and c.level[1] == pytest.approx((times[3] + times[4]) / 2)


def test_a_load_that_changes_between_rounds_cancels():
    """Every forward of the first rounds is 3x slower (another process ran), the last ones quiet."""
    c = BatchCostModel()
    c.calibrated(1, [{T: 0.01 * s * f for T, s in SHAPE.items()} for f in (3.0, 3.0, 1.0, 1.0)])
    assert [c.cost(1, T) / c.cost(1, 1) for T in SHAPE] == pytest.approx(list(SHAPE.values()))
