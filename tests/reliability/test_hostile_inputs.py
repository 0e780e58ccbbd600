"""Hostile request fields: grammars and schemas that are huge, deeply nested, ambiguous or pathological for
llguidance (exponential regexes, 10,000-alternative enums, recursive schemas), predictions of the largest size the
context allows, bodies nested 100,000 deep, and lone surrogates in every text field.

Each is refused with a 400 naming its field, or runs within its budget: BUDGET_S seconds from sending to the last
byte of the answer (grammars are compiled off the event loop, bounded by llguidance's own limits, and the row that
runs a grammar copies the matcher the request's preparation built, so no engine step waits on a compile), and
MEMORY_MB of resident-memory growth for the whole attack. Ordinary greedy requests running meanwhile keep their
answers (each equal to its run alone); their latency during the attack is reported against a calm phase
(p50/p99; the `soak` variant, with more requests, also holds p99 within 2x)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

import rawhttp
from leaplm import SamplingParams
from serverkit import API_KEY, MODEL

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


async def _ordinary(h: httpx.AsyncClient, until: float, lat: list[float], texts: list[tuple[str, str]]) -> None:
    prompts = ["the quick brown", "def add(a", "un café"]
    i = 0
    while time.monotonic() < until:
        p = prompts[i % 3]
        i += 1
        t = time.perf_counter()
        r = await h.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0})
        lat.append(time.perf_counter() - t)
        assert r.status_code == 200, r.text
        texts.append((p, r.json()["choices"][0]["text"]))


async def _hostile(h: httpx.AsyncClient, name: str, fields: dict | str) -> tuple[str, int, dict, float]:
    t = time.perf_counter()
    if isinstance(fields, str):
        text = json.dumps(_body({}))[:-1] + ", " + fields + "}"
        r = await h.post("/v1/completions", content=text.encode(), headers={"Content-Type": "application/json"})
    else:
        r = await h.post("/v1/completions", json=_body(fields))
    return name, r.status_code, r.json(), time.perf_counter() - t


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _attack(server, reference, figures, seconds: float, rounds: int) -> tuple[float, float]:
    """A calm phase (3 clients of ordinary requests for `seconds`), then the same clients while an attacker sends
    every attack in turn, `rounds` times; returns (calm p99, attack p99) of the ordinary requests."""
    async def main():
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=120, limits=limits) as h:
            calm, texts = [], []
            end = time.monotonic() + seconds
            await asyncio.gather(*[_ordinary(h, end, calm, texts) for _ in range(3)])
            during: list[float] = []
            stop = time.monotonic() + 3600
            clients = [asyncio.create_task(_ordinary(h, stop, during, texts)) for _ in range(3)]
            results = []
            for _ in range(rounds):                       # one attacker, each attack in turn
                for n, (f, _, _) in ATTACKS.items():
                    results.append(await _hostile(h, n, f))
            attack_s = time.monotonic()
            while len(during) < max(30, len(calm) // 2) and time.monotonic() - attack_s < seconds:
                await asyncio.sleep(0.05)                 # enough ordinary requests measured during the attack
            for c in clients:
                c.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
            return calm, during, texts, results

    rss0 = server.metric("process_resident_memory_bytes")
    calm, during, texts, results = asyncio.run(main())
    rss_mb = (server.metric("process_resident_memory_bytes") - rss0) / 2**20
    for name, code, body, took in results:
        _, allowed, field = ATTACKS[name]
        assert code in allowed, (name, code, body)
        if code == 400:
            err = body["error"]
            assert err["param"] == field and (field or "") in err["message"], (name, body)
            assert field is not None or err["code"] == "invalid_json", (name, body)
        assert took < BUDGET_S, (name, took)
    want = {p: reference.generate(p, SamplingParams(max_new_tokens=16, temperature=0)).text for p, _ in texts}
    assert [(p, t) for p, t in texts if t != want[p]] == []
    assert rss_mb < MEMORY_MB, rss_mb
    p99_calm, p99_attack = _pct(calm, 0.99), _pct(during, 0.99)
    figures.update(ordinary_calm=len(calm), ordinary_attack=len(during), hostile=len(results),
                   p50_calm_ms=1000 * _pct(calm, 0.5), p50_attack_ms=1000 * _pct(during, 0.5),
                   p99_calm_ms=1000 * p99_calm, p99_attack_ms=1000 * p99_attack, p99_ratio=p99_attack / p99_calm,
                   slowest_hostile_s=max(t for *_, t in results), rss_growth_mb=rss_mb,
                   refused_400=sum(c == 400 for _, c, _, _ in results))
    return p99_calm, p99_attack


def test_hostile_grammars_run_within_budget_beside_ordinary_requests(server, reference, figures):
    _attack(server, reference, figures, seconds=3.0, rounds=1)


@pytest.mark.slow
@pytest.mark.soak
def test_hostile_grammar_attack_keeps_ordinary_p99_within_2x(server, reference, figures):
    calm, attack = _attack(server, reference, figures, seconds=20.0, rounds=5)
    assert attack <= 2 * calm, (calm, attack)


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
