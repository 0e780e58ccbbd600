"""Draft placement: --draft-device is validated at the boundary (only the CPU exists on this machine, so an
absent accelerator must be refused naming the field), a draft placed explicitly stays lossless, and the memory
the draft adds is reported (tune's table, the server's /metrics)."""
from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from leaplm.cli import app
from leaplm.config import ConfigError, SamplingParams
from leaplm.engine.engine import Engine


def test_draft_on_an_explicit_device_is_token_identical(checkpoint):
    plain = Engine(checkpoint("llama_tied"), method="none")
    spec = Engine(checkpoint("llama_tied"), draft=checkpoint("llama_draft"), method="draft", k=3, draft_device="cpu")
    assert spec.draft.model.device == torch.device("cpu")
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    assert spec.generate("the quick", sp).token_ids == plain.generate("the quick", sp).token_ids


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of an absent CUDA device")
def test_absent_draft_device_is_refused_naming_the_field(checkpoint):
    with pytest.raises(ConfigError) as e:
        Engine(checkpoint("llama_tied"), draft=checkpoint("llama_draft"), method="draft", draft_device="cuda:1")
    assert e.value.field == "draft_device" and "not available" in e.value.message
    res = CliRunner().invoke(app, ["serve", "--draft-device", "cuda"])
    assert res.exit_code == 2 and "--draft-device" in res.output
    res = CliRunner().invoke(app, ["serve", "--draft-device", "tpu"])
    assert res.exit_code == 2 and "--draft-device" in res.output and "unknown device" in res.output


def test_metrics_report_the_memory_the_draft_adds(checkpoint):
    from fastapi.testclient import TestClient

    from leaplm.config import ServerConfig
    from leaplm.server.app import create_app
    from leaplm.models.footprint import kv_cache_bytes

    eng = Engine(checkpoint("llama_tied"), draft=checkpoint("llama_draft"), method="draft", k=2, max_model_len=64)
    want_weights = sum(p.numel() * p.element_size() for p in eng.draft.model.parameters())
    want_row = kv_cache_bytes(eng.draft.config, 1, 64)
    with TestClient(create_app(ServerConfig(max_batch=2), engine=eng, model_name="t"), base_url="http://127.0.0.1") as c:
        text = c.get("/metrics").text
    got = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
           if line.startswith("leaplm_speculative_memory_bytes{")}
    assert got == {"draft_weights": want_weights, "draft_kv_cache_per_row": want_row}
    assert want_weights > 0 and want_row == 2 * eng.draft.config["num_hidden_layers"] * 64 * \
        eng.draft.config["num_key_value_heads"] * (eng.draft.config.get("head_dim") or 8) * 4
