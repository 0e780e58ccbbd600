"""Fixtures of the reliability suite: the server kit of tests/server (tiny checkpoints, in-process and subprocess
servers) reused, plus raw-socket helpers for clients that do not speak HTTP properly.

Tests record the suite's figures (requests tried, 5xx seen, aborts, leaked rows, RSS drift, drain time) with the
`figures` fixture; they are printed at the end of the run and written as JSON to $RELIABILITY_REPORT when set
(docs/reliability.md quotes them with the command that produced them)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from serverkit import InProcessServer, write_pair  # noqa: E402

torch.set_num_threads(1)

_FIGURES: dict[str, dict[str, float]] = {}      # test name -> figure name -> value


@pytest.fixture
def figures(request) -> dict[str, float]:
    """This test's figures (name -> value), reported at the end of the run."""
    return _FIGURES.setdefault(request.node.name, {})


def pytest_terminal_summary(terminalreporter):
    if not any(_FIGURES.values()):
        return
    terminalreporter.section("reliability figures")
    for test, figs in _FIGURES.items():
        if figs:
            terminalreporter.write_line(f"{test}: " + ", ".join(f"{k}={v:g}" for k, v in figs.items()))
    path = os.environ.get("RELIABILITY_REPORT")
    if path:
        Path(path).write_text(json.dumps(_FIGURES, indent=1) + "\n")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    return write_pair(tmp_path_factory.mktemp("reliability_pair"))


@pytest.fixture(scope="session")
def reference(tiny_pair):
    """Engine(method="none") over the same target: each prompt's greedy output when it runs alone."""
    from leaplm import Engine

    return Engine(tiny_pair[0], method="none")


@pytest.fixture(scope="module")
def server(tiny_pair):
    """A draft-speculating server with an API key, 4 rows, a queue of 16 sequences, short read/idle timeouts."""
    srv = InProcessServer(*tiny_pair, k=4, max_batch=4, max_queue=16, request_read_timeout_s=1.0,
                          keep_alive_timeout_s=1.0)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
