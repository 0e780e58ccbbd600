"""Memory follows the work: a model whose config allows 131072 positions gets a context of 4096 by default and a
KV cache grown with its sequences, far below the cache that preallocating every position would take. Asserted on
allocated cache bytes, not on RSS. (serve: tests/server/test_serve_memory.py.)"""
from __future__ import annotations

import json

from typer.testing import CliRunner

from leaplm.cli import app

POSITIONS = 131072
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 8          # the long_context_llama fixture (tests/conftest.py)


def preallocated_bytes(rows: int) -> int:
    """What a cache sized by max_position_embeddings in fp32 would take."""
    return 2 * LAYERS * rows * KV_HEADS * POSITIONS * HEAD_DIM * 4


def test_generate_default_context_and_cache(long_context_llama):
    res = CliRunner().invoke(app, ["generate", "t1 t2 t3", "--model", long_context_llama, "--method", "none",
                                   "--max-new-tokens", "40", "--ignore-eos", "--json"])
    assert res.exit_code == 0, res.output
    st = json.loads(res.stdout)["stats"]
    assert st["max_model_len"] == 4096
    per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * 4
    assert 0 < st["kv_cache_peak_bytes"] <= 256 * per_token          # one chunk holds 3 + 40 tokens
    assert st["kv_cache_peak_bytes"] * 500 < preallocated_bytes(1)


def test_generate_max_model_len_beyond_the_model_is_refused(long_context_llama):
    res = CliRunner().invoke(app, ["generate", "t1", "--model", long_context_llama, "--max-model-len", "200000"])
    assert res.exit_code == 2
    assert "--max-model-len" in res.output and "131072" in res.output
