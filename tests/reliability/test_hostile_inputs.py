"""Hostile request fields: grammars and schemas that are huge, deeply nested, ambiguous or pathological for
llguidance (exponential regexes, 10,000-alternative enums, recursive schemas), predictions of the largest size the
context allows, bodies nested 100,000 deep, and lone surrogates in every text field.

Each is refused with a 400 naming its field, or runs within its budget: BUDGET_S seconds from sending to the last
byte of the answer (grammars are compiled off the event loop, bounded by llguidance's own limits, and the row that
runs a grammar copies the matcher the request's preparation built, so no engine step waits on a compile), and
MEMORY_MB of resident-memory growth for the whole attack. Ordinary greedy requests running meanwhile keep their
answers (each equal to its run alone). Their latency is measured by a client in a process of its own
(attack_load.py) in interleaved rounds of three phases: calm, under attack, and a control where ordinary requests
take the attack's place; the `soak` variant, rounds of 300 ordinary requests a phase for SOAK_SECONDS (at least 5
rounds) against `leaplm serve` in its own process, holds the median over rounds of attack p99 / calm p99 within RATIO (2x)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import rawhttp
from gguf_servers import cli_args, skip_unless_available, smollm2_file
from leaplm import SamplingParams
from serverkit import API_KEY, MODEL, ServerProcess

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BUDGET_S = 30.0          # each hostile request, sent to answered (a 4-token answer, or a 400)
MEMORY_MB = 256          # resident-memory growth of the server over the whole attack


def _nested(depth: int) -> str:
    """JSON text of a schema nested `depth` objects deep (built as text: json.dumps would recurse that deep)."""
    return '{"type":"object","required":["a"],"properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


# name -> (request fields, or their JSON text; statuses it may get; the field a 400 must name, None: the body)
ATTACKS = {
    "exponential_regex": ({"guided_regex": "(a|aa)*(a|aa)*(a|aa)*(a|aa)*b"}, {200}, None),
    "huge_repetition_regex": ({"guided_regex": "(x{1000}){1000}"}, {200, 400}, "guided_regex"),
    "wide_repetition_regex": ({"guided_regex": "[a-z]{1,65535}"}, {200, 400}, "guided_regex"),
    "nested_groups_regex": ({"guided_regex": "(" * 2000 + "a" + ")*" * 2000}, {400}, "guided_regex"),
    "enum_10000": ({"guided_json": {"enum": [f"value-{i}" for i in range(10_000)]}}, {200}, None),
    "recursive_schema": ({"guided_json": {"$defs": {"n": {"type": "object", "properties": {
        "c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"}}, {200}, None),
    "nested_schema_400": ('"guided_json":' + _nested(400), {400}, "guided_json"),     # past llguidance's limit
    "nested_schema_5000": ('"guided_json":' + _nested(5000), {400}, None),   # past the JSON parser's: invalid_json
    "anyof_2000": ({"guided_json": {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                               "required": [f"k{i}"]} for i in range(2000)]}}, {200, 400},
                   "guided_json"),
    "choice_10000": ({"guided_choice": [f"c{i}" for i in range(10_000)]}, {400}, "guided_choice"),
    # past llguidance's 2,000 Earley items in a row once a token is in: the request ends with a 400 (grammar_error)
    "grammar_20000_alternatives": ({"guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(20_000))},
                                   {200, 400}, "guided_grammar"),
    "ambiguous_grammar": ({"guided_grammar": 'start: a\na: a a | "x"'}, {200, 400}, "guided_grammar"),
    "left_recursive_grammar": ({"guided_grammar": 'start: e\ne: e "+" e | e "*" e | "(" e ")" | "1"'}, {200}, None),
}


def _body(fields: dict) -> dict:
    return {"model": MODEL, "prompt": "the quick brown", "max_tokens": 4, "temperature": 0, **fields}


ORDINARY = [{"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0}
            for p in ("the quick brown", "def add(a", "un café")]
LOAD = Path(__file__).with_name("attack_load.py")
RATIO = 2.0              # goal: the ordinary requests' p99 under attack at most this times their calm p99


def _text(fields: dict | str) -> str:
    """The JSON text of a hostile request's body."""
    if isinstance(fields, str):
        return json.dumps(_body({}))[:-1] + ", " + fields + "}"
    return json.dumps(_body(fields))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _attack(server, want, figures, rounds: int, requests: int, tmp_path, warmup: bool = True,
            seconds: float = 0.0) -> list[float]:
    """Rounds of three phases, calm / hostile-grammar attack / control (attack_load.py, in a process of its own):
    3 clients of ordinary greedy requests throughout, a fourth client idle, sending every attack in turn, or sending
    ordinary requests of the attack's shape; `requests` ordinary requests measured per phase. Checks every attack's
    status, field and budget and every ordinary answer (want(prompt) -> its text alone); returns each round's
    attack p99 / calm p99 of the ordinary requests' latency. seconds: rounds go on until that long has passed."""
    spec = {"url": server.url, "api_key": API_KEY, "model": MODEL, "clients": 3, "rounds": rounds, "seconds": seconds,
            "requests": requests, "warmup": warmup, "ordinary": ORDINARY, "control": json.dumps(_body({})),
            "hostile": [[name, _text(f)] for name, (f, _, _) in ATTACKS.items()]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    rss0 = server.metric("process_resident_memory_bytes")
    out = subprocess.run([sys.executable, str(LOAD), str(tmp_path / "spec.json")], capture_output=True, text=True,
                         timeout=1800 + 2 * seconds)
    assert out.returncode == 0, out.stderr[-3000:]
    rss_mb = (server.metric("process_resident_memory_bytes") - rss0) / 2**20
    phases = json.loads(out.stdout)["phases"]
    sent = [f for p in phases if p["kind"] == "attack" for f in p["fourth"]]
    for name, code, param, err, took in sent:
        _, allowed, field = ATTACKS[name]
        assert code in allowed, (name, code, param, err)
        if code == 400:
            assert param == field, (name, param, err)
            assert field is not None or err == "invalid_json", (name, err)
        assert took < BUDGET_S, (name, took)
    assert {name for name, *_ in sent} == set(ATTACKS)
    texts = [(p, t) for ph in phases for p, t in ph["texts"]]
    assert [(p, t) for p, t in texts if t != want(p)] == []
    assert rss_mb < MEMORY_MB, rss_mb
    measured = [p for p in phases if p["round"] >= 0]
    lat = {k: [[1000 * x for x in p["latency_s"]] for p in measured if p["kind"] == k]
           for k in ("calm", "attack", "control")}
    ratios = {k: [_pct(a, 0.99) / _pct(c, 0.99) for a, c in zip(lat[k], lat["calm"])] for k in ("attack", "control")}
    figures.update(rounds=len(lat["calm"]), seconds=seconds, ordinary_per_phase=min(len(x) for v in lat.values() for x in v),
                   hostile=len(sent), refused_400=sum(c == 400 for _, c, *_ in sent),
                   slowest_hostile_s=max(t for *_, t in sent), rss_growth_mb=rss_mb,
                   **{f"p99_{k}_ms": statistics.median(_pct(x, 0.99) for x in v) for k, v in lat.items()},
                   **{f"p50_{k}_ms": statistics.median(_pct(x, 0.5) for x in v) for k, v in lat.items()},
                   p99_ratio_attack=statistics.median(ratios["attack"]),
                   p99_ratio_control=statistics.median(ratios["control"]),
                   p99_ratio_attack_min=min(ratios["attack"]), p99_ratio_attack_max=max(ratios["attack"]))
    return ratios["attack"]


def _alone(reference):
    memo = {b["prompt"]: reference.generate(b["prompt"], SamplingParams(max_new_tokens=16, temperature=0)).text
            for b in ORDINARY}
    return memo.__getitem__


def test_hostile_grammars_run_within_budget_beside_ordinary_requests(server, reference, figures, tmp_path):
    _attack(server, _alone(reference), figures, rounds=1, requests=40, tmp_path=tmp_path, warmup=False)


@pytest.mark.slow
@pytest.mark.soak
def test_hostile_grammar_attack_keeps_ordinary_p99_within_2x(tiny_pair, reference, figures, tmp_path):
    """`leaplm serve` in its own process, rounds of 300 ordinary requests a phase for SOAK_SECONDS (at least 5
    rounds): the median over rounds of attack p99 / calm p99 is at most RATIO."""
    srv = ServerProcess(*tiny_pair, "--max-batch", "4", "--max-queue", "16", "--k", "4")
    try:
        srv.wait_ready()
        ratios = _attack(srv, _alone(reference), figures, rounds=5, requests=300, tmp_path=tmp_path,
                         seconds=float(os.environ.get("SOAK_SECONDS", "300")))
    finally:
        srv.stop()
    assert statistics.median(ratios) <= RATIO, ratios


@pytest.mark.slow
@pytest.mark.soak
def test_hostile_grammar_attack_on_smollm2_keeps_ordinary_p99_within_2x(figures, tmp_path):
    """The same on SmolLM2-135M-Instruct Q4_1 served on the int8 kernel, speculating with its shipped draft (a
    49,152-token vocabulary: masks and compiles cost more): 3 rounds of 150 ordinary requests a phase, each
    answer equal to its prompt decoded plainly alone on the same server."""
    skip_unless_available("kernel")
    srv = ServerProcess(smollm2_file(), None, "--max-batch", "4", "--max-queue", "16", "--k", "4", "--method",
                        "draft", "--max-model-len", "2048", *cli_args("kernel"))
    try:
        srv.wait_ready(300)
        alone = {}
        for b in ORDINARY:
            r = httpx.post(srv.url + "/v1/completions", headers=HEADERS, timeout=120,
                           json={**b, "speculative": {"method": "none"}})
            assert r.status_code == 200, r.text
            alone[b["prompt"]] = r.json()["choices"][0]["text"]
        ratios = _attack(srv, alone.__getitem__, figures, rounds=3, requests=150, tmp_path=tmp_path)
    finally:
        srv.stop()
    assert statistics.median(ratios) <= RATIO, ratios


S = '"a\\ud800b"'      # JSON text of a string holding a lone (high) surrogate
SURROGATE_BODIES = {
    "prompt": ("/v1/completions", '{"model":"tiny","prompt":%s}' % S),
    "prompt[1]": ("/v1/completions", '{"model":"tiny","prompt":["x",%s]}' % S),
    "stop": ("/v1/completions", '{"model":"tiny","prompt":"x","stop":%s}' % S),
    "stop[0]": ("/v1/completions", '{"model":"tiny","prompt":"x","stop":[%s]}' % S),
    "guided_regex": ("/v1/completions", '{"model":"tiny","prompt":"x","guided_regex":%s}' % S),
    "guided_choice[0]": ("/v1/completions", '{"model":"tiny","prompt":"x","guided_choice":[%s]}' % S),
    "guided_grammar": ("/v1/completions", '{"model":"tiny","prompt":"x","guided_grammar":%s}' % S),
    "guided_json.enum[0]": ("/v1/completions", '{"model":"tiny","prompt":"x","guided_json":{"enum":[%s]}}' % S),
    "structured_outputs.regex": ("/v1/completions",
                                 '{"model":"tiny","prompt":"x","structured_outputs":{"regex":%s}}' % S),
    "model": ("/v1/completions", '{"model":%s,"prompt":"x"}' % S),
    "user": ("/v1/completions", '{"model":"tiny","prompt":"x","user":%s}' % S),
    "prediction.content": ("/v1/completions",
                           '{"model":"tiny","prompt":"x","prediction":{"type":"content","content":%s}}' % S),
    "messages[0].content": ("/v1/chat/completions", '{"model":"tiny","messages":[{"role":"user","content":%s}]}' % S),
    "messages[0].name": ("/v1/chat/completions",
                         '{"model":"tiny","messages":[{"role":"user","content":"x","name":%s}]}' % S),
    "messages[0].content[0].text": ("/v1/chat/completions", '{"model":"tiny","messages":[{"role":"user","content":'
                                                            '[{"type":"text","text":%s}]}]}' % S),
    "response_format.json_schema.schema.enum[0]": (
        "/v1/chat/completions", '{"model":"tiny","messages":[{"role":"user","content":"x"}],"response_format":'
                                '{"type":"json_schema","json_schema":{"name":"a","schema":{"enum":[%s]}}}}' % S),
}


@pytest.mark.parametrize("field", list(SURROGATE_BODIES))
def test_lone_surrogate_in_a_text_field_is_400_naming_it(server, field):
    path, body = SURROGATE_BODIES[field]
    r = httpx.post(server.url + path, headers={**HEADERS, "Content-Type": "application/json"},
                   content=body.encode(), timeout=30)
    assert r.status_code == 400, r.text
    err = rawhttp.openai_error(r.content)
    assert err["param"] == field and "lone surrogate" in err["message"], err


@pytest.mark.parametrize("body", [b'{"model":"tiny","prompt":"a\xff\xfeb"}',                  # not UTF-8
                                  b'{"model":"tiny","prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                  b'{"model":"tiny","prompt":"x","guided_json":' + b'{"a":' * 100_000 + b"1"
                                  + b"}" * 100_000 + b"}"])
def test_invalid_or_deeply_nested_json_body_is_400(server, body):
    r = httpx.post(server.url + "/v1/completions", headers={**HEADERS, "Content-Type": "application/json"},
                   content=body, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert rawhttp.openai_error(r.content)["code"] == "invalid_json"


def test_prediction_of_the_largest_allowed_length(server, reference):
    """A prediction as long as the context leaves after the prompt runs (output as without it); one token more is
    a 400 naming prediction."""
    tok = reference.tokenizer
    prompt = "the quick brown"
    room = server.state.engine.max_model_len - len(tok(prompt, add_special_tokens=False)["input_ids"])
    words = " ".join(["the quick brown fox"] * room)
    ids = tok(words, add_special_tokens=False)["input_ids"]
    fits = tok.decode(ids[:room])
    while len(tok(fits, add_special_tokens=False)["input_ids"]) > room:       # decode/encode may merge differently
        fits = fits[:-1]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", headers=HEADERS, timeout=120,
                   json={**body, "prediction": {"type": "content", "content": fits}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference.generate(
        prompt, SamplingParams(max_new_tokens=16, temperature=0)).text
    over = tok.decode(ids[: room + 8])
    r = httpx.post(server.url + "/v1/completions", headers=HEADERS, timeout=120,
                   json={**body, "prediction": {"type": "content", "content": over}})
    assert r.status_code == 400 and rawhttp.openai_error(r.content)["param"] == "prediction", r.text
