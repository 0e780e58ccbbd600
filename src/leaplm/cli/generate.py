"""`leaplm generate`: one prompt through the engine, text on stdout, acceptance and speed on stderr."""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
from typing import Optional

import typer

from ..config import ConfigError, SamplingParams, StructuredOutput
from .aliases import ALIAS_FLAGS, check_llama_cpp_only, check_samples, parse_speculative_config
from .common import (ADAPTIVE_K, DRAFT, DRAFT_MIN, K, N_GPU_LAYERS, SPECULATIVE_CONFIG, EngineOptions, engine_options,
                     err, fail, set_threads, write)


def _skip_layers(text: Optional[str]) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"--skip-layers: expected comma-separated layer indices, got {text!r}")


def _compare(engine, prompt: str, shown: str, params: SamplingParams, rounds: int = 2) -> None:
    """Plain decoding (method none, the same loaded target) and the engine's method on the same request, each run
    `rounds` times interleaved after a short warm-up (the faster run of each is shown): the text once, then both
    side by side."""
    from ..engine.engine import Engine

    plain = Engine(model=engine.target, method="none", max_model_len=engine.max_model_len)
    warm = dataclasses.replace(params, max_new_tokens=min(8, params.max_new_tokens))
    plain.generate(prompt, warm)
    engine.generate(prompt, warm)
    best: dict[str, object] = {}
    for _ in range(rounds):
        for name, e in (("none", plain), ("spec", engine)):
            o = e.generate(prompt, params)
            if name not in best or o.stats.decode_s < best[name].stats.decode_s:
                best[name] = o
    a, b = best["none"], best["spec"]
    write(shown + b.text + "\n")
    sa, sb = a.stats, b.stats
    label = f"{sb.method} k={sb.k}" + (" adaptive" if engine.spec.adaptive_k else "")
    rows = [("", "none", label),
            ("tokens/s", f"{sa.tokens_per_s:.1f}", f"{sb.tokens_per_s:.1f}"),
            ("target forwards", str(sa.target_forwards), str(sb.target_forwards)),
            ("mean accepted length", f"{sa.mean_accepted_length:.2f}", f"{sb.mean_accepted_length:.2f}"),
            ("steps that drafted", "-", f"{sb.steps_with_draft} of {sb.target_forwards}"),
            ("acceptance", "-", f"{sb.acceptance_rate:.2f}")]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    for r in rows:
        write(f"{r[0]:<{w0}}  {r[1]:>{w1}}  {r[2]}\n")
    speedup = sb.tokens_per_s / sa.tokens_per_s if sa.tokens_per_s else 0.0
    same = "yes" if a.token_ids == b.token_ids else "no"
    if not params.greedy and params.seed is None:
        same += " (sampled without --seed: each run draws its own text)"
    write(f"speedup: {speedup:.2f}x | identical: {same} | {sa.new_tokens} tokens, "
          f"faster of {rounds} runs each, interleaved | backend {engine.backend}\n")


def _structured(json_schema: Optional[str], regex: Optional[str], grammar: Optional[str],
                choice: Optional[list[str]]) -> StructuredOutput | None:
    """The constraint the flags ask for (at most one of them); errors name the flag."""
    given = [f for f, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar),
                            ("--choice", choice)) if v]
    if not given:
        return None
    if len(given) > 1:
        fail(f"{given[1]}: give one of --json-schema, --regex, --grammar, --choice; got {', '.join(given)}")
    flag = given[0]
    kw: dict = {}
    if flag in ("--json-schema", "--grammar"):
        path = json_schema or grammar
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            fail(f"{flag}: cannot read {path!r} ({e.strerror or e})")
        kw = {"json": text} if flag == "--json-schema" else {"grammar": text}
    else:
        kw = {"regex": regex} if flag == "--regex" else {"choice": list(choice)}
    try:
        return StructuredOutput(**kw)
    except ConfigError as e:
        fail(f"{flag}: {e.message}")


@engine_options()
def generate(
    prompt: Optional[str] = typer.Argument(None, help="Prompt text; read from stdin when omitted."),
    draft: Optional[str] = DRAFT,
    method: Optional[str] = typer.Option(None, help="none|draft|ngram|suffix|lookahead|layerskip|eagle|medusa "
                                                    "(default: draft when a draft is known, else none)."),
    head: Optional[str] = typer.Option(None, "--head", help="eagle/medusa: head directory or a shipped head's "
                                                            "name, e.g. eagle-smollm2 (default: the head shipped "
                                                            "for the target)."),
    k: int = K,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "--max-tokens", "--n-predict"),
    temperature: float = typer.Option(0.0, help="0 = greedy (the default here), > 0 samples."),
    top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(1.0, "--top-p"),
    min_p: float = typer.Option(0.0, "--min-p"),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty"),
    seed: Optional[int] = typer.Option(None, help="Seed; sample i of --samples uses seed + i."),
    verifier: str = typer.Option("auto", "--verifier",
                                 help="Sampled requests: rejection (keeps the most drafts), race (the output depends "
                                      "on the seed alone, whatever K), auto (race with --seed, else rejection)."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    samples: int = typer.Option(1, "--samples", help="Independent samples of the same prompt (1..128; vLLM's n), "
                                                     "decoded as the rows of one batch."),
    n: Optional[int] = typer.Option(None, "-n", help="vLLM's spelling of --samples (up to 16: llama.cpp's -n is "
                                                     "--max-new-tokens here)."),
    stream: bool = typer.Option(False, help="Print text as it is generated."),
    as_json: bool = typer.Option(False, "--json", help="Print exactly one JSON object."),
    chat: bool = typer.Option(False, "--chat", help="PROMPT is a user message: apply the model's chat template."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    json_schema: Optional[str] = typer.Option(None, "--json-schema", help="Structured output: a JSON Schema file "
                                              "the output follows (docs/structured-output.md)."),
    regex: Optional[str] = typer.Option(None, "--regex", help="Structured output: a regular expression the output "
                                        "matches."),
    grammar: Optional[str] = typer.Option(None, "--grammar", help="Structured output: a grammar file (Lark, "
                                          "llguidance's dialect, or GBNF) the output follows."),
    choice: Optional[list[str]] = typer.Option(None, "--choice", help="Structured output: the output is one of "
                                               "these strings (repeatable)."),
    prediction: Optional[str] = typer.Option(None, "--prediction", help="Predicted Outputs: a text file the output "
                                             "is expected to repeat largely (the file an edit rewrites); its tokens "
                                             "are drafted where the output follows it (the output is the same)."),
    adaptive_k: bool = ADAPTIVE_K,
    ngram_min: int = typer.Option(1, "--ngram-min"),
    ngram_max: int = typer.Option(4, "--ngram-max"),
    window: int = typer.Option(5, "--window", help="lookahead: Jacobi window W."),
    ngram_size: int = typer.Option(4, "--ngram-size", help="lookahead: n-gram size N."),
    guess_set: int = typer.Option(5, "--guess-set", help="lookahead: candidates G per step."),
    skip_layers: Optional[str] = typer.Option(None, "--skip-layers", help="layerskip: e.g. 2,4,6 (default: searched)."),
    skip_confidence: float = typer.Option(0.5, "--skip-confidence",
                                          help="layerskip: stop drafting when the draft's top probability drops below this."),
    corpus: Optional[str] = typer.Option(None, "--corpus", help="suffix: extra text file or directory."),
    speculative_config: Optional[str] = SPECULATIVE_CONFIG,
    draft_min: Optional[int] = DRAFT_MIN,
    n_gpu_layers: Optional[int] = N_GPU_LAYERS,
    compare: bool = typer.Option(False, "--compare", help="Also decode the prompt plainly (method none, the same "
                                 "model) and print both side by side: speed, target forwards, identical text."),
    startup: bool = typer.Option(False, "--startup", help="Report the time to the first token and its parts "
                                 "(import, load, checks, prefill, first token) and the peak RSS (docs/startup.md)."),
    allow_synthetic: bool = typer.Option(False, "--allow-synthetic", help="Generate from a random-weight file "
                                         "(`leaplm models synth`): its text is noise."),
    *, options: EngineOptions,
):
    """Generate a continuation of PROMPT, with speculation, and report acceptance and speed."""
    from .startup import StartupClock

    clock = StartupClock() if startup else None
    from ..engine.engine import Engine
    from ..engine.stats import GenerationStats

    logging.basicConfig(level=logging.WARNING)
    set_threads(options.threads)
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            fail("prompt: give PROMPT or pipe it on stdin")
        prompt = sys.stdin.read()
    try:
        from ..models.synth import refuse_synthetic

        refuse_synthetic(options.model, allow_synthetic)
        n = check_samples(n, samples)
        check_llama_cpp_only(draft_min, n_gpu_layers)
        sc = parse_speculative_config(speculative_config)
    except ConfigError as e:
        fail(f"{ALIAS_FLAGS.get(e.field, '--' + e.field.replace('_', '-'))}: {e.message}")
    if startup and (n > 1 or compare):
        fail(f"--startup: times one request; not with {'--compare' if compare else '-n ' + str(n)}")
    method, draft = sc.method or method, sc.draft or draft
    k = sc.k if sc.k is not None else k
    ngram_min = sc.ngram_min if sc.ngram_min is not None else ngram_min
    ngram_max = sc.ngram_max if sc.ngram_max is not None else ngram_max
    structured = _structured(json_schema, regex, grammar, choice)
    predicted = None
    if prediction is not None:
        try:
            with open(prediction, encoding="utf-8") as f:
                predicted = f.read()
        except (OSError, UnicodeError) as e:
            fail(f"--prediction: cannot read {prediction!r} ({getattr(e, 'strerror', None) or e})")
    try:
        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                 min_p=min_p, repetition_penalty=repetition_penalty,
                                 seed=None if seed is None else seed + i, stop=list(stop or []),
                                 ignore_eos=ignore_eos, verifier=verifier, structured=structured,
                                 prediction=predicted)
                  for i in range(n)]
        spec_options = dict(adaptive_k=adaptive_k, ngram_min=ngram_min, ngram_max=ngram_max, window=window,
                            ngram_size=ngram_size, guess_set=guess_set, skip_layers=_skip_layers(skip_layers),
                            skip_confidence=skip_confidence, corpus=corpus)
        engine = Engine(config=options.engine_config(draft=draft, method=method, k=k, head=head,
                                                     spec_options=spec_options))
        if clock:
            clock.mark("engine")
        if chat:                          # a user message, through the model's chat template (engine/prepare.py)
            prompt = [{"role": "user", "content": prompt}]
        prepared = engine.prepare(prompt, params[0])
    except ConfigError as e:
        fail(f"--{e.field.replace('_', '-')}: {e.message}" if e.field != "prompt" else f"prompt: {e.message}")
    shown = "" if chat else prompt       # a chat prints the answer only, not the template around it
    if compare:
        if n > 1 or stream or as_json:
            fail(f"--compare: runs one request at a time and prints a table; not with "
                 f"{'-n ' + str(n) if n > 1 else '--stream' if stream else '--json'}")
        if engine.spec.method == "none":
            fail("--compare: compares plain decoding with a speculative method; --method none has nothing to compare")
        _compare(engine, prompt, shown, params[0])
        return
    total = GenerationStats(engine.spec.method, engine.spec.k if engine.spec.method != "none" else 0)
    samples = []
    # --samples N: the N samples are the N rows of one batch (one batched target forward per step), printed in order
    batched = engine.generate_batch(prompt, params) if n > 1 else None
    for i, sp in enumerate(params):
        printing = stream and not as_json
        if (printing or clock) and batched is None:     # one sample, chunk by chunk: the prepared request
            if printing:
                write(shown)
            text, ids, reason, st = "", [], None, None
            if clock:
                clock.mark("run")
            for chunk in engine.stream(prepared):
                if clock and "first" not in clock.marks:
                    clock.mark("first")
                if printing:
                    write(chunk.text)
                text += chunk.text
                ids += chunk.token_ids
                reason, st = chunk.finish_reason or reason, chunk.stats or st
            if printing:
                write("\n")
            elif not as_json:
                write(shown + text + "\n")
        else:
            o = batched[i] if batched is not None else engine.generate(prepared)
            text, ids, reason, st = o.text, o.token_ids, o.finish_reason, o.stats
            if not as_json:
                if n > 1:
                    write(f"--- sample {i + 1} ---\n")
                write(shown + text + "\n")
        samples.append({"text": text, "token_ids": ids, "finish_reason": reason})
        total.merge(st)
    if batched is not None:             # the rows decoded side by side: the batch's time, not the sum of its rows'
        total.decode_s = max(o.stats.decode_s for o in batched)
    report = None
    if clock:
        clock.mark("end")
        clock.marks.setdefault("first", clock.marks["end"])      # no token came out (an empty answer)
        report = clock.report(engine, total.prefill_s)
    if as_json:
        s = total
        print(json.dumps({"samples": samples, **({"startup": report.to_dict()} if report else {}), "stats": {
            "method": s.method, "k": s.k, "new_tokens": s.new_tokens, "target_forwards": s.target_forwards,
            "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
            "acceptance_rate": round(s.acceptance_rate, 4), "mean_accepted_length": round(s.mean_accepted_length, 4),
            "decode_s": round(s.decode_s, 4), "tokens_per_s": round(s.tokens_per_s, 2),
            "prefill_s": round(s.prefill_s, 4),
            **{f: round(getattr(s, f), 6) for f in ("propose_s", "score_s", "verify_s", "commit_s", "grammar_s")},
            "forced_tokens": s.forced_tokens, "forced_accepted": s.forced_accepted,
            "accepted_prediction_tokens": s.accepted_prediction_tokens,
            "rejected_prediction_tokens": s.rejected_prediction_tokens,
            "acceptance_by_position": [round(a, 4) for a in
                                                                            s.acceptance_by_position],
            "prompt_token_ids": prepared.ids, "max_model_len": engine.max_model_len,
            "kv_cache_peak_bytes": engine.kv_cache_peak_bytes,
            "backend": engine.backend, "backend_reason": engine.backend_reason, "exactness": engine.exactness}}))
    else:
        s = total
        spec = f"{s.method} k={s.k}" if s.method != "none" else "none"
        if s.method != "none" and engine.spec.adaptive_k:    # how often adaptive K chose to draft at all
            spec += f" (adaptive: drafted in {s.steps_with_draft} of {s.target_forwards} steps)"
        acc = (f" | acceptance {s.acceptance_rate:.2f} | mean accepted length {s.mean_accepted_length:.2f}"
               if s.method != "none" or predicted else "")
        if predicted:
            acc += (f" | prediction tokens accepted {s.accepted_prediction_tokens}, rejected "
                    f"{s.rejected_prediction_tokens}")
        err.print(f"[dim]backend {engine.backend}: {engine.backend_reason}[/]")
        err.print(f"[dim]{spec} | {s.new_tokens} tokens in {s.target_forwards} target forwards{acc} | "
                  f"{s.tokens_per_s:.1f} tokens/s | backend {engine.backend}"
                  f"{'' if engine.exactness == 'identical' else ' (' + engine.exactness + ')'}[/]")
        if report:
            for line in report.lines():
                err.print(line, markup=False, highlight=False)
