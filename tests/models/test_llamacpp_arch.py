"""libllama, not leaplm's architecture list, decides which GGUF files the llama.cpp backend loads."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from leaplm.errors import ConfigError
from leaplm.models.gguf import inspect_gguf
from leaplm.models.llamacpp.binding import available
from leaplm.models.loading import choose_target_backend, load_model

sys.path.insert(0, str(Path(__file__).parent))
from gguf_writer import write_tiny_gguf  # noqa: E402

needs_libllama = pytest.mark.skipif(not available(), reason="the llamacpp extra (llama-cpp-python) is not installed")


def test_inspect_gguf_checks_the_architecture_only_when_asked(tmp_path):
    path, _ = write_tiny_gguf(tmp_path, arch="gpt2")
    with pytest.raises(ConfigError, match="general.architecture 'gpt2'"):
        inspect_gguf(path)
    assert inspect_gguf(path, check_types=False, check_arch=False).architecture == "gpt2"


@needs_libllama
def test_auto_sends_a_file_leaplm_cannot_run_to_libllama(tmp_path):
    path, _ = write_tiny_gguf(tmp_path, arch="gpt2")
    choice = choose_target_backend(path, "ngram")
    assert choice.backend == "llamacpp" and "gpt2" in choice.reason


@needs_libllama
def test_a_file_neither_backend_runs_names_both_refusals(tmp_path):
    # llama-shaped tensors under general.architecture gpt2: libllama misses gpt2's hyperparameters
    path, _ = write_tiny_gguf(tmp_path, arch="gpt2")
    with pytest.raises(ConfigError) as e:
        load_model(path, backend="llamacpp")
    msg = e.value.message
    assert "'gpt2' runs on neither backend" in msg
    assert "libllama: " in msg and "layer_norm_epsilon" in msg      # libllama's own reason, captured
    assert "leaplm's own forward: not supported" in msg


# granite: llama's tensors under another architecture, with the scales llama.cpp requires of it (1 and 1/sqrt(D):
# the same function as llama); leaplm's own forward has no description of it, libllama runs it
GRANITE_SCALES = {"{arch}.logit_scale": 1.0, "{arch}.residual_scale": 1.0, "{arch}.embedding_scale": 1.0,
                  "{arch}.attention.scale": 0.25}


@needs_libllama
def test_a_file_only_libllama_runs_decodes_and_speculates_token_identically(tmp_path):
    from leaplm.config import EngineConfig, SamplingParams
    from leaplm.engine.engine import Engine

    path, _ = write_tiny_gguf(tmp_path, arch="granite", name="tiny random granite", floats=GRANITE_SCALES)
    with pytest.raises(ConfigError, match="general.architecture 'granite'"):
        load_model(path, backend="torch")
    ids = {}
    for method in ("none", "ngram", "suffix"):
        engine = Engine(config=EngineConfig(model=path, backend="auto", method=method))
        assert engine.target.backend == "llamacpp"
        out = engine.generate("hello hello hello hello", SamplingParams(max_new_tokens=24, temperature=0.0))
        ids[method] = list(out.token_ids)
    assert len(ids["none"]) == 24
    assert ids["ngram"] == ids["none"] and ids["suffix"] == ids["none"]
