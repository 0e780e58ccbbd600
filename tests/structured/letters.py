"""Tiny random Llamas over a tokenizer llguidance reads: one letter per token, each token's text its bytes.

  letter_tokenizer()   a..g (ids 0..6) and <unk> (7, special: never allowed by a grammar); no end-of-sequence token
  letters (fixture)    {"target", "near"}: an 8-token target and a noisy copy of it (a draft that agrees often),
                       small enough to enumerate the constrained target's distribution over three tokens
Test modules take the fixture with `from letters import letters`.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

LETTERS = "abcdefg"


def letter_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {c: i for i, c in enumerate(LETTERS)}
    words["<unk>"] = len(LETTERS)
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.ByteFallback()                # each token's text is its bytes (what llguidance reads)
    tok.add_special_tokens(["<unk>"])                    # special: llguidance never allows it
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _root_conftest():
    """tests/conftest.py by path (`from conftest import` finds whichever conftest pytest loaded first)."""
    name = "leaplm_tests_root_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "conftest.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="session")
def letters(tmp_path_factory):
    from leaplm.models import load_model

    root = _root_conftest()
    target = root.write_tiny_llama(tmp_path_factory.mktemp("letters_target"), vocab=8, layers=2, seed=0,
                                   init_range=0.3)
    letter_tokenizer().save_pretrained(target)
    near = root.write_noisy_copy(target, tmp_path_factory.mktemp("letters_near"), noise=0.03, seed=5)
    return {name: load_model(path) for name, path in (("target", target), ("near", near))}
