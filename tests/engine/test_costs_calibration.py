"""The start-up calibration on a busy machine: a forward's time is its cost plus interference that only adds
(another process on the core, a descheduled thread), so the shape of the cost model is taken from each block
length's fastest time (engine/kpolicy/costs.py BatchCostModel.calibrated)."""
from __future__ import annotations

import random

import pytest

from leaplm.engine.kpolicy.costs import BatchCostModel

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


class _Cache:
    def __init__(self):
        self.lengths = [0]


class _SleepyModel:
    """A one-token forward that sleeps `at_threads` seconds at torch's thread count and `at_one` at one thread."""
    device = "cpu"
    quantized: dict = {}             # not quantized: timed whole (calibrate.layer_subset)

    def __init__(self, threads: int, at_threads: float, at_one: float):
        self.threads, self.at_threads, self.at_one = threads, at_threads, at_one

    def new_cache(self, rows, max_len):
        return _Cache()

    def __call__(self, x, cache):
        import time

        import torch
        time.sleep(self.at_one if torch.get_num_threads() == 1 else self.at_threads)


class _Engine:
    backend = "torch"
    max_model_len = 128

    def __init__(self, model):
        self.model = model


@pytest.mark.parametrize("at_threads, contended", [(0.02, True), (0.004, False)])
def test_the_thread_check_warns_when_more_threads_run_slower(at_threads, contended, caplog):
    import torch

    from leaplm.engine.startup_checks import check_threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with caplog.at_level("WARNING", logger="leaplm.engine.startup_checks"):
            check = check_threads(_Engine(_SleepyModel(2, at_threads, 0.005)))
        assert torch.get_num_threads() == 2                   # restored
        assert check.threads == 2 and check.contended is contended
        assert ("--threads 1" in caplog.text) is contended
        torch.set_num_threads(1)
        assert check_threads(_Engine(_SleepyModel(1, 0.02, 0.005))) is None     # one thread: nothing to compare
    finally:
        torch.set_num_threads(before)


class _LlamaCache(_Cache):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def set_threads(self, n: int) -> None:
        self.model.context_threads = n


class _SleepyLlama:
    """libllama's side of _SleepyModel: its threads are the context's (set_threads), not torch's; a prompt is
    written before the timed token (a forward over many tokens)."""
    device = "cpu"
    quantized: dict = {}

    def __init__(self, threads: int, at_threads: float, at_one: float):
        self.threads, self.at_threads, self.at_one = threads, at_threads, at_one
        self.context_threads = threads
        self.forwards = []

    def new_cache(self, rows, max_len):
        return _LlamaCache(self)

    def __call__(self, x, cache, last_only=False):
        import time

        self.forwards.append((x.shape[1], self.context_threads))
        if x.shape[1] == 1:
            time.sleep(self.at_one if self.context_threads == 1 else self.at_threads)


@pytest.mark.parametrize("at_threads, contended", [(0.02, True), (0.004, False)])
def test_the_thread_check_times_libllama_s_own_threads(at_threads, contended, caplog):
    import torch

    from leaplm.engine.startup_checks import check_threads

    engine = _Engine(_SleepyLlama(3, at_threads, 0.005))
    engine.backend = "llamacpp"
    before = torch.get_num_threads()
    with caplog.at_level("WARNING", logger="leaplm.engine.startup_checks"):
        check = check_threads(engine, budget_s=10.0)
    assert torch.get_num_threads() == before                  # torch's setting is not libllama's
    assert check.threads == 3 and check.contended is contended
    assert ("libllama's 3 threads" in caplog.text) is contended
    m = engine.model
    assert m.forwards[0][0] > 1                               # a context written first
    assert {t for T, t in m.forwards if T == 1} == {1, 3} and m.context_threads == 3      # both counts; restored
    m.threads = 1
    assert check_threads(engine) is None


def test_a_slow_thread_check_stops_after_two_forwards_of_each():
    engine = _Engine(_SleepyLlama(2, 0.05, 0.005))
    engine.backend = "llamacpp"
    from leaplm.engine.startup_checks import check_threads

    check = check_threads(engine, tries=6, budget_s=0.01)
    one_token = [t for T, t in engine.model.forwards if T == 1]
    assert len(one_token) == 2 * 3                            # a warm-up and two timed forwards at each count
    assert check.contended
