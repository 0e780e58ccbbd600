"""A server with its process to itself (`leaplm serve`: freeze_gc) moves what the load made to the collector's
permanent generation once loaded and warmed up, so a full collection while serving walks only what serving made
(docs/reliability.md: the hostile-grammar attack); an app sharing its process (tests, embedding) leaves the
collector alone."""
from __future__ import annotations

import gc

import pytest
from fastapi.testclient import TestClient

from leaplm.config import ServerConfig
from leaplm.server.app import create_app


@pytest.fixture(scope="module")
def engine(tiny_pair):
    from leaplm import Engine

    return Engine(tiny_pair[0], method="none")


@pytest.mark.parametrize("freeze", [True, False])
def test_load_objects_frozen_only_when_asked(engine, freeze):
    gc.unfreeze()
    try:
        app = create_app(ServerConfig(max_batch=1), engine=engine, model_name="t", freeze_gc=freeze)
        with TestClient(app, base_url="http://127.0.0.1") as c:
            assert c.get("/health").status_code == 200
            frozen = gc.get_freeze_count()
    finally:
        gc.unfreeze()
    assert (frozen > 10_000) == freeze, frozen

