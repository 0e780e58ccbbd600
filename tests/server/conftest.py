"""Fixtures of the server tests (the kit itself is serverkit.py)."""
from __future__ import annotations

import pytest
import torch

from serverkit import API_KEY, InProcessServer, write_pair

torch.set_num_threads(1)  # the machine is shared with a long training job


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    return write_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture(scope="session")
def server(tiny_pair):
    """The shared server: draft-model speculation (K=4), API key, 16 rows, queue 64."""
    target, draft = tiny_pair
    srv = InProcessServer(target, draft, method="draft", k=4, max_batch=16, max_queue=64)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def reference(tiny_pair):
    """Engine(method="none") over the same target: what `leaplm generate --method none` prints."""
    from leaplm import Engine

    return Engine(tiny_pair[0], method="none")


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def aclient(server):
    import openai

    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
