"""Fixtures for head tests: a tiny target (vocabulary 16) with a head trained on it in seconds and a random one."""
from __future__ import annotations

import pytest

from head_helpers import random_head, train_tiny_eagle, write_word_corpus


@pytest.fixture(scope="session")
def eagle16(tiny_llama_factory, tmp_path_factory):
    """{"target": LoadedModel (vocab 16), "head": a trained head dir, "random": an untrained head dir}."""
    target = tiny_llama_factory(vocab=16, layers=2, seed=3)
    d = tmp_path_factory.mktemp("eagle16")
    corpus = write_word_corpus(d / "corpus.jsonl", 16)
    train_tiny_eagle(target.path, corpus, d / "head")
    return {"target": target, "head": str(d / "head"), "random": random_head(target, d / "random"),
            "corpus": corpus}
