"""Fixtures for head tests: a tiny target (vocabulary 16) with heads trained on it in seconds and random ones,
over its whole vocabulary and over a reduced draft vocabulary of 6 tokens."""
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
    train_tiny_eagle(target.path, corpus, d / "reduced", draft_vocab=6)
    return {"target": target, "head": str(d / "head"), "random": random_head(target, d / "random"),
            "corpus": corpus, "reduced": str(d / "reduced"),
            "reduced-random": random_head(target, d / "reduced-random", draft_vocab=6)}
