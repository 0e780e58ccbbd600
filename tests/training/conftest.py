"""Tiny models trained in seconds, shared by the training tests: a 512-token tokenizer on 20 stdlib files,
a "tiny" target and a "tiny" CE-pretrained draft."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from leaplm.training.corpus import corpus_texts
from leaplm.training.pretrain import PretrainConfig, pretrain
from leaplm.training.tokenizer import train_tokenizer

torch.set_num_threads(1)  # the machine is shared with a long training job

N_FILES = 20
VOCAB = 512


def tiny_pretrain_config(out_dir, tokenizer_dir, steps: int = 6, seed: int = 0) -> PretrainConfig:
    batch_size, seq_len = 4, 64
    return PretrainConfig(out_dir=str(out_dir), tokenizer_dir=str(tokenizer_dir), preset="tiny",
                          tokens=steps * batch_size * seq_len, batch_size=batch_size, seq_len=seq_len,
                          long_seq_len=128, long_fraction=0.2, lr=3e-3, warmup_steps=2, seed=seed,
                          save_every=100, eval_every=100, eval_batches=1, max_files=N_FILES)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(corpus_texts("stdlib", "train", N_FILES), d, vocab_size=VOCAB)
    return d


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tiny_tokenizer_dir):
    d = tmp_path_factory.mktemp("target")
    pretrain(tiny_pretrain_config(d, tiny_tokenizer_dir, steps=8))
    return d


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, tiny_tokenizer_dir):
    d = tmp_path_factory.mktemp("draft")
    pretrain(tiny_pretrain_config(d, tiny_tokenizer_dir, steps=4, seed=1))
    return d


@pytest.fixture
def distill_config():
    """make(out_dir, target_dir, draft_init, steps=4, **overrides) -> a tiny DistillConfig."""
    from leaplm.training.distill import DistillConfig

    def make(out_dir, target_dir, draft_init, steps: int = 4, **kw) -> DistillConfig:
        batch_size, seq_len = 4, 64
        base = DistillConfig(target_dir=str(target_dir), out_dir=str(out_dir), draft_init=str(draft_init),
                             tokens=steps * batch_size * seq_len, batch_size=batch_size, seq_len=seq_len,
                             long_seq_len=128, long_fraction=0.25, lr=3e-3, warmup_steps=2, save_every=100,
                             eval_every=2, eval_batches=1, max_files=N_FILES)
        return dataclasses.replace(base, **kw)

    return make


@pytest.fixture(scope="session", autouse=True)
def _list_stdlib_once():
    """stdlib_files walks the whole stdlib, site-packages included, on every call (seconds on a busy machine);
    the tests call it a dozen times, and the listing cannot change during a session."""
    import functools

    from leaplm.training import corpus

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus, "stdlib_files", functools.lru_cache(corpus.stdlib_files))
        yield
