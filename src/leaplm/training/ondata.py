"""On-policy distillation data: the target's own continuations of corpus prompts (sequence-level KD).

A draft is judged on text the target generates, and a weak target's greedy text (loops, repeated
identifiers) looks unlike the corpus; training the draft on it, with the target's logits, raises acceptance
where it is measured. Generated in batches with transformers' generate (a batch costs about one sequence on
a memory-bound CPU), written as JSONL ({"text": ...}) that `leaplm train distill --corpus FILE.jsonl` reads.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

import torch

from .corpus import TokenStream, corpus_texts


def generate_target_corpus(target_dir: str, out_path: str | Path, n_seqs: int = 2048, prompt_tokens: int = 64,
                           new_tokens: int = 128, batch_size: int = 64, temperature: float = 0.0, seed: int = 0,
                           corpus: str = "stdlib", on_batch: Callable[[int], None] | None = None) -> int:
    """Write n_seqs prompt + continuation texts; prompts are windows of the training split. Returns rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    stream = TokenStream.build(corpus_texts(corpus, "train"), tok, tok.eos_token_id)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows = 0
    with Path(out_path).open("w") as f, torch.inference_mode():
        while rows < n_seqs:
            b = min(batch_size, n_seqs - rows)
            x = stream.batch(rng, b, prompt_tokens)                        # [b, prompt_tokens]
            kw = dict(do_sample=temperature > 0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      pad_token_id=tok.eos_token_id)
            if temperature > 0:
                kw["temperature"] = temperature
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)   # [b, P + new]
            for seq in out.tolist():
                f.write(json.dumps({"text": tok.decode(seq, skip_special_tokens=True)}) + "\n")
            rows += b
            if on_batch:
                on_batch(rows)
    return rows
