"""A tokenizer of one letter per token that llguidance reads (each token's text is its bytes)."""
from __future__ import annotations

LETTERS = "abcdefg"            # ids 0..6; id 7 is <unk> (special: never allowed by a grammar)


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
