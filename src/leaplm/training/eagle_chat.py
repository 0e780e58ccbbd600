"""Chat-shaped data for `leaplm train eagle --chat`: the target's own answers to chat-templated prompts.

Prompts are user messages: leaplm's own chat prompts (training/chat_prompts.py: code requests, edits and
questions from the standard library's training split, so the benchmark's held-out chat prompts are never seen)
when the corpus is 'stdlib', else the 'prompt' (or 'text') field of each line of a .jsonl file. Each goes
through the target's chat template with the assistant turn opened.

Prompts differ in length: a batch is prefilled right-padded (each row's padding comes after its own tokens, so
causal attention never reads it) and each row's cache length is then set to its own prompt length, so decoding
writes every row at its own position and the padded slots are overwritten or masked. A row's answer ends at its
first EOS; the loss is taken on answer positions only (TargetBatch.loss_mask), the prompt still being context.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from ..config import ConfigError
from .head_data import TargetBatch


def chat_messages(corpus: str, seed: int, max_files: int | None = None) -> list[str]:
    """The user messages of `corpus` in a seeded order; a missing, empty or malformed file is refused."""
    if corpus == "stdlib":
        from .chat_prompts import chat_prompts

        return [p.text for p in chat_prompts(seed, max_files)]
    path = Path(corpus)
    if path.suffix != ".jsonl" or not path.is_file():
        raise ConfigError("corpus", f"--chat reads 'stdlib' or an existing .jsonl file of prompts, got {corpus!r}")
    messages = []
    for i, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError("corpus", f"{corpus} line {i + 1} is not JSON ({e.msg})") from None
            text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise ConfigError("corpus", f"{corpus} line {i + 1} has no 'prompt' or 'text' string")
            messages.append(text)
    if not messages:
        raise ConfigError("corpus", f"{corpus} holds no prompt")
    random.Random(seed).shuffle(messages)
    return messages


def chat_prompt_ids(messages: list[str], tokenizer, bos_id: int | None, max_tokens: int,
                    name: str = "target") -> list[list[int]]:
    """Token ids of each message through the chat template (assistant turn opened), those of at most
    max_tokens kept."""
    from ..models.tokens import chat_prompt, encode_prompt

    out = [ids for ids in (encode_prompt(tokenizer, chat_prompt(tokenizer, m, name), bos_id) for m in messages)
           if len(ids) <= max_tokens]
    if not out:
        raise ConfigError("prompt_tokens", f"no chat prompt fits in {max_tokens} tokens")
    return out


def chat_target_batch(model, prompts: list[list[int]], new_tokens: int, temperature: float,
                      generator: torch.Generator, eos_ids: set[int]) -> TargetBatch:
    """The target answers each prompt (ragged); features, log-normalisers and argmaxes kept, right-padded."""
    with torch.inference_mode():
        b = _answer(model, prompts, new_tokens, temperature, generator, eos_ids)
    return TargetBatch(b.ids.clone(), b.feats.clone(), b.lse.clone(), b.top.clone(), b.loss_mask.clone())


def _answer(model, prompts, new_tokens, temperature, generator, eos_ids) -> TargetBatch:
    B = len(prompts)
    P = [len(p) for p in prompts]
    Pm = max(P)
    x = torch.zeros(B, Pm, dtype=torch.long)                                  # [B, Pm] right-padded
    for r, p in enumerate(prompts):
        x[r, : len(p)] = torch.tensor(p)
    cache = model.new_cache(B, Pm + new_tokens)
    out = model.forward_hidden(x, cache)                                      # logits [B, Pm, V]
    rows = torch.arange(B)
    last = torch.tensor(P) - 1
    for r in range(B):
        cache.advance(P[r], row=r)
    logits = out.logits[rows, last].float()                                   # [B, V] each row's last prompt token
    feats = [[out.hidden[r, : P[r]]] for r in range(B)]                       # per row: [n, hid] pieces
    lse = [[torch.logsumexp(out.logits[r, : P[r]].float(), -1)] for r in range(B)]
    top = [[out.logits[r, : P[r]].argmax(-1)] for r in range(B)]
    ids = [list(p) for p in prompts]
    done = [False] * B
    for i in range(new_tokens):
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)   # [B, 1]
        else:
            nxt = logits.argmax(-1, keepdim=True)
        for r in range(B):
            if not done[r]:
                t = int(nxt[r, 0])
                ids[r].append(t)
                done[r] = t in eos_ids
        if all(done) or i + 1 == new_tokens:
            break
        out = model.forward_hidden(nxt, cache)                                # [B, 1, ...] at each row's length
        for r in range(B):                    # finished rows keep decoding; what they add is cut below
            cache.advance(1, row=r)
            feats[r].append(out.hidden[r])
            lse[r].append(torch.logsumexp(out.logits[r].float(), -1))
            top[r].append(out.logits[r].argmax(-1))
        logits = out.logits[:, -1].float()
    # every token but a row's last has a feature: keep len(ids[r]) - 1 of them
    S = max(len(s) - 1 for s in ids)
    hid = out.hidden.shape[-1]
    ids_t = torch.zeros(B, S, dtype=torch.long)
    feats_t = torch.zeros(B, S, hid)
    lse_t = torch.zeros(B, S)
    top_t = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.bool)
    for r in range(B):
        n = len(ids[r]) - 1
        ids_t[r, :n] = torch.tensor(ids[r][:n])
        feats_t[r, :n] = torch.cat(feats[r])[:n].float()
        lse_t[r, :n] = torch.cat(lse[r])[:n]
        top_t[r, :n] = torch.cat(top[r])[:n]
        mask[r, P[r]:n] = True                  # features of answer tokens: what drafting in the answer predicts
    return TargetBatch(ids_t, feats_t, lse_t, top_t, mask)
