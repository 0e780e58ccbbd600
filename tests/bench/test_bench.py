"""leaplm bench end to end on tiny models: interleaved runs, paired speedups, greedy identity checks, HF peers."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from leaplm.bench.runner import Sample, summarize
from leaplm.bench.workloads import code_workload, copy_workload
from leaplm.cli import app


def test_workloads_are_heldout_and_deterministic():
    a, b = copy_workload(4), copy_workload(4)
    assert a.prompts == b.prompts and len(a.prompts) == 4
    for p in a.prompts:                      # the second copy starts exactly like the first
        first, _, second = p.partition("\n\n\n")
        assert second and first.startswith(second.rstrip("\n").splitlines()[0])
    assert all("def " in p for p in code_workload(3).prompts)


def test_summarize_pairs_by_round_and_prompt():
    s = [Sample("none", "w", 0, 0, 10, 1.0, [1, 2]), Sample("x", "w", 0, 0, 10, 0.5, [1, 2]),
         Sample("none", "w", 1, 0, 10, 2.0, [3]), Sample("x", "w", 1, 0, 10, 0.5, [4])]
    by = {r.config: r for r in summarize(s, "none")}
    assert by["x"].speedup == 3.0            # median of ratios 2.0 and 4.0
    assert by["x"].identical is False and by["none"].identical is None


def test_identity_stops_at_the_baselines_first_stop_token():
    # none emits EOS (id 9) and goes on; a contender that may not emit it parts there and is still identical
    s = [Sample("none", "w", 0, 0, 5, 1.0, [1, 2, 9, 4, 5]), Sample("hf", "w", 0, 0, 5, 1.0, [1, 2, 7, 8, 3]),
         Sample("bad", "w", 0, 0, 5, 1.0, [1, 3, 9, 4, 5])]
    by = {r.config: r for r in summarize(s, "none", frozenset({9}))}
    assert by["hf"].identical is True and by["bad"].identical is False
    assert {r.config: r.identical for r in summarize(s, "none")}["hf"] is False    # without stop ids: all tokens


def test_bench_cli_with_hf_baselines(checkpoint, tmp_path):
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, [
        "bench", "--model", checkpoint("llama_tied"), "--draft", checkpoint("llama_draft"),
        "--methods", "none,draft,draft:adaptive_k=0", "--k", "2", "--workloads", "code,copy", "--prompts", "1",
        "--rounds", "1", "--max-new-tokens", "6", "--baselines", "hf", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    configs = {(s["workload"], s["config"]) for s in data["summaries"]}
    for w in ("code", "copy"):
        for c in ("none", "draft k=2", "draft k=2 adaptive_k=0", "hf", "hf-assisted k=2", "hf-prompt-lookup k=2"):
            assert (w, c) in configs
    for s in data["summaries"]:
        if s["config"].startswith("draft"):
            assert s["identical"] is True    # greedy speculation is token-identical to none
        assert s["tokens_per_s"] > 0


def test_bench_cli_samples_at_a_temperature_with_hf_baselines(checkpoint, tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "--model", checkpoint("llama_tied"), "--draft", checkpoint("llama_draft"), "--methods",
            "none,draft", "--k", "2", "--workloads", "code", "--prompts", "2", "--rounds", "1",
            "--max-new-tokens", "8", "--baselines", "hf", "--temperature", "1.0", "--json", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["settings"]["temperature"] == 1.0
    by = {s["config"]: s for s in data["summaries"]}
    assert set(by) == {"none", "draft k=2", "hf", "hf-assisted k=2", "hf-prompt-lookup k=2"}
    assert all(s["identical"] is None for s in by.values())    # no token identity is claimed when sampling


def test_hf_baselines_sample_seeded_at_a_temperature(checkpoint):
    from leaplm.bench.runner import hf_contenders

    prompt = code_workload(1).prompts[0]

    def run(temperature, seed):
        cs = {c.name: c for c in hf_contenders(checkpoint("llama_tied"), checkpoint("llama_draft"), 2,
                                               ["plain", "assisted"], ignore_eos=True, temperature=temperature,
                                               seed=seed)}
        return {name: c.run(prompt, 12)[0] for name, c in cs.items()}

    a, b, other, greedy = run(1.0, 0), run(1.0, 0), run(1.0, 1), run(0.0, 0)
    assert a == b                                   # seeded
    assert a["hf"] != other["hf"]                   # by the seed
    assert a["hf"] != greedy["hf"] and a["hf-assisted k=2"] != greedy["hf-assisted k=2"]   # sampled, not argmax
    assert greedy["hf"] == greedy["hf-assisted k=2"]                                       # greedy is exact


def test_bench_runs_do_not_learn_from_each_other(tiny_llama):
    # suffix remembers earlier requests; a bench repeating a prompt must not let it copy its last answer
    from leaplm import Engine, SamplingParams
    from leaplm.bench.runner import leaplm_contender

    eng = Engine(tiny_llama, method="suffix", k=8, adaptive_k=False)
    run = leaplm_contender("suffix", eng, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)).run
    (ids1, st1), (ids2, st2) = run("t7 t2 t9 t4", 40), run("t7 t2 t9 t4", 40)
    assert ids1 == ids2 and st1.accepted_tokens == st2.accepted_tokens and st1.draft_tokens == st2.draft_tokens
