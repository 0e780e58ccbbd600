"""llama.cpp as a baseline in `leaplm bench --baselines llamacpp`: its own binaries on the same GGUF file, the
same prompts (as text with special tokens, tokenized by llama.cpp), greedy, the same new-token budget and thread
count, timed by llama.cpp's own timing lines (prompt + decode, load excluded) beside the whole process's wall time.

Rows: llama-completion (plain decoding), llama-lookup (prompt lookup, K drafted tokens), llama-speculative-simple
with a GGUF draft (`--spec-type draft-simple`), and llama-bench tg128 as a reference (no prompt).
llama.cpp prints text, not token ids: agreement with leaplm's greedy tokens is the number of leaplm tokens whose
decoded text is a prefix of llama.cpp's text (common_prefix_tokens).

llama.cpp writes its text and timing lines through an asynchronous logger that is never flushed at exit, so a
process can end with the tail of its output lost (exit status 0; on the embedded target's q8_0 file 2 runs in
20, and most runs of some prompts on a busy machine). A run counts only
when the last line the parser reads is there (everything queued before it was written too); a truncated run is
run again, at most MAX_ATTEMPTS times in all, and the retries are counted in the bench's JSON.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ..config import ConfigError
from .runner import Contender, ExternalStats

log = logging.getLogger(__name__)

ENV_DIR = "LEAPLM_LLAMACPP_DIR"
COMPLETION, LOOKUP, SPECULATIVE, BENCH = "llama-completion", "llama-lookup", "llama-speculative-simple", "llama-bench"
BINARIES = (COMPLETION, LOOKUP, SPECULATIVE, BENCH)


@dataclass
class LlamaCppBinaries:
    completion: Path | None          # None: not needed by the caller (find_binaries' need) and not found
    lookup: Path | None
    speculative: Path | None
    bench: Path | None
    source: str                  # where they were found: "--llamacpp-dir", "$LEAPLM_LLAMACPP_DIR" or "PATH"


def find_binaries(llamacpp_dir: str | None, env: dict | None = None, need: tuple = BINARIES) -> LlamaCppBinaries:
    """The four binaries from --llamacpp-dir, else $LEAPLM_LLAMACPP_DIR, else PATH (a directory or its bin/); those
    in `need` must be there (`bench --roofline` needs llama-bench alone)."""
    env = os.environ if env is None else env
    if llamacpp_dir or env.get(ENV_DIR):
        where, root = ("--llamacpp-dir", llamacpp_dir) if llamacpp_dir else (f"${ENV_DIR}", env[ENV_DIR])
        d = Path(root).expanduser()
        if not d.is_dir():
            raise ConfigError("llamacpp_dir", f"{where} {root!r} is not a directory")
        dirs = [d, d / "bin"]
        found = {b: next((x / b for x in dirs if (x / b).is_file() and os.access(x / b, os.X_OK)), None)
                 for b in BINARIES}
    else:
        where = "PATH"
        found = {b: (Path(p) if (p := shutil.which(b, path=env.get("PATH"))) else None) for b in BINARIES}
    missing = [b for b, p in found.items() if p is None and b in need]
    if missing:
        hint = "" if where != "PATH" else (f"; build llama.cpp (targets {', '.join(need)}) and pass "
                                            f"--llamacpp-dir or set ${ENV_DIR}")
        raise ConfigError("llamacpp_dir", f"llama.cpp's {', '.join(missing)} not found in {where}"
                                          f"{' ' + repr(llamacpp_dir or env.get(ENV_DIR)) if where != 'PATH' else ''}"
                                          f"{hint}")
    return LlamaCppBinaries(found[COMPLETION], found[LOOKUP], found[SPECULATIVE], found[BENCH], where)


# --- parsers of the binaries' output (tested on captured outputs in tests/bench/fixtures/llamacpp) ------------
class LlamaCppOutputError(RuntimeError):
    pass


class LlamaCppTruncatedOutput(LlamaCppOutputError):
    """The process exited cleanly but the closing lines the parser needs are missing: llama.cpp's logger lost the
    tail of its queue at exit. Running again is the remedy."""


MAX_ATTEMPTS = 10
_LOST_TAIL = "(llama.cpp's logger can drop the last lines at exit; the run is repeated)"


_PERF = re.compile(r"common_perf_print:\s+(prompt eval|eval|total|sampling) time\s*=\s*([\d.]+) ms"
                   r"(?:\s*/\s*(\d+) (tokens|runs))?")
_ENC = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DEC = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+|inf|nan) t/s")
_KV = re.compile(r"\b(n_drafted|n_accept|n_predict)\s*=\s*(\d+)")


@dataclass
class LlamaCppRun:
    text: str                   # generated text only (prompt echo and trailing newlines removed)
    new_tokens: int             # as llama.cpp counted them
    prompt_tokens: int
    seconds: float              # prompt + decode by llama.cpp's clock (model load excluded)
    decode_tokens_per_s: float  # llama.cpp's own decode figure
    drafted: int = 0
    accepted: int = 0


def _perf(stderr: str) -> dict[str, tuple[float, int | None]]:
    return {m.group(1): (float(m.group(2)), int(m.group(3)) if m.group(3) else None)
            for m in _PERF.finditer(stderr)}


def parse_completion(stdout: str, stderr: str) -> LlamaCppRun:
    """llama-completion -no-cnv --no-display-prompt: stdout is the generated text then "\\n\\n"; the timing lines
    say prompt eval (ms / prompt tokens) and eval (ms / runs); the first token comes from the prompt's logits,
    so runs + 1 tokens were generated."""
    perf = _perf(stderr)
    if not perf:
        raise LlamaCppTruncatedOutput(f"llama-completion: no 'prompt eval time' lines on stderr {_LOST_TAIL}")
    missing = [k for k in ("prompt eval", "eval", "total") if k not in perf]
    if missing:
        raise LlamaCppTruncatedOutput(f"llama-completion: no '{missing[0]} time' line on stderr {_LOST_TAIL}")
    (p_ms, p_tok), (e_ms, runs) = perf["prompt eval"], perf["eval"]
    seconds = perf["total"][0] / 1e3
    text = stdout[:-2] if stdout.endswith("\n\n") else stdout
    return LlamaCppRun(text, (runs or 0) + 1, p_tok or 0, seconds,
                       (runs or 0) / (e_ms / 1e3) if e_ms > 0 else float("nan"))


def _echoed(stdout: str, prompt: str, binary: str) -> str:
    """lookup / speculative-simple print "\\n\\n", the prompt's pieces, the generated text, then "\\n\\n" twice."""
    i = stdout.find(prompt)
    if i < 0:
        raise LlamaCppOutputError(f"{binary}: the prompt's echo was not found on stdout")
    text = stdout[i + len(prompt):]
    for _ in range(2):
        text = text[:-2] if text.endswith("\n\n") else text
    return text


def parse_spec(stdout: str, stderr: str, prompt: str, binary: str) -> LlamaCppRun:
    """llama-lookup and llama-speculative-simple: "encoded N tokens in S seconds", "decoded N tokens in S seconds,
    speed: X t/s", n_drafted, n_accept."""
    enc, dec = _ENC.search(stderr), _DEC.search(stderr)
    kv = {m.group(1): int(m.group(2)) for m in _KV.finditer(stderr)}
    if not enc or not dec:
        raise LlamaCppTruncatedOutput(f"{binary}: no 'encoded ... tokens' / 'decoded ... tokens' lines on stderr "
                                      f"{_LOST_TAIL}")
    missing = [k for k in ("n_drafted", "n_accept") if k not in kv]
    if missing:
        raise LlamaCppTruncatedOutput(f"{binary}: no '{missing[0]} =' line on stderr {_LOST_TAIL}")
    return LlamaCppRun(_echoed(stdout, prompt, binary), int(dec.group(1)), int(enc.group(1)),
                       float(enc.group(2)) + float(dec.group(2)), float(dec.group(3)),
                       kv["n_drafted"], kv["n_accept"])


@dataclass
class BenchFigure:
    n_gen: int
    tokens_per_s: float         # llama-bench's avg_ts
    stddev: float
    repetitions: int
    model_type: str


def parse_llama_bench(stdout: str) -> BenchFigure:
    """llama-bench -o json: one object per test; the generation test (n_prompt 0)."""
    try:
        rows = json.loads(stdout)
    except json.JSONDecodeError as e:
        raise LlamaCppOutputError(f"llama-bench: stdout is not JSON ({e})") from None
    gen = [r for r in rows if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    if not gen:
        raise LlamaCppOutputError("llama-bench: no generation test (n_gen > 0, n_prompt 0) in the JSON")
    r = gen[0]
    return BenchFigure(r["n_gen"], float(r["avg_ts"]), float(r["stddev_ts"]), len(r.get("samples_ts", [])),
                       r.get("model_type", ""))


def common_prefix_tokens(tokenizer, ref_ids: list[int], text: str) -> int:
    """How many of leaplm's tokens `ref_ids` llama.cpp's `text` reproduces: the largest n such that the decoded
    text of ref_ids[:n] is a prefix of text (a token ending inside a UTF-8 character is judged with the next)."""
    n = 0
    for i in range(1, len(ref_ids) + 1):
        piece = tokenizer.decode(ref_ids[:i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if piece.endswith("\ufffd"):            # an incomplete multi-byte character: wait for its last byte
            continue
        if not text.startswith(piece):
            break
        n = i
    return n


# --- running the binaries --------------------------------------------------------------------------------------
@dataclass
class LlamaCppSetup:
    binaries: LlamaCppBinaries
    model: str                  # GGUF file llama.cpp runs
    threads: int
    context: int
    draft: str | None = None    # GGUF draft for llama-speculative-simple
    no_repack: bool = False     # set by probe_repack when the repacked path dies here
    retries: int = 0            # runs repeated because llama.cpp's output lost its tail (LlamaCppTruncatedOutput)


def _common_args(s: LlamaCppSetup, prompt_file: str, max_new: int) -> list[str]:
    args = ["-m", s.model, "-bf", prompt_file, "--no-escape", "-n", str(max_new), "-t", str(s.threads),
            "-tb", str(s.threads), "-c", str(s.context), "--temp", "0", "--ignore-eos"]
    return args + (["--no-repack"] if s.no_repack else [])


def completion_command(s: LlamaCppSetup, prompt_file: str, max_new: int) -> list[str]:
    return [str(s.binaries.completion), *_common_args(s, prompt_file, max_new), "-no-cnv", "--no-display-prompt"]


def lookup_command(s: LlamaCppSetup, prompt_file: str, max_new: int, k: int) -> list[str]:
    return [str(s.binaries.lookup), *_common_args(s, prompt_file, max_new), "--spec-draft-n-max", str(k)]


def speculative_command(s: LlamaCppSetup, prompt_file: str, max_new: int, k: int) -> list[str]:
    return [str(s.binaries.speculative), *_common_args(s, prompt_file, max_new), "-md", s.draft,
            "--spec-type", "draft-simple", "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
            "--spec-draft-p-min", "0", "-td", str(s.threads), "-tbd", str(s.threads)]


def llama_bench_command(s: LlamaCppSetup, n_gen: int = 128, repetitions: int = 3) -> list[str]:
    return [str(s.binaries.bench), "-m", s.model, "-p", "0", "-n", str(n_gen), "-t", str(s.threads),
            "-r", str(repetitions), "-o", "json", "--repack", "0" if s.no_repack else "1"]


def llama_bench_pp1_command(binaries: LlamaCppBinaries, model: str, threads: int, repetitions: int = 10) -> list[str]:
    """llama-bench's prompt processing of one token (its one-token forward, the output projection included), with
    its repacked weight layouts as it runs by default."""
    return [str(binaries.bench), "-m", model, "-p", "1", "-n", "0", "-t", str(threads), "-r", str(repetitions),
            "-o", "json"]


def llama_bench_ms(cmd: list[str]) -> float:
    """ms per token of a llama-bench run with one test (its mean tokens/s)."""
    out, _, _ = _run(cmd, timeout=300)
    try:
        return 1e3 / float(json.loads(out)[0]["avg_ts"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise LlamaCppOutputError(f"llama-bench printed no result: {out[-200:]!r}") from None


def _run(cmd: list[str], timeout: float = 900) -> tuple[str, str, float]:
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LlamaCppOutputError(f"{Path(cmd[0]).name} did not finish in {timeout:.0f} s") from None
    wall = time.perf_counter() - t
    out, err = p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
    if p.returncode != 0:
        why = f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit status {p.returncode}"
        tail = " | ".join(err.strip().splitlines()[-3:])
        raise LlamaCppOutputError(f"{Path(cmd[0]).name} failed ({why}): {tail}")
    return out, err, wall


def run_parsed(cmd: list[str], parse, s: LlamaCppSetup) -> tuple[LlamaCppRun, float]:
    """Run `cmd` and parse its (stdout, stderr); a run whose output lost its tail is run again (counted in
    s.retries), up to MAX_ATTEMPTS runs in all."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        out, err, wall = _run(cmd)
        try:
            return parse(out, err), wall
        except LlamaCppTruncatedOutput as e:
            if attempt == MAX_ATTEMPTS:
                raise LlamaCppOutputError(f"{e} (truncated in all {MAX_ATTEMPTS} runs)") from None
            s.retries += 1
            log.warning("%s; running it again (%d of %d)", e, attempt + 1, MAX_ATTEMPTS)
    raise AssertionError("unreachable")


def probe_repack(s: LlamaCppSetup, prompt_file: str) -> None:
    """Run two tokens with weight repacking on; if the process dies (e.g. SIGILL from AMX tiles that cpuid
    advertises but the VM does not run), use --no-repack for every run and say so."""
    try:
        _run(completion_command(s, prompt_file, 2), timeout=300)
    except LlamaCppOutputError as e:
        log.warning("llama.cpp with weight repacking failed (%s); running with --no-repack", e)
        s.no_repack = True


def llamacpp_contenders(s: LlamaCppSetup, k: int, workdir: str) -> list[Contender]:
    """Plain, prompt lookup (K), and speculative with s.draft (K): each run is one process on one prompt."""
    def make(kind: str):
        def run(prompt: str, max_new: int):
            with tempfile.NamedTemporaryFile("wb", suffix=".txt", dir=workdir, delete=False) as f:
                f.write(prompt.encode("utf-8"))
            if kind == "plain":
                cmd, parse = completion_command(s, f.name, max_new), parse_completion
            elif kind == "lookup":
                cmd, parse = lookup_command(s, f.name, max_new, k), partial(parse_spec, prompt=prompt, binary=LOOKUP)
            else:
                cmd = speculative_command(s, f.name, max_new, k)
                parse = partial(parse_spec, prompt=prompt, binary=SPECULATIVE)
            try:
                r, wall = run_parsed(cmd, parse, s)
            finally:
                os.unlink(f.name)
            # one target forward per step; a step emits its accepted tokens plus one
            return [], ExternalStats(seconds=r.seconds, wall_seconds=wall, new_tokens=r.new_tokens,
                                     decode_tokens_per_s=r.decode_tokens_per_s, text=r.text,
                                     prompt_tokens=r.prompt_tokens, draft_tokens=r.drafted,
                                     accepted_tokens=r.accepted, target_forwards=r.new_tokens - r.accepted)
        return run

    out = [Contender("llama.cpp", make("plain")), Contender(f"llama.cpp lookup k={k}", make("lookup"))]
    if s.draft:
        out.append(Contender(f"llama.cpp draft k={k}", make("draft")))
    return out


def run_llama_bench(s: LlamaCppSetup, n_gen: int = 128, repetitions: int = 3) -> BenchFigure:
    out, _, _ = _run(llama_bench_command(s, n_gen, repetitions))
    return parse_llama_bench(out)


def judge_identity(summaries, samples, tokenizer, baseline: str, stop_ids: set[int]) -> None:
    """Fill identical / common_prefix* of the rows whose samples are text (llama.cpp's): how many of the baseline's
    greedy tokens each text reproduces. Tokens are compared up to the baseline's first stop token: llama.cpp's
    --ignore-eos bans end-of-generation tokens, where leaplm's ignore_eos emits them and goes on."""
    import statistics

    keyed = {(s.config, s.workload, s.prompt, s.round): s for s in samples}
    for summ in summaries:
        mine = [s for s in samples if s.config == summ.config and s.workload == summ.workload and s.text is not None]
        prefixes, compared = [], []
        for s in mine:
            b = keyed.get((baseline, s.workload, s.prompt, s.round))
            if b is None:
                continue
            ref = b.token_ids[:next((i for i, t in enumerate(b.token_ids) if t in stop_ids), len(b.token_ids))]
            prefixes.append(common_prefix_tokens(tokenizer, ref, s.text))
            compared.append(len(ref))
        if prefixes:
            summ.common_prefix, summ.common_prefix_min = statistics.median(prefixes), min(prefixes)
            summ.compared_tokens = statistics.median(compared)
            summ.identical = all(p == c for p, c in zip(prefixes, compared))


def prompt_token_mismatches(samples, tokenizer, bos_id: int | None, prompts: dict[tuple[str, int], str]) -> list[str]:
    """Prompts llama.cpp tokenized into a different number of tokens than leaplm (named workload#index)."""
    from ..models.tokens import encode_prompt

    bad = {}
    for s in samples:
        if s.prompt_tokens is None:
            continue
        n = len(encode_prompt(tokenizer, prompts[(s.workload, s.prompt)], bos_id))
        if s.prompt_tokens != n:
            bad[f"{s.workload}#{s.prompt}"] = f"{s.workload}#{s.prompt} ({s.config}: {s.prompt_tokens} vs leaplm {n})"
    return list(bad.values())
