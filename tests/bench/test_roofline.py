"""`leaplm bench --roofline`: the bytes it counts per forward, and the report's figures agree with each other.
(Speed itself is never asserted: it is measured, on the machine at hand.)"""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from leaplm.bench.roofline import KERNEL_BLOCK_BYTES, bytes_per_forward, linear_shapes
from leaplm.cli import app
from leaplm.models import load_model


def expected_bytes(a, per_linear_weight) -> float:
    """Linear weights at `per_linear_weight` bytes each, fp32 norms, one fp32 embedding row."""
    H, Hkv, D, hid, inter = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.hidden_size, a.intermediate_size
    linear = a.num_hidden_layers * (hid * (H + 2 * Hkv) * D + H * D * hid + 3 * hid * inter) + hid * a.vocab_size
    norms = (2 * a.num_hidden_layers + 1) * hid
    return linear * per_linear_weight + 4 * norms + 4 * hid


@pytest.mark.parametrize("family", ["llama3_rope", "llama_tied"])
@pytest.mark.parametrize("quantization,per_weight", [(None, 4), ("int8", 1 + 4 / 32), ("int4", 0.5 + 8 / 32)])
def test_bytes_per_forward(checkpoint, family, quantization, per_weight):
    lm = load_model(checkpoint(family), quantization=quantization)
    assert bytes_per_forward(lm.model) == expected_bytes(lm.model.args, per_weight)


def test_roofline_cli_report_is_consistent(checkpoint, tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["bench", "--roofline", "--model", checkpoint("llama3_rope"), "--methods", "none,ngram",
                                   "--quantization", "int8", "--prompts", "1", "--rounds", "1",
                                   "--max-new-tokens", "8", "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["quantization"] == "int8" and r["weight_bytes"] > 0
    assert r["floor_ms"] == pytest.approx(r["weight_bytes"] / (r["bandwidth_GBps"] * 1e9) * 1e3, rel=1e-9)
    assert [f["tokens"] for f in r["forwards"]] == [1, 2, 4, 8, 12, 16]
    assert [m["config"] for m in r["methods"]] == ["none", "ngram k=4"]
    for m in r["methods"]:
        parts = m["propose_ms"] + m["score_ms"] + m["verify_ms"] + m["commit_ms"] + m["rest_ms"]
        # the split adds up: six values each rounded to 3 decimals differ by at most 6 x 0.0005 (rounding only)
        assert parts == pytest.approx(m["ms_per_token"], abs=6 * 0.0005 + 1e-9)
    assert "roofline" in res.output and "floor" in res.output
    from leaplm.kernels.build import load

    ext = load()
    if ext is None or ext.path == 0:
        assert r["curves"] == [] and "no block-cost curve" in r["curves_note"]
        return
    # one block-cost curve per weight type over T = 1..16, floors consistent with the model's linear shapes
    assert [(c["kernel"].split(" (")[0], c["weight_type"]) for c in r["curves"]] == [
        ("leaplm int8", "Q4_0"), ("leaplm int8", "Q4_1"), ("leaplm int8", "Q8_0"), ("leaplm forward", "Q8_0"),
        ("leaplm forward, argmax head", "Q8_0")]
    assert r["int8_GMACs"] > 0
    greedy = r["curves"].pop()                  # the greedy verify's forward: the output layer's argmax alone
    assert greedy["tokens"] == list(range(1, 33)) and all(ms > 0 for ms in greedy["ms"])
    whole = r["curves"].pop()                                          # the whole forward (int8 = Q8_0's blocks)
    assert whole["tokens"] == list(range(1, 33)) and whole["weight_bytes"] == r["weight_bytes"]
    a = load_model(checkpoint("llama3_rope")).model.args
    macs = sum(n * k for n, k in linear_shapes(a))
    # the whole forward's arithmetic floor: its linears' multiply-adds x T at the int8 rate of the same run
    assert whole["compute_floor_ms"][31] == pytest.approx(32 * macs / (r["int8_GMACs"] * 1e9) * 1e3, rel=1e-2, abs=1e-3)
    for c in r["curves"]:
        assert c["tokens"] == list(range(1, 17)) and c["vs_one"][0] == 1 and all(ms > 0 for ms in c["ms"])
        assert c["weight_bytes"] == macs * KERNEL_BLOCK_BYTES[c["weight_type"]] // 32
        assert c["bandwidth_floor_ms"] == pytest.approx(c["weight_bytes"] / (r["bandwidth_GBps"] * 1e9) * 1e3,
                                                        abs=1e-3)
        assert c["compute_floor_ms"][15] == pytest.approx(16 * macs / (r["int8_GMACs"] * 1e9) * 1e3, rel=1e-2, abs=1e-3)
    assert "Q4_1: one forward over T tokens" in res.output and "int8 compute floor" in res.output


def test_roofline_cli_refuses_bad_quantization(checkpoint):
    res = CliRunner().invoke(app, ["bench", "--roofline", "--model", checkpoint("llama3_rope"), "--quantization", "q2"])
    assert res.exit_code == 2 and "--quantization" in res.output


def test_roofline_compares_with_llamacpp_only(checkpoint):
    """--baselines with --roofline means llama-bench's one-token forward; 'hf' there is refused, not ignored."""
    res = CliRunner().invoke(app, ["bench", "--roofline", "--model", checkpoint("llama3_rope"), "--baselines", "hf"])
    assert res.exit_code == 2 and "--baselines" in res.output and "llamacpp" in res.output


def test_one_token_pairing_alternates_rounds_and_takes_medians(checkpoint):
    """pair_one_token: one llama-bench run per round, after that round's forwards; the figures are the rounds'
    medians and the ratio the median of the rounds' ratios."""
    from leaplm.bench.roofline import pair_one_token

    m = load_model(checkpoint("llama3_rope")).model
    calls = []
    llama = iter([1.0, 100.0, 2.0])                       # ms of three llama-bench runs

    def llama_ms() -> float:
        calls.append(len(calls))
        return next(llama)

    p = pair_one_token(m, llama_ms, rounds=3, forwards=4, ctx=8, command="llama-bench ...")
    assert calls == [0, 1, 2] and len(p.rounds) == 3 and p.command == "llama-bench ..."
    ours = [a for a, _ in p.rounds]
    assert [b for _, b in p.rounds] == [1.0, 100.0, 2.0] and all(a > 0 for a in ours)
    assert p.llama_ms == 2.0 and p.leaplm_ms == pytest.approx(sorted(ours)[1], abs=1e-3)
    assert p.ratio == pytest.approx(sorted(a / b for a, b in p.rounds)[1], abs=1e-3)


@pytest.mark.skipif(not __import__("leaplm.models.llamacpp.binding", fromlist=["available"]).available(),
                    reason="the llamacpp extra (llama-cpp-python) is not installed")
def test_roofline_on_libllama_has_both_engines_curves_per_type_and_the_break_even(tmp_path):
    import sys
    from pathlib import Path

    from leaplm.models.gguf_export import export_gguf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
    from serverkit import write_pair

    target, _ = write_pair(tmp_path / "pair")
    gguf = str(export_gguf(target, str(tmp_path / "t-f32.gguf"), "f32").path)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    res = CliRunner().invoke(app, ["bench", "--roofline", "--model", gguf, "--backend", "llamacpp", "--methods",
                                   "none,ngram:adaptive_k=false,suffix", "--k", "3", "--threads", "1", "--prompts",
                                   "1", "--rounds", "1", "--max-new-tokens", "8", "--json", str(out),
                                   "--plot", str(png)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["weight_type"] == "F32" and png.stat().st_size > 0
    whole = {(c["kernel"], c["weight_type"]): c for c in r["curves"] if "forward" in c["kernel"]}
    for wt in ("F32", "Q4_0", "Q4_1", "Q8_0", "Q4_K_M"):   # the file's own type, then libllama's requantizations
        mine = "leaplm forward (fp32)" if wt == "F32" else "leaplm forward (int8 kernel)"
        from leaplm.kernels.build import load

        ext = load()
        if wt != "F32" and (ext is None or ext.path == 0):
            mine = "leaplm forward (dequantized per call)"
        for kernel in ("llama.cpp forward", "llama.cpp forward, 4 rows", mine):
            c = whole[(kernel, wt)]
            assert c["tokens"] == list(range(1, 33)) and c["vs_one"][0] == 1 and all(ms > 0 for ms in c["ms"])
    m = {x["config"]: x for x in r["methods"]}
    assert (m["none"]["k"], m["ngram k=3 adaptive_k=false"]["k"], m["suffix k=3"]["k"]) == (0, 3, 3)
    assert m["suffix k=3"]["adaptive_k"] and not m["ngram k=3 adaptive_k=false"]["adaptive_k"]
    # the break-even: each speculating method against each one-row whole forward of the file's type, at T = K + 1
    be = r["break_even"]
    assert {(b["config"], b["kernel"]) for b in be} == {
        (c, k) for c in ("ngram k=3 adaptive_k=false", "suffix k=3")
        for k in ("llama.cpp forward", "leaplm forward (fp32)")}
    for b in be:
        assert b["block_tokens"] == 4 and b["block_cost"] == whole[(b["kernel"], "F32")]["vs_one"][3]
        assert b["mean_accepted_length"] == m[b["config"]]["mean_accepted_length"]
        assert b["pays"] == (b["mean_accepted_length"] > b["block_cost"])
    assert "where speculation can pay" in res.output
