"""Fixtures of the reliability suite: the server kit of tests/server (tiny checkpoints, in-process and subprocess
servers) reused, plus raw-socket helpers for clients that do not speak HTTP properly."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from serverkit import InProcessServer, write_pair  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    return write_pair(tmp_path_factory.mktemp("reliability_pair"))


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
