"""The grammar pool's threads run at the lowest CPU priority (Linux, where a thread has its own): a hostile
grammar's compile gets the cores the steps and the event loop leave. The tokenize pool keeps the process's."""
from __future__ import annotations

import os
import sys
import threading

import pytest

from leaplm.config import ServerConfig
from leaplm.server.state import ServerState

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")


def _priority() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_grammar_compiles_run_at_the_lowest_cpu_priority():
    state = ServerState(ServerConfig(), "tiny")
    try:
        mine = _priority()
        if mine == 19:
            pytest.skip("this process runs at the lowest priority already: nothing to tell apart")
        compiles = {state.grammar_pool.submit(_priority).result() for _ in range(4)}
        tokenizing = state.tokenize_pool.submit(_priority).result()
    finally:
        state.grammar_pool.shutdown()
        state.tokenize_pool.shutdown()
    assert compiles == {19} and tokenizing == mine == _priority()
