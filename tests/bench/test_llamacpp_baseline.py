"""bench --baselines llamacpp without llama.cpp: finding the binaries, parsing their output (captured from the
real binaries of this build, tests/bench/fixtures/llamacpp: SmolLM2-135M-Instruct Q4_1, one chat prompt, 1
thread), judging identity from text, and the whole CLI path against stand-in binaries that print the same format."""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from leaplm.bench import llamacpp as lc
from leaplm.bench.runner import Sample, summarize
from leaplm.cli import app
from leaplm.config import ConfigError

FIX = Path(__file__).parent / "fixtures" / "llamacpp"


def _fix(name: str) -> str:
    return (FIX / name).read_text(encoding="utf-8")


# --- discovery ---------------------------------------------------------------------------------------------------
def _fake_dir(d: Path, names=lc.BINARIES) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / n).write_text("#!/bin/sh\n")
        (d / n).chmod(0o755)
    return d


def test_find_binaries_option_env_path_and_bin_subdir(tmp_path):
    a = _fake_dir(tmp_path / "a")
    assert lc.find_binaries(str(a), env={}).completion == a / lc.COMPLETION
    b = _fake_dir(tmp_path / "b" / "bin")                        # a build tree: the binaries in bin/
    found = lc.find_binaries(None, env={lc.ENV_DIR: str(tmp_path / "b")})
    assert found.lookup == b / lc.LOOKUP and found.source == f"${lc.ENV_DIR}"
    assert lc.find_binaries(str(a), env={lc.ENV_DIR: str(tmp_path / "b")}).bench == a / lc.BENCH   # option wins
    assert lc.find_binaries(None, env={"PATH": str(a)}).speculative == a / lc.SPECULATIVE


def test_find_binaries_refuses_naming_the_option_and_what_is_missing(tmp_path):
    with pytest.raises(ConfigError) as e:
        lc.find_binaries(str(tmp_path / "nope"), env={})
    assert e.value.field == "llamacpp_dir" and "--llamacpp-dir" in e.value.message
    part = _fake_dir(tmp_path / "part", names=(lc.COMPLETION, lc.BENCH))
    with pytest.raises(ConfigError) as e:
        lc.find_binaries(str(part), env={})
    assert "llama-lookup" in e.value.message and "llama-speculative-simple" in e.value.message
    assert "llama-completion" not in e.value.message
    only = lc.find_binaries(str(part), env={}, need=(lc.BENCH,))         # bench --roofline needs llama-bench alone
    assert only.bench == part / lc.BENCH and only.lookup is None
    with pytest.raises(ConfigError) as e:
        lc.find_binaries(str(_fake_dir(tmp_path / "nobench", names=(lc.COMPLETION,))), env={}, need=(lc.BENCH,))
    assert "llama-bench" in e.value.message and "llama-lookup" not in e.value.message
    with pytest.raises(ConfigError) as e:
        lc.find_binaries(None, env={"PATH": str(tmp_path / "empty")})
    assert "PATH" in e.value.message and "--llamacpp-dir" in e.value.message and lc.ENV_DIR in e.value.message


def test_bench_cli_refuses_missing_llamacpp_and_unknown_baselines(tmp_path, monkeypatch):
    monkeypatch.delenv(lc.ENV_DIR, raising=False)
    res = CliRunner().invoke(app, ["bench", "--baselines", "llamacpp", "--llamacpp-dir", str(tmp_path / "none")])
    assert res.exit_code == 2 and "--llamacpp-dir" in res.output
    res = CliRunner().invoke(app, ["bench", "--baselines", "hf,vllm"])
    assert res.exit_code == 2 and "--baselines" in res.output and "vllm" in res.output


# --- parsers on captured outputs -----------------------------------------------------------------------------------
def test_parse_completion_captured():
    r = lc.parse_completion(_fix("completion.stdout"), _fix("completion.stderr"))
    # -n 20: 19 eval runs after the prompt, whose logits gave the first token
    assert r.new_tokens == 20 and r.prompt_tokens == 46
    assert r.seconds == pytest.approx(1.88446)                             # "total time = 1884.46 ms"
    assert r.decode_tokens_per_s == pytest.approx(19 / 0.72203)
    assert r.text.startswith("```python\ndef add(a, b):") and not r.text.endswith("\n\n")


def test_parse_lookup_and_speculative_captured():
    prompt = _fix("prompt.txt")
    plain = lc.parse_completion(_fix("completion.stdout"), _fix("completion.stderr")).text
    lk = lc.parse_spec(_fix("lookup.stdout"), _fix("lookup.stderr"), prompt, lc.LOOKUP)
    sp = lc.parse_spec(_fix("speculative.stdout"), _fix("speculative.stderr"), prompt, lc.SPECULATIVE)
    assert (lk.new_tokens, lk.prompt_tokens, lk.drafted, lk.accepted) == (21, 46, 4, 1)
    assert (sp.new_tokens, sp.prompt_tokens, sp.drafted, sp.accepted) == (21, 46, 66, 3)
    assert lk.seconds == pytest.approx(0.776 + 0.904) and lk.decode_tokens_per_s == pytest.approx(23.219)
    # the same greedy target in three binaries: their texts agree over the shortest (20 tokens, 21 tokens)
    assert lk.text.startswith(plain) and sp.text == lk.text
    assert prompt not in lk.text


def test_parsers_refuse_output_without_timing_lines():
    with pytest.raises(lc.LlamaCppOutputError, match="eval time"):
        lc.parse_completion("text\n\n", "no timings here")
    with pytest.raises(lc.LlamaCppOutputError, match="prompt's echo"):
        lc.parse_spec(_fix("lookup.stdout"), _fix("lookup.stderr"), "a prompt it never saw", lc.LOOKUP)
    with pytest.raises(lc.LlamaCppOutputError, match="encoded"):
        lc.parse_spec("\n\nx", "", "x", lc.LOOKUP)
    with pytest.raises(lc.LlamaCppOutputError, match="JSON"):
        lc.parse_llama_bench("| model | size |")


def test_parsers_call_output_that_lost_its_tail_truncated():
    # captured from llama-completion and llama-lookup on the embedded target (export-gguf, q8_0), exit status 0:
    # llama.cpp's logger is not flushed at exit, so the text's end and every timing line can be missing
    with pytest.raises(lc.LlamaCppTruncatedOutput, match="prompt eval time"):
        lc.parse_completion(_fix("completion-truncated.stdout"), _fix("completion-truncated.stderr"))
    with pytest.raises(lc.LlamaCppTruncatedOutput, match="decoded"):
        lc.parse_spec(_fix("lookup-truncated.stdout"), _fix("lookup-truncated.stderr"),
                      _fix("lookup-truncated.prompt.txt"), lc.LOOKUP)
    # a tail cut after some of the lines the parsers read: still truncated, never a figure with a default in it
    lines = _fix("completion.stderr").splitlines(keepends=True)
    cut = "".join(lines[:next(i for i, x in enumerate(lines) if "total time" in x)])
    with pytest.raises(lc.LlamaCppTruncatedOutput, match="'total time'"):
        lc.parse_completion(_fix("completion.stdout"), cut)
    lines = _fix("lookup.stderr").splitlines(keepends=True)
    cut = "".join(lines[:next(i for i, x in enumerate(lines) if "n_accept" in x)])
    with pytest.raises(lc.LlamaCppTruncatedOutput, match="n_accept"):
        lc.parse_spec(_fix("lookup.stdout"), cut, _fix("prompt.txt"), lc.LOOKUP)


TRUNCATING = r'''
import sys, pathlib
count = pathlib.Path(sys.argv[0]).with_suffix(".count")
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
sys.stdout.write(" t t t\n\n")
if n < int(sys.argv[-1]):                                # the first runs lose their tail, as llama.cpp's can
    sys.stderr.write("generate: n_ctx = 64\n")
    sys.exit(0)
sys.stderr.write("common_perf_print: prompt eval time =    1.00 ms /  4 tokens (x)\n"
                 "common_perf_print:        eval time =    4.00 ms /  2 runs   (x)\n"
                 "common_perf_print:       total time =    5.00 ms /  7 tokens\n")
'''


@pytest.mark.parametrize("truncated_runs", [0, 2, lc.MAX_ATTEMPTS])
def test_a_truncated_run_is_run_again_and_counted(tmp_path, truncated_runs):
    exe = tmp_path / "llama-completion"
    exe.write_text(f"#!{sys.executable}\n{TRUNCATING}")
    exe.chmod(0o755)
    s = lc.LlamaCppSetup(lc.find_binaries(str(_fake_dir(tmp_path, lc.BINARIES[1:])), env={}), "m.gguf", 1, 64)
    cmd = [str(exe), str(truncated_runs)]
    if truncated_runs == lc.MAX_ATTEMPTS:
        with pytest.raises(lc.LlamaCppOutputError, match=f"truncated in all {lc.MAX_ATTEMPTS} runs"):
            lc.run_parsed(cmd, lc.parse_completion, s)
    else:
        r, wall = lc.run_parsed(cmd, lc.parse_completion, s)
        assert (r.new_tokens, r.seconds, r.text) == (3, 0.005, " t t t") and wall > 0
    assert s.retries == min(truncated_runs, lc.MAX_ATTEMPTS - 1)
    assert int(exe.with_suffix(".count").read_text()) == min(truncated_runs + 1, lc.MAX_ATTEMPTS)


def test_parse_llama_bench_captured():
    f = lc.parse_llama_bench(_fix("bench.json"))
    assert (f.n_gen, f.repetitions, f.model_type) == (16, 2, "llama 256M Q4_1")
    assert f.tokens_per_s == pytest.approx(70.076385)


# --- identity from text --------------------------------------------------------------------------------------------
def test_common_prefix_tokens_counts_reproduced_tokens(byte_tokenizer):
    text = "déjà vu, the quick brown fox"
    ids = byte_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert lc.common_prefix_tokens(byte_tokenizer, ids, text) == len(ids)
    assert lc.common_prefix_tokens(byte_tokenizer, ids, text + " and more") == len(ids)
    cut = "déjà vu, the quick"
    n = lc.common_prefix_tokens(byte_tokenizer, ids, cut + " red")
    assert byte_tokenizer.decode(ids[:n]) == cut[:len(byte_tokenizer.decode(ids[:n]))]
    assert not (cut + " red").startswith(byte_tokenizer.decode(ids[:n + 1]))          # n is the largest
    assert lc.common_prefix_tokens(byte_tokenizer, ids, "x" + text) == 0


def test_judge_identity_stops_at_the_baselines_first_eos(byte_tokenizer):
    eos = byte_tokenizer.eos_token_id
    a = byte_tokenizer("the quick brown", add_special_tokens=False)["input_ids"]
    b = byte_tokenizer(" fox", add_special_tokens=False)["input_ids"]
    ref = a + [eos] + b                       # leaplm emits EOS and goes on; llama.cpp's --ignore-eos bans it
    samples = [Sample("none", "w", 0, 0, 9, 1.0, ref),
               Sample("llama.cpp", "w", 0, 0, 9, 0.5, [], text="the quick brown cat"),
               Sample("none", "w", 1, 0, 9, 1.0, a),
               Sample("llama.cpp", "w", 1, 0, 9, 0.5, [], text="the quick")]
    summ = summarize(samples, "none")
    ext = next(s for s in summ if s.config == "llama.cpp")
    assert ext.identical is None and ext.speedup == 2.0          # text rows are not judged by token ids
    lc.judge_identity(summ, samples, byte_tokenizer, "none", {eos})
    short = lc.common_prefix_tokens(byte_tokenizer, a, "the quick")
    assert ext.compared_tokens == len(a) and ext.common_prefix_min == short < len(a)
    assert ext.identical is False
    lc.judge_identity(summ, samples[:2], byte_tokenizer, "none", {eos})
    assert ext.identical is True and ext.common_prefix == len(a)


# --- the CLI path against stand-in binaries --------------------------------------------------------------------
FAKE = r'''
import json, sys
name = sys.argv[0].rsplit("/", 1)[-1]
a = sys.argv[1:]
opt = lambda k: a[a.index(k) + 1] if k in a else None
if name == "llama-bench":
    print(json.dumps([{"n_prompt": 0, "n_gen": int(opt("-n")), "avg_ts": 123.5, "stddev_ts": 1.5,
                       "samples_ts": [122.0, 125.0], "model_type": "fake"}]))
    sys.exit(0)
assert "-md" not in a or opt("--spec-type") == "draft-simple"
prompt = open(opt("-bf"), "rb").read().decode()
if "CRASH" in prompt and "--no-repack" not in a:
    import os, signal
    os.kill(os.getpid(), signal.SIGILL)
n = int(opt("-n"))
text = " t" * n
if name == "llama-completion":
    sys.stdout.write(text + "\n\n")
    sys.stderr.write("common_perf_print: prompt eval time =    1.00 ms /  %d tokens (x)\n" % len(prompt))
    sys.stderr.write("common_perf_print:        eval time =    4.00 ms /  %d runs   (x)\n" % (n - 1))
    sys.stderr.write("common_perf_print:       total time =    5.00 ms /  %d tokens\n" % (n + len(prompt)))
else:
    sys.stdout.write("\n\n" + prompt + text + "\n\n\n\n")
    sys.stderr.write("encoded %4d tokens in    0.001 seconds, speed:   1.0 t/s\n" % len(prompt))
    sys.stderr.write("decoded %4d tokens in    0.0015 seconds, speed:   %.3f t/s\n" % (n, n / 0.0015))
    sys.stderr.write("n_drafted = 8\nn_accept = 3\n")
'''


def test_bench_cli_llamacpp_rows_from_stand_in_binaries(checkpoint, tmp_path, monkeypatch):
    d = tmp_path / "bin"
    d.mkdir()
    for n in lc.BINARIES:
        (d / n).write_text(f"#!{sys.executable}\n{FAKE}")
        (d / n).chmod((d / n).stat().st_mode | stat.S_IEXEC)
    monkeypatch.delenv(lc.ENV_DIR, raising=False)
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, [
        "bench", "--model", checkpoint("llama_tied"), "--draft", checkpoint("llama_draft"), "--methods",
        "none,draft", "--k", "2", "--workloads", "code", "--prompts", "1", "--rounds", "1",
        "--max-new-tokens", "6", "--threads", "1", "--baselines", "hf,llamacpp", "--llamacpp-dir", str(d),
        "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    rows = {s["config"]: s for s in data["summaries"]}
    assert set(rows) == {"none", "draft k=2", "llama.cpp", "llama.cpp lookup k=2", "llama.cpp draft k=2", "hf",
                         "hf-assisted k=2", "hf-prompt-lookup k=2"}
    assert rows["hf"]["identical"] is True and rows["hf"]["wall_tokens_per_s"] is None
    # tokens/s by llama.cpp's own clock (process start and model load excluded): 6 tokens in 5 ms, in 2.5 ms
    assert rows["llama.cpp"]["tokens_per_s"] == pytest.approx(1200.0)
    assert rows["llama.cpp lookup k=2"]["tokens_per_s"] == pytest.approx(2400.0)
    assert rows["llama.cpp draft k=2"]["acceptance_rate"] == pytest.approx(3 / 8)
    assert rows["llama.cpp"]["wall_tokens_per_s"] < rows["llama.cpp"]["tokens_per_s"]
    assert rows["llama.cpp"]["identical"] is False and rows["llama.cpp"]["common_prefix"] is not None
    s = data["settings"]["llamacpp"]
    assert s["model"].endswith("target-f32.gguf") and s["draft"].endswith("draft-q8_0.gguf")
    assert s["llama_bench"]["tokens_per_s"] == 123.5 and s["threads"] == 1 and s["truncated_output_retries"] == 0
    assert "tokenized" in res.output and "llama-bench tg128" in res.output
    # leaplm's rows carry their decode rate (prefill excluded); the fastest of them is set against tg128
    best = s["best_vs_llama_bench"]["code"]
    assert best["config"] in ("none", "draft k=2") and rows[best["config"]]["decode_tokens_per_s"] > 0
    assert best["vs_llama_bench"] == pytest.approx(best["decode_tokens_per_s"] / 123.5)
    assert best["decode_tokens_per_s"] == max(rows[c]["decode_tokens_per_s"] for c in ("none", "draft k=2"))


def test_a_failing_binary_stops_the_bench_with_its_name(checkpoint, tmp_path, monkeypatch):
    d = tmp_path / "bin"
    d.mkdir()
    for n in lc.BINARIES:
        body = "import sys; sys.stderr.write('boom: unknown argument\\n'); sys.exit(1)" if n == lc.LOOKUP else FAKE
        (d / n).write_text(f"#!{sys.executable}\n{body}")
        (d / n).chmod((d / n).stat().st_mode | stat.S_IEXEC)
    monkeypatch.delenv(lc.ENV_DIR, raising=False)
    res = CliRunner().invoke(app, [
        "bench", "--model", checkpoint("llama_tied"), "--methods", "none", "--workloads", "code", "--prompts", "1",
        "--rounds", "1", "--max-new-tokens", "4", "--baselines", "llamacpp", "--llamacpp-dir", str(d)])
    assert res.exit_code == 2 and "llama-lookup failed (exit status 1)" in res.output and "boom" in res.output


def test_probe_turns_repacking_off_when_the_process_dies(tmp_path, caplog):
    d = tmp_path / "bin"
    d.mkdir()
    for n in lc.BINARIES:
        (d / n).write_text(f"#!{sys.executable}\n{FAKE}")
        (d / n).chmod((d / n).stat().st_mode | stat.S_IEXEC)
    s = lc.LlamaCppSetup(lc.find_binaries(str(d), env={}), "m.gguf", threads=1, context=64)
    (tmp_path / "ok.txt").write_text("fine")
    lc.probe_repack(s, str(tmp_path / "ok.txt"))
    assert not s.no_repack and "--no-repack" not in lc.completion_command(s, "p", 4)
    (tmp_path / "crash.txt").write_text("CRASH")                 # dies unless --no-repack, like the AMX SIGILL
    lc.probe_repack(s, str(tmp_path / "crash.txt"))
    assert s.no_repack and "--no-repack" in lc.completion_command(s, "p", 4)
    assert "killed by signal 4" in caplog.text
    assert lc.llama_bench_command(s)[-2:] == ["--repack", "0"]


def test_best_vs_llama_bench_reads_leaplm_rows_by_decode_rate():
    from leaplm.bench.runner import ConfigSummary
    from leaplm.cli.bench_llamacpp import best_vs_llama_bench

    def row(config, workload, decode, wall=None):
        return ConfigSummary(config, workload, 10.0, None, None, None, None, 1, wall_tokens_per_s=wall,
                             decode_tokens_per_s=decode)

    fig = lc.BenchFigure(128, 100.0, 1.0, 3, "fake")
    rows = [row("none", "edit", 90.0), row("none +prediction", "edit", 210.0),
            row("llama.cpp lookup k=4", "edit", 400.0, wall=300.0),      # another engine: never leaplm's best
            row("hf", "edit", None), row("none", "quote", 80.0)]
    best = best_vs_llama_bench(fig, rows)
    assert best["edit"] == {"config": "none +prediction", "decode_tokens_per_s": 210.0, "vs_llama_bench": 2.1}
    assert best["quote"]["config"] == "none" and best["quote"]["vs_llama_bench"] == pytest.approx(0.8)
