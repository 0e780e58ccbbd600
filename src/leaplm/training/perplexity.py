"""Held-out perplexity of a causal LM checkpoint on a corpus split, deterministic across runs and models."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .corpus import TokenStream, corpus_texts
from .pretrain import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Perplexity:
    model_dir: str
    corpus: str
    split: str
    tokens: int                       # tokens scored
    loss: float                       # mean cross-entropy, nats per token

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def window_starts(n_tokens: int, seq_len: int, max_tokens: int) -> list[int]:
    """Non-overlapping windows spread evenly over the whole stream (not just its first documents)."""
    n_all = n_tokens // seq_len
    if n_all == 0:
        raise ValueError(f"corpus has {n_tokens} tokens, fewer than seq_len={seq_len}")
    n = max(1, min(n_all, max_tokens // seq_len))
    return [(i * n_all // n) * seq_len for i in range(n)]


@torch.no_grad()
def perplexity(model_dir: str, corpus: str = "stdlib", split: str = "heldout", seq_len: int = 512,
               batch_size: int = 8, max_tokens: int = 1 << 18, max_files: int | None = None, bf16: bool = True,
               on_batch: Callable[[int, int], None] | None = None) -> Perplexity:
    """Mean next-token loss of model_dir on a corpus split (for a directory or .jsonl corpus, `split` is
    ignored: all of it is scored). Scores at most max_tokens tokens in windows of seq_len, each window's
    first token unscored. on_batch(done, total) reports progress in batches."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stream = TokenStream.build(corpus_texts(corpus, split, max_files), tok, tok.eos_token_id)
    starts = window_starts(len(stream), seq_len, max_tokens)
    total_nll, scored = 0.0, 0
    n_batches = math.ceil(len(starts) / batch_size)
    for b in range(n_batches):
        x = torch.stack([stream.ids[s : s + seq_len] for s in starts[b * batch_size : (b + 1) * batch_size]])
        x = x.long()  # [batch, seq_len]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x).logits  # [batch, seq_len, vocab]
        nll = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        total_nll += nll.item()
        scored += x[:, 1:].numel()
        if on_batch:
            on_batch(b + 1, n_batches)
    log.info("perplexity of %s on %s/%s: %d tokens", model_dir, corpus, split, scored)
    return Perplexity(str(model_dir), corpus, split, scored, total_nll / scored)
