"""Byte-level BPE tokenizer trained on the corpus, saved so that transformers.AutoTokenizer loads it."""
from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"


def train_tokenizer(texts: list[str], out_dir: str | Path, vocab_size: int = 8192):
    """Train byte-level BPE over texts and save a PreTrainedTokenizerFast to out_dir; returns it."""
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 bytes + merges), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=None)
    fast.model_max_length = 1024
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    log.info("tokenizer: %d tokens saved to %s", fast.vocab_size, out_dir)
    return fast
