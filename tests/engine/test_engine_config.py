"""EngineConfig: the one frozen value an engine is built from; Engine's keyword arguments, the CLI's engine options
and `leaplm serve` build it, and bad values name their field before any model loads."""
from __future__ import annotations

import dataclasses

import pytest

from leaplm.cli.common import EngineOptions
from leaplm.config import ConfigError, EngineConfig, SpecConfig
from leaplm.engine.engine import Engine


def test_keyword_arguments_make_the_config_the_engine_keeps(loaded):
    target = loaded("llama_tied")
    eng = Engine(target, method="ngram", k=3, max_model_len=64, adaptive_k=False, ngram_max=2)
    cfg = eng.config
    assert (cfg.model, cfg.method, cfg.k, cfg.max_model_len) == (target, "ngram", 3, 64)
    assert cfg.spec_options == {"adaptive_k": False, "ngram_max": 2}
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.k = 4
    same = Engine(config=cfg)
    assert (same.spec.method, same.spec.k, same.spec.ngram_max, same.spec.adaptive_k) == ("ngram", 3, 2, False)
    assert same.max_model_len == 64


def test_cli_options_build_the_config():
    opts = EngineOptions(model="some/dir", max_model_len=128, dtype="bfloat16", threads=2)
    cfg = opts.engine_config(method="none", k=4, spec_options={"adaptive_k": False})
    assert cfg == EngineConfig(model="some/dir", method="none", k=4, dtype="bfloat16", threads=2, max_model_len=128,
                               spec_options={"adaptive_k": False})


@pytest.mark.parametrize("kw, field", [
    (dict(backend="vllm"), "backend"), (dict(threads=0), "threads"), (dict(threads=1.5), "threads"),
    (dict(max_model_len=1), "max_model_len"), (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(spec=SpecConfig(method="none"), method="ngram"), "method"),
])
def test_bad_values_name_their_field(kw, field):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kw)
    assert e.value.field == field


def test_config_is_given_alone(loaded):
    with pytest.raises(ConfigError) as e:
        Engine(loaded("llama_tied"), config=EngineConfig(method="none"))
    assert e.value.field == "config"
