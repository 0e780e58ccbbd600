"""Fixtures for structured output: tiny random Llamas over a tokenizer llguidance reads (one letter per token).

  letters    {"target", "near"}: an 8-token target (a..g, then <unk>) and a noisy copy of it (a draft that agrees
             often), small enough to enumerate the constrained target's distribution over three tokens
"""
from __future__ import annotations

import pytest

@pytest.fixture(scope="session")
def letters(tmp_path_factory):
    from conftest import write_noisy_copy, write_tiny_llama
    from letters import letter_tokenizer

    from leaplm.models import load_model

    target = write_tiny_llama(tmp_path_factory.mktemp("letters_target"), vocab=8, layers=2, seed=0, init_range=0.5)
    letter_tokenizer().save_pretrained(target)
    near = write_noisy_copy(target, tmp_path_factory.mktemp("letters_near"), noise=0.03, seed=5)
    return {name: load_model(path) for name, path in (("target", target), ("near", near))}
