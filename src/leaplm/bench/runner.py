"""Run configurations side by side on the same prompts: warm-up, then rounds in which every configuration
runs every prompt, in an order rotated each round (A B C, B C A, ...). Speedups are medians of ratios paired
by (round, prompt) against `none`, so drifts in machine speed cancel. Timing is end to end (prefill
included) for every configuration, leaplm's and Hugging Face's alike.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..config import SamplingParams
from ..engine.stats import GenerationStats
from .workloads import Workload

log = logging.getLogger(__name__)


@dataclass
class Sample:
    config: str
    workload: str
    prompt: int
    round: int
    new_tokens: int
    seconds: float
    token_ids: list[int]
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_forwards: int = 0
    wall_seconds: float | None = None           # an external engine's whole process (seconds is its own clock)
    decode_tokens_per_s: float | None = None    # the engine's own decode rate: an external engine's figure;
                                                # leaplm's new tokens / decoding seconds (prefill excluded)
    text: str | None = None                     # an external engine's generated text (it reports no token ids)
    prompt_tokens: int | None = None            # as the external engine tokenized the prompt
    constrained: bool = False                   # run with the prompt's constraint (a `+schema` configuration)
    predicted: bool = False                     # run with the prompt's prediction (a `+prediction` configuration)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    valid: bool | None = None                   # structured workloads: the output parses and fits the schema
    grammar_seconds: float = 0.0                # structured output: seconds in the grammar (masks, forced tokens)
    forced_tokens: int = 0                      # structured output: tokens the grammar forced (drafted for free)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds


@dataclass
class ConfigSummary:
    config: str
    workload: str
    tokens_per_s: float                 # median over samples
    speedup: float | None               # median of paired ratios vs the baseline config
    acceptance_rate: float | None
    mean_accepted_length: float | None
    identical: bool | None              # greedy output token-identical to the baseline on every prompt
    samples: int
    wall_tokens_per_s: float | None = None      # external engines: new tokens / whole-process seconds (median)
    decode_tokens_per_s: float | None = None    # the engine's own decode rate (median; Sample says how)
    common_prefix: float | None = None          # external engines: median count of the baseline's first tokens
    common_prefix_min: int | None = None        # its text reproduces (llamacpp.common_prefix_tokens), the fewest,
    compared_tokens: float | None = None        # and the median count compared (up to the baseline's first EOS)
    valid_rate: float | None = None             # structured workloads: outputs that parse and fit their schema
    grammar_ms_per_token: float | None = None   # structured output: grammar time per new token
    grammar_share: float | None = None          # ... as a share of the configuration's decoding time
    baseline: str | None = None                 # the configuration its speedup is paired with


@dataclass
class BenchResult:
    machine: dict
    settings: dict
    summaries: list[ConfigSummary]
    samples: list[Sample] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"machine": self.machine, "settings": self.settings,
                "summaries": [asdict(s) for s in self.summaries],
                "samples": [asdict(s) | {"token_ids": None} for s in self.samples]}


@dataclass
class ExternalStats:
    """One run of another engine's process, as it reported it (bench/llamacpp.py). Its `seconds` (prompt +
    decode by the engine's own clock) replaces the runner's clock, which would count process start and model
    load; the wall time is kept beside it."""
    seconds: float
    wall_seconds: float
    new_tokens: int
    decode_tokens_per_s: float
    text: str
    prompt_tokens: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_forwards: int = 0


# A runner takes (prompt, max_new_tokens) and returns (token_ids, stats or None): leaplm's Stats, or
# ExternalStats for another engine's process.
Runner = Callable[[str, int], tuple[list[int], object]]


@dataclass
class Contender:
    name: str
    run: Runner
    constrained: bool = False                               # runs take structured=<the prompt's constraint>
    decode: Callable[[list[int]], str] | None = None        # token ids -> text (validity of structured outputs)
    predicted: bool = False                                 # runs take prediction=<the prompt's prediction>


def leaplm_contender(name: str, engine, params: SamplingParams, constrained: bool = False,
                     predicted: bool = False) -> Contender:
    def run(prompt: str, max_new: int, structured=None, prediction=None):
        sp = SamplingParams(**{**params.__dict__, "max_new_tokens": max_new, "structured": structured,
                               "prediction": prediction})
        engine.forget_history()          # every run is a new request: no copying of the same prompt's last answer
        o = engine.generate(prompt, sp)
        return o.token_ids, o.stats
    return Contender(name, run, constrained, lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True),
                     predicted)


def _constraint(c: Contender, w: Workload, prompt: int) -> dict:
    """The structured= (and prediction=) arguments of a constrained (predicted) contender's run on a workload that
    has constraints (predictions)."""
    out = {}
    if c.predicted:
        if w.predictions is None:
            raise ValueError(f"{c.name}: workload {w.name} has no predictions (a +prediction configuration needs "
                             f"edit, proofread, quote, agent or complete)")
        out["prediction"] = w.predictions[prompt]
    if not c.constrained:
        return out
    if w.constraints is None:
        raise ValueError(f"{c.name}: workload {w.name} has no constraints (a +schema configuration needs "
                         f"json-extract or tool-call)")
    return out | {"structured": w.constraints[prompt]}


def hf_contenders(target_path: str, draft_path: str | None, k: int, kinds: list[str], ignore_eos: bool,
                  dtype: torch.dtype = torch.float32, temperature: float = 0.0, seed: int = 0) -> list[Contender]:
    """Hugging Face generate: plain, assisted (draft model, num_assistant_tokens=K), prompt lookup (K).

    temperature > 0 samples from the whole tempered distribution (top-k and top-p off, as leaplm's defaults),
    seeded before every call; assisted generation then verifies with speculative sampling."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(**_hf_source(target_path))
    model = AutoModelForCausalLM.from_pretrained(**_hf_source(target_path), dtype=dtype).eval()
    assistant = None
    if "assisted" in kinds and draft_path:
        assistant = hf_assistant(draft_path, dtype)

    sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0
                else dict(do_sample=False))

    def make(extra: dict) -> Runner:
        def run(prompt: str, max_new: int):
            ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
            kw = dict(max_new_tokens=max_new, pad_token_id=tok.eos_token_id, **sampling, **extra)
            if ignore_eos:
                kw["min_new_tokens"] = max_new
            torch.manual_seed(seed)
            with torch.inference_mode():
                out = model.generate(**ids, **kw)
            return out[0, ids["input_ids"].shape[1]:].tolist(), None
        return run

    out = []
    if "plain" in kinds:
        out.append(Contender("hf", make({})))
    if assistant is not None:
        out.append(Contender(f"hf-assisted k={k}", make({"assistant_model": assistant, "num_assistant_tokens": k})))
    if "lookup" in kinds:
        out.append(Contender(f"hf-prompt-lookup k={k}", make({"prompt_lookup_num_tokens": k})))
    return out


def _hf_source(path: str) -> dict:
    """from_pretrained arguments for a checkpoint directory or a GGUF file (transformers dequantizes it)."""
    from pathlib import Path

    p = Path(path)
    if p.is_file():
        return dict(pretrained_model_name_or_path=str(p.parent), gguf_file=p.name)
    return dict(pretrained_model_name_or_path=path)


def hf_assistant(draft_path: str, dtype: torch.dtype):
    """The draft as a transformers assistant model; a reduced-vocabulary draft (models/draft_vocab.py) gets the
    same mapping leaplm uses (target ids in, logits over the target's vocabulary out, -inf outside)."""
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from ..models.draft_vocab import has_draft_vocab, read_d2t, t2d_table

    if not has_draft_vocab(draft_path):
        return AutoModelForCausalLM.from_pretrained(draft_path, dtype=dtype).eval()
    from transformers import LlamaForCausalLM

    d2t = read_d2t(draft_path)
    V = json.loads((Path(draft_path) / "config.json").read_text())["leaplm_draft"]["target_vocab_size"]
    t2d, cols, keep = t2d_table(d2t, V), d2t.clamp(min=0), d2t >= 0

    class MappedAssistant(LlamaForCausalLM):
        def forward(self, input_ids=None, **kw):
            out = super().forward(input_ids=t2d[input_ids], **kw)
            small = out.logits                                                  # [B, T, N]
            full = small.new_full((*small.shape[:-1], V), float("-inf"))        # [B, T, V]
            out.logits = full.index_copy_(-1, cols[keep], small[..., keep])
            return out

    m = MappedAssistant.from_pretrained(draft_path, dtype=dtype).eval()
    m.config.vocab_size = V          # generation's checks and processors see the target's vocabulary
    return m


def run_bench(contenders: list[Contender], workloads: list[Workload], max_new_tokens: int, rounds: int,
              baseline: str, on_sample: Callable[[Sample], None] | None = None) -> list[Sample]:
    samples: list[Sample] = []
    for w in workloads:                                 # warm-up: every contender once, untimed
        for c in contenders:
            c.run(w.prompts[0], min(16, max_new_tokens), **_constraint(c, w, 0))
    for r in range(rounds):
        for w in workloads:
            for pi, prompt in enumerate(w.prompts):
                shift = (r + pi) % len(contenders)
                for c in contenders[shift:] + contenders[:shift]:
                    t = time.perf_counter()
                    ids, st = c.run(prompt, max_new_tokens, **_constraint(c, w, pi))
                    dt = time.perf_counter() - t
                    s = Sample(c.name, w.name, pi, r, len(ids), dt, ids, constrained=c.constrained,
                               predicted=c.predicted)
                    s.accepted_prediction_tokens = getattr(st, "accepted_prediction_tokens", 0)
                    s.rejected_prediction_tokens = getattr(st, "rejected_prediction_tokens", 0)
                    if w.constraints is not None and c.decode is not None:
                        from .structured import valid

                        s.valid = valid(c.decode(ids), w.constraints[pi])
                    s.grammar_seconds = getattr(st, "grammar_s", 0.0)
                    s.forced_tokens = getattr(st, "forced_tokens", 0)
                    if isinstance(st, ExternalStats):
                        s.new_tokens, s.seconds, s.wall_seconds = st.new_tokens, st.seconds, st.wall_seconds
                        s.decode_tokens_per_s, s.text, s.prompt_tokens = (
                            st.decode_tokens_per_s, st.text, st.prompt_tokens)
                    elif isinstance(st, GenerationStats) and st.decode_s > 0:
                        s.decode_tokens_per_s = st.new_tokens / st.decode_s
                    if st is not None:
                        s.draft_tokens, s.accepted_tokens, s.target_forwards = (
                            st.draft_tokens, st.accepted_tokens, st.target_forwards)
                    samples.append(s)
                    if on_sample:
                        on_sample(s)
    return samples


def summarize(samples: list[Sample], baseline: str, stop_ids: frozenset[int] = frozenset(),
              constrained_baseline: str | None = None) -> list[ConfigSummary]:
    """Per (workload, config): medians and paired speedups against `baseline` (constrained configurations against
    `constrained_baseline` when given: the same outputs, so the same lengths). Greedy identity compares the
    tokens before the baseline's first id in stop_ids: runs ignore EOS, and a contender that cannot emit it (HF
    with min_new_tokens) must part from one that emits it and goes on."""
    out = []
    keyed = {(s.config, s.workload, s.prompt, s.round): s for s in samples}
    configs = list(dict.fromkeys(s.config for s in samples))
    for w in dict.fromkeys(s.workload for s in samples):
        for c in configs:
            mine = [s for s in samples if s.config == c and s.workload == w]
            if not mine:
                continue
            ratios, same = [], True
            external = any(s.text is not None for s in mine)    # text only: identity is judged by the caller
            base = constrained_baseline if mine[0].constrained and constrained_baseline else baseline
            for s in mine:
                b = keyed.get((base, w, s.prompt, s.round))
                if b is not None:
                    ratios.append(s.tokens_per_s / b.tokens_per_s)
                    n = min(len(b.token_ids), len(s.token_ids))
                    n = next((i for i, t in enumerate(b.token_ids[:n]) if t in stop_ids), n)
                    same &= b.token_ids[:n] == s.token_ids[:n]
            drafted = sum(s.draft_tokens for s in mine)
            forwards = sum(s.target_forwards for s in mine)
            out.append(ConfigSummary(
                config=c, workload=w, tokens_per_s=statistics.median(s.tokens_per_s for s in mine),
                speedup=statistics.median(ratios) if ratios else None,
                acceptance_rate=sum(s.accepted_tokens for s in mine) / drafted if drafted else None,
                mean_accepted_length=sum(s.new_tokens for s in mine) / forwards if forwards else None,
                identical=same if ratios and c != base and not external else None, samples=len(mine),
                wall_tokens_per_s=_median([s.new_tokens / s.wall_seconds for s in mine if s.wall_seconds]),
                decode_tokens_per_s=_median([s.decode_tokens_per_s for s in mine if s.decode_tokens_per_s]),
                valid_rate=(sum(bool(s.valid) for s in mine) / len(mine)
                            if any(s.valid is not None for s in mine) else None),
                grammar_ms_per_token=(1e3 * sum(s.grammar_seconds for s in mine) / max(1, sum(s.new_tokens
                                                                                              for s in mine))
                                      if mine[0].constrained else None),
                grammar_share=(sum(s.grammar_seconds for s in mine) / sum(s.seconds for s in mine)
                               if mine[0].constrained else None),
                baseline=base))
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def machine_info() -> dict:
    import os
    import platform

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}
