"""Chat distillation data for any target (--model: a GGUF file or a checkpoint directory): the target's own
answers to leaplm's chat prompts (chat_prompts.py), through its chat template, or (prompts="text", a base model)
its continuations of code and prose (text_prompts.py), with the target's raw top-k log-probabilities at every generated token. Two backends decode the rows: libllama (chat_llamacpp.py, batched
sequences in one llama.cpp context) for a GGUF target when llama-cpp-python is installed, else leaplm's batched
engine (the scheduler's continuous batching, plain decoding); `backend` picks one explicitly.

Answers end at EOS or at new_tokens, so rows differ in length. A shard holds shard_rows rows, all at one
temperature (shards cycle through `temperatures`: 0 = greedy, what greedy users see; 0.8 = what sampling users
see, seeded per row), right-padded:
  input_ids   [rows, L] int32       prompt + answer, padded with 0
  prompt_len  [rows] int32          P_r
  answer_len  [rows] int32          N_r (positions P_r .. P_r + N_r - 1 are the answer)
  topk_ids    [rows, N, k] int32    the target's top k at each answer position (column 0 = its argmax)
  topk_logp   [rows, N, k] fp16     their raw log-probabilities (temperature 1); padded positions hold 0
topk_*[r, t] is the target's distribution over input_ids[r, P_r + t]. Shards are written whole (tmp + rename),
so a killed run resumes at the first missing shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..config import ConfigError, SamplingParams
from .chat_prompts import chat_prompts

CHAT_FORMAT = "chat-v1"


@dataclass
class ChatDataConfig:
    model: str                                    # GGUF file or checkpoint directory of the target
    out_dir: str
    n_prompts: int = 1024                         # rows over all shards
    new_tokens: int = 128                         # longest answer kept
    top_k: int = 20
    batch_size: int = 16                          # rows decoded together by the engine
    shard_rows: int = 32
    temperatures: tuple[float, ...] = (0.0, 0.8)
    max_prompt_tokens: int = 384                  # longer prompts (big functions to edit) are skipped
    seed: int = 0
    dtype: str = "float32"
    max_files: int | None = None                  # limit the stdlib scan (tests)
    backend: str = "auto"                         # "auto" (llamacpp for a GGUF file when installed), "llamacpp", "engine"
    threads: int | None = None                    # llamacpp: its CPU threads (None: torch's thread count)
    # "chat": chat_prompts.py through the target's chat template; "text": text_prompts.py's code and prose
    # continuations as plain text (a base model, which has no chat turn to answer)
    prompts: str = "chat"

    def validate(self) -> None:
        for name in ("n_prompts", "new_tokens", "batch_size", "shard_rows", "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.top_k <= SamplingParams.MAX_LOGPROBS:
            raise ConfigError("top_k", f"must be in [1, {SamplingParams.MAX_LOGPROBS}], got {self.top_k}")
        if not self.temperatures or any(not 0 <= t <= 10 for t in self.temperatures):
            raise ConfigError("temperatures", f"must be a non-empty list of values in [0, 10], got {self.temperatures}")
        if self.prompts not in PROMPT_KINDS:
            raise ConfigError("prompts", f"{self.prompts!r} unknown; choose from {', '.join(PROMPT_KINDS)}")
        if self.backend not in BACKENDS:
            raise ConfigError("backend", f"{self.backend!r} unknown; choose from {', '.join(BACKENDS)}")

    def resolved_backend(self) -> str:
        """The backend that runs: 'auto' is llamacpp for a GGUF file when llama-cpp-python imports."""
        from ..models.gguf import is_gguf
        from .chat_llamacpp import available

        if self.backend == "llamacpp":
            if not is_gguf(self.model):
                raise ConfigError("backend", f"llamacpp runs GGUF files; {self.model!r} is not one")
            if not available():
                raise ConfigError("backend", "llamacpp needs llama-cpp-python (pip install llama-cpp-python)")
            return "llamacpp"
        if self.backend == "auto" and is_gguf(self.model) and available():
            return "llamacpp"
        return "engine"


BACKENDS = ("auto", "llamacpp", "engine")
PROMPT_KINDS = ("chat", "text")


def _encoded_prompts(cfg: ChatDataConfig, tokenizer, bos_id) -> list[list[int]]:
    from ..models.tokens import chat_prompt, encode_prompt
    from .text_prompts import continuation_prompts

    if cfg.prompts == "text":
        texts = continuation_prompts(cfg.seed, cfg.max_files)
    else:
        texts = [chat_prompt(tokenizer, p.text) for p in chat_prompts(cfg.seed, cfg.max_files)]
    out = []
    for text in texts:
        ids = encode_prompt(tokenizer, text, bos_id)
        if len(ids) <= cfg.max_prompt_tokens:
            out.append(ids)
    return out


def _shard_tensors(rows: list[tuple[list[int], list]], k: int) -> dict[str, torch.Tensor]:
    """rows: (prompt ids, TokenLogprob list of the answer) -> the padded shard tensors (module docstring)."""
    L = max(len(p) + len(a) for p, a in rows)
    N = max(1, max(len(a) for _, a in rows))
    ids = torch.zeros(len(rows), L, dtype=torch.int32)
    tk_ids = torch.zeros(len(rows), N, k, dtype=torch.int32)
    tk_lp = torch.zeros(len(rows), N, k, dtype=torch.float16)
    for r, (p, ans) in enumerate(rows):
        seq = p + [lp.token_id for lp in ans]
        ids[r, : len(seq)] = torch.tensor(seq, dtype=torch.int32)
        for t, lp in enumerate(ans):
            tk_ids[r, t] = torch.tensor([i for i, _ in lp.top], dtype=torch.int32)
            tk_lp[r, t] = torch.tensor([v for _, v in lp.top]).clamp(min=-60.0).half()
    return {"input_ids": ids, "prompt_len": torch.tensor([len(p) for p, _ in rows], dtype=torch.int32),
            "answer_len": torch.tensor([len(a) for _, a in rows], dtype=torch.int32),
            "topk_ids": tk_ids, "topk_logp": tk_lp}


def generate_chat_logits(cfg: ChatDataConfig, on_rows: Callable[[int, int], None] | None = None) -> int:
    """Write the shards of cfg (skipping those present); on_rows(done, total) after each finished row.
    Returns the rows in the directory's shards."""
    from safetensors.torch import save_file

    from ..engine.engine import Engine
    from ..engine.scheduler import BatchScheduler, SeqRequest

    cfg.validate()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_shards = -(-cfg.n_prompts // cfg.shard_rows)
    todo = [i for i in range(n_shards) if not (out / f"chat-{i:05d}.safetensors").exists()]
    done = (n_shards - len(todo)) * cfg.shard_rows
    if on_rows:
        on_rows(min(done, cfg.n_prompts), cfg.n_prompts)
    if not todo:
        return cfg.n_prompts
    backend = cfg.resolved_backend()
    if backend == "llamacpp":
        from ..models.gguf import inspect_gguf, load_gguf_tokenizer
        from ..models.tokens import bos_to_add

        tokenizer = load_gguf_tokenizer(inspect_gguf(cfg.model))
        bos_id = bos_to_add(tokenizer)
    else:
        engine = Engine(cfg.model, method="none", dtype=cfg.dtype,
                        max_model_len=cfg.max_prompt_tokens + cfg.new_tokens + 8)
        tokenizer, bos_id = engine.tokenizer, engine.target.bos_id
    prompts = _encoded_prompts(cfg, tokenizer, bos_id)
    if len(prompts) < cfg.n_prompts:
        raise ConfigError("n_prompts", f"only {len(prompts)} {cfg.prompts} prompts fit max_prompt_tokens; ask for "
                                       "fewer")
    answers: dict[int, list] = {}
    left = {i: min((i + 1) * cfg.shard_rows, cfg.n_prompts) - i * cfg.shard_rows for i in todo}

    def write(i: int) -> None:
        lo, hi = i * cfg.shard_rows, min((i + 1) * cfg.shard_rows, cfg.n_prompts)
        path = out / f"chat-{i:05d}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(_shard_tensors([(prompts[r], answers.pop(r)) for r in range(lo, hi)], cfg.top_k), str(tmp),
                  metadata={"format": CHAT_FORMAT, "temperature": str(_temperature(cfg, i)), "target": cfg.model})
        tmp.replace(path)

    def finished(r: int) -> None:
        nonlocal done
        done += 1
        i = r // cfg.shard_rows
        left[i] -= 1
        if left[i] == 0:
            write(i)
        if on_rows:
            on_rows(min(done, cfg.n_prompts), cfg.n_prompts)

    rows = [r for i in todo for r in range(i * cfg.shard_rows, min((i + 1) * cfg.shard_rows, cfg.n_prompts))]
    if backend == "llamacpp":
        from .chat_llamacpp import LlamaCppGenerator, RowSpec

        eos = _gguf_eos_ids(cfg.model, tokenizer)
        gen = LlamaCppGenerator(cfg.model, cfg.batch_size, cfg.max_prompt_tokens + cfg.new_tokens + 8, cfg.threads)
        try:
            specs = [RowSpec(prompts[r], _temperature(cfg, r // cfg.shard_rows),
                             (cfg.seed << 32) + r if _temperature(cfg, r // cfg.shard_rows) > 0 else None)
                     for r in rows]

            def on_answer(j: int, answer: list) -> None:
                answers[rows[j]] = answer
                finished(rows[j])

            gen.run(specs, cfg.new_tokens, cfg.top_k, eos, on_answer)
        finally:
            gen.close()
        return cfg.n_prompts
    sched = BatchScheduler(engine, max_batch=cfg.batch_size, max_queue=cfg.n_prompts, calibrate=False)

    def collect(r: int):
        def on_output(o) -> None:
            if o.error is not None:
                raise RuntimeError(f"chat prompt {r}: {o.error}")
            answers.setdefault(r, []).extend(o.chunk.logprobs or [])
            if o.finished:
                finished(r)
        return on_output

    # every missing row is queued at once: the batch stays full while shards finish in any order
    reqs = []
    for r in rows:
        temp = _temperature(cfg, r // cfg.shard_rows)
        reqs.append(SeqRequest(prompts[r], SamplingParams(
            max_new_tokens=cfg.new_tokens, temperature=temp, logprobs=cfg.top_k,
            seed=(cfg.seed << 32) + r if temp > 0 else None), collect(r)))
    sched.submit(reqs)
    sched.run_until_idle()
    return cfg.n_prompts


def _gguf_eos_ids(path: str, tokenizer) -> set[int]:
    """The EOS ids the engine stops a GGUF target at (models/loading.py): the file's eos_token_id as transformers
    maps it, else the tokenizer's."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    eos = load_gguf_checkpoint(path, return_tensors=False)["config"].get("eos_token_id")
    ids = {eos} if isinstance(eos, int) else set(eos or [])
    return ids or ({tokenizer.eos_token_id} - {None})


def _temperature(cfg: ChatDataConfig, shard: int) -> float:
    return cfg.temperatures[shard % len(cfg.temperatures)]
