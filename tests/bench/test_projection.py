"""`leaplm bench project` (bench/projection.py) on small hand-written JSONs: the formula against hand-computed
cases, traces read from roofline and bench JSONs, the check passing on a run the formula describes and failing
on a wrong curve (the negative control), and the command's table and report."""
from __future__ import annotations

import json

import pytest

from leaplm.bench.projection import CostCurve, Trace, load_curve, load_traces, project, projected_speedup
from leaplm.config import ConfigError

# forwards: T = 1, 2, 4, 8 at 10, 12, 16, 24 ms -> r = 1, 1.2, 1.6, 2.4
FORWARDS = [{"tokens": t, "ms": ms, "vs_one": ms / 10} for t, ms in ((1, 10.0), (2, 12.0), (4, 16.0), (8, 24.0))]


def roofline(path, methods, forwards=FORWARDS, curves=()):
    path.write_text(json.dumps({"model": "m.gguf", "forwards": forwards, "methods": methods, "curves": list(curves)}))
    return path


def method(config, ms_per_token, tau=1.0, k=0, score_ms=0.0, propose_ms=0.0):
    return {"config": config, "ms_per_token": ms_per_token, "score_ms": score_ms, "propose_ms": propose_ms,
            "mean_accepted_length": tau, "k": k}


def test_the_formula_on_a_hand_computed_case(tmp_path):
    # plain decoding: 10 ms forward + 1 ms host per token -> c1 = 10, o = 1
    c = load_curve(roofline(tmp_path / "r.json", [method("none", 11.0, score_ms=10.0)]))
    assert (c.one_ms, c.host_ms, c.tokens, c.ratio) == (10.0, 1.0, (1, 2, 4, 8), (1.0, 1.2, 1.6, 2.4))
    # K = 4 -> T = 5: r = 1.6 + (5 - 4) / (8 - 4) * (2.4 - 1.6) = 1.8
    # tau = 3, p = 0.5 ms per token: 3 * (10 + 1) / (10 * 1.8 + 0.5 * 3 + 1) = 33 / 20.5
    s, r = projected_speedup(c, Trace("draft k=4", "w", tau=3.0, block=5.0, propose_ms=0.5))
    assert r == pytest.approx(1.8)
    assert s == pytest.approx(33 / 20.5)
    # a flat curve and a free proposer: the speedup is tau
    flat = CostCurve("m", "flat", (1, 8), (1.0, 1.0), 10.0, 0.0)
    assert projected_speedup(flat, Trace("ngram", "w", 2.5, 5.0))[0] == pytest.approx(2.5)
    # an override of the proposer's cost replaces the trace's
    s, _ = projected_speedup(c, Trace("draft", "w", 3.0, 5.0, propose_ms=0.5), propose_ms=2.0)
    assert s == pytest.approx(33 / 25.0)


def test_a_block_outside_the_measured_curve_is_refused(tmp_path):
    c = load_curve(roofline(tmp_path / "r.json", [method("none", 11.0, score_ms=10.0)]))
    with pytest.raises(ConfigError, match="a block of 9 tokens is outside the measured T = 1..8"):
        c.at(9)


def test_a_named_block_curve_and_a_missing_one(tmp_path):
    curve = {"kernel": "k1", "weight_type": "Q4_0", "tokens": [1, 3], "ms": [2.0, 3.0]}
    p = roofline(tmp_path / "r.json", [], curves=[curve])
    c = load_curve(p, "k1/Q4_0")
    assert (c.ratio, c.one_ms, c.host_ms) == ((1.0, 1.5), 2.0, 0.0)     # no plain row: c1 is the curve's T = 1
    assert c.at(2) == pytest.approx(1.25)
    with pytest.raises(ConfigError, match="no curve 'k2'; it has: forwards, k1/Q4_0"):
        load_curve(p, "k2")


def test_traces_from_a_roofline_json(tmp_path):
    p = roofline(tmp_path / "r.json", [method("none", 11.0, score_ms=10.0),
                                       method("ngram k=4 adaptive_k=false", 5.5, tau=2.0, k=4, propose_ms=0.1,
                                              score_ms=9.0),
                                       method("suffix k=3", 8.0, tau=1.5)])      # k only in the name
    ts = load_traces(p)
    assert [(t.method, t.tau, t.block, t.propose_ms) for t in ts] == [
        ("ngram k=4 adaptive_k=false", 2.0, 5.0, 0.1), ("suffix k=3", 1.5, 4.0, 0.0)]
    assert [t.measured_speedup for t in ts] == [pytest.approx(2.0), pytest.approx(11 / 8)]
    # the step's forward as the run timed it: 9 ms per token x tau 2 over plain's 10 ms; none without score times
    assert [t.decode_ratio for t in ts] == [pytest.approx(1.8), None]


def test_traces_from_a_bench_json(tmp_path):
    def sample(config, workload, new, fwd, drafted):
        return {"config": config, "workload": workload, "new_tokens": new, "target_forwards": fwd,
                "draft_tokens": drafted}
    p = tmp_path / "b.json"
    p.write_text(json.dumps({
        "settings": {"k": 4},
        "summaries": [{"config": "ngram", "workload": "code", "speedup": 1.7}],
        "samples": [sample("none", "code", 64, 64, 0), sample("ngram", "code", 60, 20, 70),
                    sample("ngram", "code", 40, 20, 90), sample("draft k=8", "code", 50, 10, 80)]}))
    ngram, draft = load_traces(p)
    # tau = 100 / 40; K = 4 (settings); f = 160 drafted / (40 forwards x 4)
    assert (ngram.method, ngram.workload, ngram.tau, ngram.block, ngram.drafting, ngram.propose_ms,
            ngram.measured_speedup) == ("ngram", "code", 2.5, 5.0, 1.0, 0.0, 1.7)
    # K = 8 from the name; f = 80 / (10 x 8) = 1; no summary: no measured speedup
    assert (draft.tau, draft.block, draft.drafting, draft.measured_speedup) == (5.0, 9.0, 1.0, None)
    p.write_text(json.dumps({"settings": {"k": 4}, "summaries": [],
                             "samples": [sample("suffix", "edit", 30, 20, 40)]}))
    (t,) = load_traces(p)
    assert t.drafting == pytest.approx(0.5)            # 40 / (20 x 4): half the steps drafted
    p.write_text(json.dumps({"rows": []}))
    with pytest.raises(ConfigError, match="neither a roofline JSON"):
        load_traces(p)


def test_steps_that_draft_nothing_cost_a_one_token_forward(tmp_path):
    c = load_curve(roofline(tmp_path / "r.json", [method("none", 11.0, score_ms=10.0)]))
    # f = 0.5: step cost 0.5 x 1.8 + 0.5 = 1.4; tau 1.5, p 0: 1.5 x 11 / (14 + 1)
    s, r = projected_speedup(c, Trace("ngram k=4", "w", tau=1.5, block=5.0, drafting=0.5))
    assert r == pytest.approx(1.4) and s == pytest.approx(16.5 / 15)


def consistent_run(tmp_path, name="run.json"):
    """A run whose measured speedups are what the formula gives on its own curve, within 3 %."""
    c1, o = 10.0, 1.0
    rows = [method("none", c1 + o, score_ms=c1)]
    for cfg, tau, k, p, noise in (("ngram k=4", 2.0, 4, 0.05, 1.03), ("draft k=2", 2.2, 2, 1.5, 0.98),
                                  ("suffix k=7", 3.0, 7, 0.1, 1.0)):
        r = {2: 1.2, 3: 1.4, 5: 1.8, 8: 2.4}[k + 1]
        ms = (c1 * r + p * tau + o) / tau * noise
        rows.append(method(cfg, ms, tau=tau, k=k, propose_ms=p))
    return roofline(tmp_path / name, rows)


def test_a_current_roofline_row_gives_the_drafted_share_the_mean_block_and_its_host_time(tmp_path):
    # adaptive K: 60% of forwards drafted, 3 tokens a drafting forward on average (K = 6 the most)
    row = method("ngram k=6", 6.0, tau=2.0, k=6, score_ms=5.0, propose_ms=0.2)
    row.update(drafting=0.6, block=3.0)
    p = roofline(tmp_path / "r.json", [method("none", 11.0, score_ms=10.0), row])
    (t,) = load_traces(p)
    assert (t.drafting, t.block) == (0.6, 3.0)
    assert t.host_ms == pytest.approx((6.0 - 5.0 - 0.2) * 2.0)          # per step: tau tokens' share
    c = load_curve(p)
    # r(3) = 1.2 + 0.5 * 0.4 = 1.4; step = 10 (0.6 * 1.4 + 0.4) + 0.2 * 2 + 1.6 = 14.4; speedup 2 * 11 / 14.4
    assert projected_speedup(c, t)[0] == pytest.approx(22 / 14.4)
    # control: the same row read as an old one (every step drafting K) projects another speedup
    old = {k: v for k, v in row.items() if k not in ("drafting", "block")}
    (o,) = load_traces(roofline(tmp_path / "old.json", [method("none", 11.0, score_ms=10.0), old]))
    assert (o.drafting, o.block, o.host_ms) == (1.0, 7.0, None)
    assert abs(projected_speedup(c, o)[0] / projected_speedup(c, t)[0] - 1) > 0.3


def test_counted_blocks_are_priced_each_on_the_curve_not_at_their_mean(tmp_path):
    # half the drafting steps verify 2 tokens, half 8: the mean block is 5 (r = 1.8), but the steps cost
    # (r(2) + r(8)) / 2 = (1.2 + 2.4) / 2 = 1.8 only on a straight curve; here r is not straight between 2 and 8
    row = method("suffix k=4", 6.0, tau=2.0, k=4, score_ms=5.0)
    row.update(drafting=1.0, block=5.0, blocks={"2": 10, "8": 10})
    p = roofline(tmp_path / "r.json", [method("none", 11.0, score_ms=10.0), row])
    (t,) = load_traces(p)
    assert t.blocks == {2: 10, 8: 10}
    c = load_curve(p)
    assert t.block_cost(c) == pytest.approx((1.2 + 2.4) / 2)
    assert c.at(5) == pytest.approx(1.6 + 0.25 * 0.8)
    assert projected_speedup(c, t)[1] == pytest.approx(1.8)
    # a curve bent at 4 (a cheap 8-token block): the counts and the mean disagree, and the counts are what ran
    bent = CostCurve("m", "bent", (1, 2, 4, 8), (1.0, 1.2, 1.6, 1.7), 10.0, 1.0)
    assert t.block_cost(bent) == pytest.approx((1.2 + 1.7) / 2)
    assert bent.at(5) == pytest.approx(1.625)
    assert projected_speedup(bent, t)[1] != pytest.approx(projected_speedup(bent, Trace("s", "w", 2.0, 5.0))[1])


def test_run_totals_stand_in_for_the_per_request_medians(tmp_path):
    # the medians say plain 11 ms (10 scoring) and the method 6 ms (5 scoring); the run totals, the footing of tau,
    # say plain 12 (10.8) and the method 5 (4): the curve's c1 and o, the measured speedup and the step's cost
    # ratio all come from the totals
    plain = method("none", 11.0, score_ms=10.0)
    plain["totals"] = {"ms_per_token": 12.0, "propose_ms": 0.0, "score_ms": 10.8}
    row = method("suffix k=4", 6.0, tau=2.0, k=4, score_ms=5.0)
    row.update(drafting=1.0, block=5.0, totals={"ms_per_token": 5.0, "propose_ms": 0.2, "score_ms": 4.0})
    p = roofline(tmp_path / "r.json", [plain, row])
    c = load_curve(p)
    assert (c.one_ms, c.host_ms) == (10.8, pytest.approx(1.2))
    (t,) = load_traces(p)
    assert t.measured_speedup == pytest.approx(12.0 / 5.0)
    assert t.decode_ratio == pytest.approx(4.0 * 2.0 / 10.8)
    assert (t.propose_ms, t.host_ms) == (0.2, pytest.approx((5.0 - 4.0 - 0.2) * 2.0))
    # control: the same rows without totals read their medians
    for m in (plain, row):
        del m["totals"]
    (o,) = load_traces(roofline(tmp_path / "m.json", [plain, row]))
    assert o.measured_speedup == pytest.approx(11.0 / 6.0)


def test_run_totals_are_sums_over_the_requests():
    from leaplm.bench.roofline import run_totals
    from leaplm.engine.stats import GenerationStats

    a, b = GenerationStats("suffix", 4), GenerationStats("suffix", 4)
    a.new_tokens, a.decode_s, a.score_s, a.propose_s = 100, 0.2, 0.15, 0.01      # 2 ms a token
    b.new_tokens, b.decode_s, b.score_s, b.propose_s = 300, 0.3, 0.24, 0.03      # 1 ms a token
    assert run_totals([a, b]) == {"ms_per_token": 1.25, "propose_ms": 0.1, "score_ms": 0.975}


def test_block_counts_come_from_the_requests_drafted_positions():
    from leaplm.bench.roofline import block_counts
    from leaplm.engine.stats import GenerationStats

    a, b = GenerationStats("suffix", 4), GenerationStats("suffix", 4)
    for d in (4, 4, 1, 0):
        a.record_step(d, 0, 1)
    for d in (2, 6):
        b.record_step(d, 0, 1)
    assert block_counts([a, b]) == {"5": 2, "2": 1, "3": 1, "7": 1}
    assert block_counts([GenerationStats("none", 0)]) == {}


def test_the_check_passes_on_a_run_the_formula_describes(tmp_path):
    p = consistent_run(tmp_path)
    rep = project([load_curve(p)], load_traces(p), tolerance=0.10)
    # measured = plain / (formula's ms x noise): error = noise - 1
    errs = {r.method: r.error for r in rep.rows}
    assert errs == pytest.approx({"ngram k=4": 0.03, "draft k=2": -0.02, "suffix k=7": 0.0}, abs=1e-9)
    assert rep.passed and rep.max_error == pytest.approx(0.03)


def test_the_check_fails_on_a_wrong_curve(tmp_path):
    # negative control: the same traces against a curve that says verification is free (flat)
    p = consistent_run(tmp_path)
    flat = [{"tokens": t, "ms": 10.0, "vs_one": 1.0} for t in (1, 8)]
    wrong = roofline(tmp_path / "flat.json", [method("none", 11.0, score_ms=10.0)], forwards=flat)
    rep = project([load_curve(wrong)], load_traces(p), tolerance=0.10)
    assert rep.passed is False and rep.max_error > 0.3


def test_projection_mode_reports_no_error_against_another_models_speedups(tmp_path):
    p = consistent_run(tmp_path)
    big = roofline(tmp_path / "big.json", [method("none", 101.0, score_ms=100.0)],
                   forwards=[{"tokens": t, "ms": 100.0 * (1 + 0.05 * (t - 1)), "vs_one": 0} for t in (1, 4, 8)])
    rep = project([load_curve(big)], load_traces(p))
    assert rep.passed is None and all(r.error is None and r.measured_speedup is None for r in rep.rows)
    ngram = next(r for r in rep.rows if r.method == "ngram k=4")
    # r(5) = 1 + 0.05 * 4 = 1.2: 2 * 101 / (100 * 1.2 + 0.05 * 2 + 1)
    assert ngram.speedup == pytest.approx(202 / 121.1)


def test_the_command_prints_the_table_and_writes_the_report(tmp_path):
    from typer.testing import CliRunner

    from leaplm.cli import app

    p, out = consistent_run(tmp_path), tmp_path / "proj.json"
    r = CliRunner().invoke(app, ["bench", "project", "--curve", str(p), "--traces", str(p), "--check",
                                 "--out", str(out)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "within the tolerance" in r.output and "ngram k=4" in r.output
    rep = json.loads(out.read_text())
    assert rep["passed"] is True and len(rep["rows"]) == 3
    flat = roofline(tmp_path / "flat.json", [method("none", 11.0, score_ms=10.0)],
                    forwards=[{"tokens": t, "ms": 10.0, "vs_one": 1.0} for t in (1, 8)])
    r = CliRunner().invoke(app, ["bench", "project", "--curve", str(flat), "--traces", str(p), "--check",
                                 "--out", str(out)], env={"COLUMNS": "200"})
    assert r.exit_code == 1 and "OUTSIDE the tolerance" in r.output
    r = CliRunner().invoke(app, ["bench", "project", "--curve", str(p), "--traces", str(p), "--propose-ms", "x",
                                 "--out", str(out)])
    assert r.exit_code != 0 and "--propose-ms" in r.output
