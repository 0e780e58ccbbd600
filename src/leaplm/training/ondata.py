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

from .corpus import TokenStream, corpus_texts, functions


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


# ---------------------------------------------------------------------------------------------------------------
# Cached target logits: on-policy sequences with the target's top-k log-probabilities at every generated position.
#
# Online distillation pays a target forward for every draft step; here the target runs once, while generating,
# and the draft then trains for many epochs on the stored top-k (a 1M-parameter draft trains ~10x faster than
# the target generates). Prompts are built like the `code` benchmark's (context before a `def` line plus that
# line) but from the training split, so the draft learns the situation it is judged in without seeing held-out
# code. Shards are safetensors files: input_ids [rows, P + new] int32, topk_ids [rows, new, k] int16 and
# topk_logp [rows, new, k] fp16; topk_*[:, t] is the target's distribution over input_ids[:, P + t].
#
# Sampled continuations (temperature > 0) visit the states a user who samples sees; their shards store the same
# fields, taken from the raw (temperature-1) logits, so any temperature T can be derived from them:
# log_softmax(topk_logp / T) is p at T renormalised over the top k (log-probs are logits shifted by a constant
# per position, and the top k of the logits is the top k at every T). Column 0 stays the target's argmax; the
# token that follows is input_ids[:, P + t], sampled at the shard's temperature (metadata "temperature").

PROMPT_LENGTHS = (96, 192, 320)      # prompt tokens; one length per shard, cycled (eval prompts run ~100-400)


def def_line_prompts(tokenizer, length: int, seed: int, context_lines: int = 40,
                     max_files: int | None = None) -> list[list[int]]:
    """Token windows of exactly `length` tokens that end with a `def` line of a training-split function,
    shuffled by seed; functions with too little context before them are skipped."""
    out = []
    for lines, i, _ in functions("train", min_lines=4, max_lines=200, max_files=max_files):
        text = "".join(lines[max(0, i - context_lines) : i + 1])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            out.append(ids[-length:])
    random.Random(seed).shuffle(out)
    return out


def shard_name(seed: int, index: int, temperature: float = 0.0) -> str:
    """Greedy shards keep their original names; sampled ones carry their temperature (both glob as shard-*)."""
    if temperature > 0:
        return f"shard-s{seed}-t{temperature:g}-{index:05d}.safetensors"
    return f"shard-s{seed}-{index:05d}.safetensors"


def continuation_kwargs(temperature: float) -> dict:
    """transformers generate() arguments for a greedy (0) or pure sampled continuation: no top-k/top-p
    truncation, whatever the checkpoint's generation_config says, so tokens are drawn from p at T itself."""
    if temperature > 0:
        return dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    return dict(do_sample=False)


def generate_target_logits(target_dir: str, out_dir: str | Path, n_seqs: int = 4096, new_tokens: int = 96,
                           top_k: int = 32, batch_size: int = 64, seed: int = 0,
                           prompt_lengths: tuple[int, ...] = PROMPT_LENGTHS, part: int = 0, parts: int = 1,
                           max_files: int | None = None, on_batch: Callable[[int], None] | None = None,
                           temperature: float = 0.0) -> int:
    """Write target continuations with top-k log-probs as shards of batch_size rows in out_dir: greedy, or
    sampled at `temperature` (> 0; seeded per shard, so a shard's tokens do not depend on `parts` or resuming).

    Shard i uses prompt length prompt_lengths[i % len] and its own slice of the prompts shuffled by `seed`; this
    process writes the shards with i % parts == part, so `parts` processes fill one directory without overlap.
    Resumable: shards already present are skipped. Returns the rows this process is responsible for."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not 1 <= top_k <= 256:
        raise ValueError(f"top_k must be in [1, 256], got {top_k}")
    if not 0 <= part < parts:
        raise ValueError(f"part must be in [0, parts), got part={part} parts={parts}")
    if not 0 <= temperature <= 10:
        raise ValueError(f"temperature must be in [0, 10] (0 = greedy), got {temperature}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(target_dir)
    # fp32: the engine verifies against fp32 logits, and CPUs without bf16 units run bf16 ~5x slower
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    pools = {p: def_line_prompts(tok, p, seed, max_files=max_files) for p in prompt_lengths}
    n_shards = -(-n_seqs // batch_size)
    rows = 0
    with torch.inference_mode():
        for i in range(part, n_shards, parts):
            path = out / shard_name(seed, i, temperature)
            length = prompt_lengths[i % len(prompt_lengths)]
            start = (i // len(prompt_lengths)) * batch_size
            b = min(batch_size, n_seqs - i * batch_size)
            rows += b
            if path.exists():
                continue
            pool = pools[length]
            if start + b > len(pool):
                raise ValueError(f"n_seqs: only {len(pool)} training prompts of {length} tokens; ask for fewer")
            x = torch.tensor(pool[start : start + b])                          # [b, P]
            torch.manual_seed(seed * 1_000_003 + i)                            # this shard's draws only
            res = model.generate(input_ids=x, attention_mask=torch.ones_like(x), **continuation_kwargs(temperature),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=tok.eos_token_id, return_dict_in_generate=True, output_logits=True)
            logits = torch.stack(res.logits, dim=1).float()                    # [b, new, vocab] raw (T = 1)
            logp, ids = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)  # [b, new, k] each
            tmp = path.with_suffix(".tmp")
            save_file({"input_ids": res.sequences.to(torch.int32).contiguous(),
                       "topk_ids": ids.to(torch.int16).contiguous(),
                       "topk_logp": logp.to(torch.float16).contiguous()}, str(tmp),
                      metadata={"prompt_tokens": str(length), "target": str(target_dir),
                                "temperature": f"{temperature:g}", "seed": str(seed)})
            tmp.replace(path)
            if on_batch:
                on_batch(rows)
    return rows
