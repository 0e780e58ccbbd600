"""`leaplm bench serve --backend A,B`: one server per backend, runs interleaved, every row naming the backend its
server reported, ratios paired within a round (figures are not asserted: speed is measured by the bench, never in
a test)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from leaplm.bench.serve_load import LoadBenchConfig, RequestResult, RunResult, run_load_bench, summarize
from leaplm.cli import app
from leaplm.models.llamacpp.binding import available

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from serverkit import write_pair  # noqa: E402


@pytest.mark.parametrize("args, field, words", [
    (["--backend", "llamacpp,vllm"], "--backend", "'vllm'"),
    (["--backend", "torch,torch"], "--backend", "each backend once"),
    (["--backend", " , "], "--backend", "at least one"),
    (["--backend", "llamacpp", "--quantization", "gguf"], "--quantization", "add torch"),
    (["--backend", "llamacpp,torch", "--profile", "short"], "--backend", "one server"),
    (["--backend", "llamacpp,torch", "--long-prompt-among", "2"], "--long-prompt-among", "one --backend"),
])
def test_bad_backend_lists_are_refused_naming_the_option(args, field, words):
    res = CliRunner().invoke(app, ["bench", "serve", *args])
    assert res.exit_code == 2, res.output
    assert f"error: {field}" in res.output and words in " ".join(res.output.split())


def _run(backend: str, c: int, spec: bool, rnd: int, tokens: int, wall: float) -> RunResult:
    return RunResult(c, spec, rnd, wall, [RequestResult(ok=True, tokens=tokens)], backend=backend)


def test_rows_per_backend_and_ratios_paired_within_a_round():
    # round 0 on a fast machine, round 1 on a machine twice as slow: pairing within a round keeps the ratios
    runs = [_run("llamacpp", 1, False, 0, 100, 1.0), _run("llamacpp", 1, True, 0, 120, 1.0),
            _run("torch", 1, False, 0, 150, 1.0), _run("torch", 1, True, 0, 300, 1.0),
            _run("torch", 1, True, 1, 100, 1.0), _run("torch", 1, False, 1, 75, 1.0),
            _run("llamacpp", 1, True, 1, 60, 1.0), _run("llamacpp", 1, False, 1, 50, 1.0)]
    info = {"llamacpp": {"backend": "llamacpp", "exactness": "up to", "quantization": None},
            "torch": {"backend": "torch", "exactness": "identical", "quantization": "gguf"}}
    rows = {(r["backend"], r["speculative"]): r for r in summarize(runs, info)}
    assert [(r["backend"], r["speculative"]) for r in summarize(runs, info)] == [
        ("llamacpp", True), ("llamacpp", False), ("torch", True), ("torch", False)]
    assert rows[("llamacpp", True)]["speedup_vs_none"] == pytest.approx(1.2)
    # paired: median(300/150, 100/75) = 1.667; unpaired medians would give 200 / 112.5 = 1.78
    assert rows[("torch", True)]["speedup_vs_none"] == pytest.approx((2.0 + 4 / 3) / 2)
    assert rows[("torch", False)]["vs_first_backend_none"] == pytest.approx(1.5)
    assert rows[("torch", True)]["vs_first_backend_none"] == pytest.approx((3.0 + 2.0) / 2)
    assert rows[("llamacpp", False)]["vs_first_backend_none"] == pytest.approx(1.0)
    assert rows[("torch", True)]["quantization"] == "gguf" and rows[("llamacpp", True)]["exactness"] == "up to"
    # a lone backend has no cross-backend ratio
    lone = summarize([r for r in runs if r.backend == "torch"])
    assert all(r["vs_first_backend_none"] is None for r in lone) and lone[0]["backend"] == "torch"


@pytest.mark.skipif(not available(), reason="the llamacpp extra (llama-cpp-python) is not installed")
def test_the_same_gguf_file_on_libllama_and_torch_servers(tmp_path):
    from leaplm.models.gguf_export import export_gguf

    target, _ = write_pair(tmp_path / "pair")
    gguf = str(export_gguf(target, str(tmp_path / "target-f32.gguf"), "f32").path)
    out = tmp_path / "serve.json"
    cfg = LoadBenchConfig(model=gguf, method="ngram", k=2, concurrency=[1, 2], requests=2, max_tokens=4, rounds=2,
                          max_batch=2, threads=1, out=str(out), backends=["llamacpp", "torch"])
    report = run_load_bench(cfg)
    assert json.loads(out.read_text())["summary"] == report["summary"]
    assert [(s["requested"], s["backend"]) for s in report["servers"]] == [("llamacpp", "llamacpp"),
                                                                            ("torch", "torch")]
    keys = [(r["concurrency"], r["backend"], r["speculative"]) for r in report["summary"]]
    assert keys == [(c, b, s) for c in (1, 2) for b in ("llamacpp", "torch") for s in (True, False)]
    for r in report["summary"]:
        assert r["errors"] == 0 and r["rounds"] == 2 and r["tokens_per_s"] > 0
        assert r["vs_first_backend_none"] > 0 and r["speedup_vs_none"] > 0
        path = r["server_path_ms_per_token"]           # read from the server's own counters around each run
        assert path["engine_step"] > 0 and path["writes_per_token"] > 0 and path["wakeups_per_token"] > 0
    # runs interleaved: within a round the backends alternate their order from one round to the next
    order = [(r["requested_backend"], r["round"]) for r in report["runs"] if r["concurrency"] == 1]
    assert [b for b, rnd in order if rnd == 0][::2] == ["llamacpp", "torch"]
    assert [b for b, rnd in order if rnd == 1][::2] == ["torch", "llamacpp"]


def test_the_engine_alone_pairs_with_the_server_by_round():
    """--against-engine: each server row's decode rate over the engine's on the same requests, paired by round (a
    slower second round cancels out); engine rows carry no server ratios."""
    def run(path: str, rnd: int, gap: float) -> RunResult:      # 9 tokens after the first, `gap` seconds apart
        return RunResult(1, False, rnd, 1.0, [RequestResult(ok=True, tokens=10, itl_s=[gap] * 9)], path=path)

    runs = [run("server", 0, 0.010), run("engine", 0, 0.008), run("server", 1, 0.020), run("engine", 1, 0.019)]
    rows = {r["path"]: r for r in summarize(runs)}
    assert rows["server"]["vs_engine"] == pytest.approx((0.8 + 19 / 20) / 2)
    assert rows["engine"]["vs_engine"] is None and rows["engine"]["speedup_vs_none"] is None
    assert rows["server"]["decode_tokens_per_s_p50"] in (pytest.approx(100.0), pytest.approx(50.0))


def test_the_server_path_per_token_is_each_stage_over_the_tokens_of_the_rows_runs():
    def run(rnd: int, tokens: float, step_s: float, write_s: float) -> RunResult:
        delta = {"engine_step_s": step_s, "steps": tokens / 2, "tokens": tokens, "wakeup_s": 0.001, "wakeup_n": 5,
                 "serialize_s": 0.002, "serialize_n": 10, "write_s": write_s, "write_n": 10}
        return RunResult(1, True, rnd, 1.0, [RequestResult(ok=True, tokens=int(tokens))], server_path=delta)

    row = summarize([run(0, 100, 0.5, 0.01), run(1, 300, 1.5, 0.03)])[0]
    path = row["server_path_ms_per_token"]
    assert path["engine_step"] == pytest.approx(5.0) and path["write"] == pytest.approx(0.1)
    assert path["wakeup"] == pytest.approx(0.005) and path["serialize"] == pytest.approx(0.01)
    assert path["tokens_per_step"] == pytest.approx(2.0) and path["writes_per_token"] == pytest.approx(0.05)
    assert summarize([RunResult(1, True, 0, 1.0, [])])[0]["server_path_ms_per_token"] is None


def test_the_server_path_table_is_printed_for_server_rows_only(capsys):
    from leaplm.cli.bench_serve import print_server_path

    delta = {"engine_step_s": 0.5, "steps": 50, "tokens": 100, "wakeup_s": 0.001, "wakeup_n": 5, "serialize_s": 0.002,
             "serialize_n": 10, "write_s": 0.01, "write_n": 10}
    served = RunResult(4, True, 0, 1.0, [RequestResult(ok=True, tokens=100)], server_path=delta)
    print_server_path({"summary": summarize([served])})
    text = capsys.readouterr().out
    assert "per generated token" in text and "5.000" in text           # 500 ms of steps over 100 tokens
    print_server_path({"summary": summarize([RunResult(4, True, 0, 1.0, [], path="engine")])})
    assert capsys.readouterr().out == ""
