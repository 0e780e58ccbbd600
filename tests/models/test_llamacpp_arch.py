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
