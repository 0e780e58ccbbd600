"""Bad input: each case gets the right status, OpenAI's error shape naming the field, and the server still answers
a normal request right after it."""
from __future__ import annotations

import json
import math

import httpx
import pytest

from serverkit import API_KEY, MODEL

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
OK_CMPL = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def c(**kw):
    return {**OK_CMPL, **kw}


def ch(**kw):
    return {**OK_CHAT, **kw}


def drop(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


LONG = "the quick brown fox " * 300           # far beyond the 1024-token context

# (id, path, body: dict or raw bytes, status, param expected in the error, words expected in the message)
CASES = [
    ("malformed-json", CMPL, b'{"model": "tiny", "prompt": ', 400, None, ["JSON"]),
    ("non-object-json", CMPL, b'[1, 2, 3]', 400, None, ["object"]),
    ("string-json", CHAT, b'"hello"', 400, None, ["object"]),
    ("empty-body", CMPL, b'', 400, None, ["body"]),
    ("missing-model", CMPL, drop(OK_CMPL, "model"), 400, "model", ["required"]),
    ("missing-prompt", CMPL, drop(OK_CMPL, "prompt"), 400, "prompt", ["required"]),
    ("empty-prompt", CMPL, c(prompt=""), 400, "prompt", ["empty"]),
    ("empty-prompt-list", CMPL, c(prompt=[]), 400, "prompt", ["non-empty"]),
    ("empty-string-in-list", CMPL, c(prompt=["a", ""]), 400, "prompt", ["empty"]),
    ("prompt-wrong-type", CMPL, c(prompt={"text": "x"}), 400, "prompt", []),
    ("token-id-out-of-vocab", CMPL, c(prompt=[1, 2, 10**6]), 400, "prompt", ["vocabulary", "1000000"]),
    ("token-id-negative", CMPL, c(prompt=[1, -5]), 400, "prompt", []),
    ("empty-messages", CHAT, ch(messages=[]), 400, "messages", []),
    ("messages-not-list", CHAT, ch(messages="hi"), 400, "messages", []),
    ("bad-role", CHAT, ch(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role", ["wizard"]),
    ("image-content", CHAT, ch(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages[0].content", ["image_url"]),
    ("content-number", CHAT, ch(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", []),
    ("tool-role-field", CHAT, ch(messages=[{"role": "user", "content": "x", "tool_calls": []}]), 400,
     "messages[0].tool_calls", ["unknown"]),
    ("prompt-longer-than-context", CMPL, c(prompt=LONG), 400, "prompt", ["1024"]),
    ("prompt-plus-max-tokens", CMPL, c(prompt="hello world", max_tokens=1020), 400, "max_tokens", ["1020", "1024"]),
    ("chat-plus-max-completion-tokens", CHAT, ch(max_completion_tokens=1023, max_tokens=None), 400,
     "max_completion_tokens", ["1023", "1024"]),
    ("max-tokens-zero", CMPL, c(max_tokens=0), 400, "max_tokens", []),
    ("max-tokens-negative", CMPL, c(max_tokens=-3), 400, "max_tokens", []),
    ("max-tokens-fractional", CMPL, c(max_tokens=2.5), 400, "max_tokens", ["integer"]),
    ("max-tokens-integral-float", CMPL, c(max_tokens=3.0), 400, "max_tokens", ["integer"]),
    ("max-tokens-string", CMPL, c(max_tokens="5"), 400, "max_tokens", ["integer"]),
    ("max-tokens-bool", CMPL, c(max_tokens=True), 400, "max_tokens", []),
    ("max-tokens-huge", CMPL, c(max_tokens=10**30), 400, "max_tokens", []),
    ("temperature-negative", CMPL, c(temperature=-0.5), 400, "temperature", []),
    ("temperature-nan", CMPL, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature", ["finite"]),
    ("temperature-inf", CMPL, b'{"model": "tiny", "prompt": "x", "temperature": Infinity}', 400, "temperature", []),
    ("temperature-huge", CMPL, c(temperature=1e9), 400, "temperature", []),
    ("temperature-string", CMPL, c(temperature="hot"), 400, "temperature", []),
    ("top-p-zero", CMPL, c(top_p=0), 400, "top_p", []),
    ("top-p-above-one", CMPL, c(top_p=1.5), 400, "top_p", []),
    ("top-k-negative", CMPL, c(top_k=-1), 400, "top_k", []),
    ("top-k-float", CMPL, c(top_k=2.5), 400, "top_k", []),
    ("min-p-above-one", CMPL, c(min_p=2), 400, "min_p", []),
    ("repetition-penalty-zero", CMPL, c(repetition_penalty=0), 400, "repetition_penalty", []),
    ("repetition-penalty-huge", CMPL, c(repetition_penalty=1000), 400, "repetition_penalty", []),
    ("presence-penalty", CMPL, c(presence_penalty=0.5), 400, "presence_penalty", ["not supported"]),
    ("frequency-penalty", CHAT, ch(frequency_penalty=-1), 400, "frequency_penalty", ["not supported"]),
    ("logit-bias", CMPL, c(logit_bias={"5": 10}), 400, "logit_bias", ["not supported"]),
    ("n-zero", CMPL, c(n=0), 400, "n", []),
    ("n-too-big", CMPL, c(n=1000), 400, "n", []),
    ("best-of", CMPL, c(best_of=3), 400, "best_of", []),
    ("suffix", CMPL, c(suffix="end"), 400, "suffix", ["not supported"]),
    ("top-logprobs-above-20", CHAT, ch(logprobs=True, top_logprobs=21), 400, "top_logprobs", []),
    ("top-logprobs-without-logprobs", CHAT, ch(top_logprobs=2), 400, "top_logprobs", ["logprobs"]),
    ("completion-logprobs-above-20", CMPL, c(logprobs=50), 400, "logprobs", []),
    ("empty-stop", CMPL, c(stop=""), 400, "stop", ["empty"]),
    ("empty-stop-in-list", CMPL, c(stop=["a", ""]), 400, "stop", ["empty"]),
    ("too-many-stops", CMPL, c(stop=[f"s{i}" for i in range(17)]), 400, "stop", ["16"]),
    ("stop-wrong-type", CMPL, c(stop=5), 400, "stop", []),
    ("seed-string", CMPL, c(seed="abc"), 400, "seed", []),
    ("seed-huge", CMPL, c(seed=2**70), 400, "seed", []),
    ("stream-options-without-stream", CMPL, c(stream_options={"include_usage": True}), 400, "stream_options", []),
    ("unknown-field", CMPL, c(frobnicate=1), 400, "frobnicate", ["unknown"]),
    ("tools", CHAT, ch(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", ["not supported"]),
    ("response-format-unknown-type", CHAT, ch(response_format={"type": "yaml"}), 400, "response_format.type",
     ["json_schema"]),
    ("guided-regex-invalid", CMPL, c(guided_regex="a("), 400, "guided_regex", ["unclosed group"]),
    ("json-schema-unsupported-keyword", CHAT, ch(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}), 400, "response_format.json_schema.schema",
     ["uniqueItems"]),
    ("speculative-unknown-method", CMPL, c(speculative={"method": "magic"}), 400, "speculative.method", []),
    ("speculative-unavailable-method", CMPL, c(speculative={"method": "layerskip"}), 400, "speculative.method",
     ["layerskip"]),
    ("speculative-k-zero", CMPL, c(speculative={"method": "draft", "k": 0}), 400, "speculative.k", []),
    ("speculative-not-object", CMPL, c(speculative="none"), 400, "speculative", []),
    ("unknown-model", CMPL, c(model="gpt-4"), 404, "model", ["gpt-4"]),
    ("prediction-type", CHAT, ch(prediction={"type": "text", "content": "x"}), 400, "prediction.type", ["content"]),
    ("prediction-not-text", CMPL, c(prediction={"type": "content", "content": [{"type": "image_url", "text": "x"}]}),
     400, "prediction.content[0].type", ["text"]),
    ("prediction-text-number", CHAT, ch(prediction={"type": "content", "content": [{"type": "text", "text": 3}]}),
     400, "prediction.content[0].text", ["string"]),
    ("prediction-missing-content", CMPL, c(prediction={"type": "content"}), 400, "prediction.content", ["required"]),
    ("prediction-string", CHAT, ch(prediction="just text"), 400, "prediction", ["an object"]),
    ("prediction-too-long", CMPL, c(prediction={"type": "content", "content": LONG}), 400, "prediction",
     ["longer than"]),
    ("prediction-huge", CHAT, ch(prediction={"type": "content", "content": "x" * 3_000_000}), 400, "prediction",
     ["characters"]),
]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as h:
        yield h


def assert_error_shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    return err


def assert_still_works(http: httpx.Client) -> None:
    r = http.post(CMPL, json={**OK_CMPL, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("case", CASES, ids=[x[0] for x in CASES])
def test_bad_input(http, case):
    _, path, body, status, param, words = case
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        body = {k: v for k, v in body.items() if v is not None}
        r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    err = assert_error_shape(r, status)
    assert err["param"] == param, err
    if param is not None:
        assert param.split("[")[0].split(".")[0] in err["message"], err
    for w in words:
        assert w in err["message"], err
    assert_still_works(http)


def test_no_nan_in_sampling_params_reaches_the_engine():
    assert not math.isfinite(float("nan"))     # guard for the NaN cases above: json.loads accepts NaN


def test_missing_and_bad_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": "Basic x"}):
        r = httpx.post(server.url + CMPL, json=OK_CMPL, headers=headers, timeout=30)
        err = assert_error_shape(r, 401)
        assert err["type"] == "authentication_error"
        assert API_KEY not in r.text
    r = httpx.get(server.url + "/v1/models", timeout=30)
    assert_error_shape(r, 401)
    # documented policy: probes and scrapers need no key
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 200


def test_body_over_the_limit_is_413(http):
    big = json.dumps({**OK_CMPL, "prompt": "x" * (5 << 20)})
    err = assert_error_shape(http.post(CMPL, content=big, headers={"Content-Type": "application/json"}), 413)
    assert "bytes" in err["message"]

    def chunks():                       # no Content-Length: counted while read
        for _ in range(6):
            yield b"x" * (1 << 20)
    assert_error_shape(http.post(CMPL, content=chunks(), headers={"Content-Type": "application/json"}), 413)
    assert_still_works(http)


def test_unknown_route_and_method(http):
    assert_error_shape(http.get("/v1/nothing"), 404)
    assert_error_shape(http.get(CMPL), 405)
    assert_still_works(http)


def test_non_json_content_type(http):
    r = http.post(CMPL, content=b"model=tiny&prompt=x", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert_error_shape(r, 400)
    r = http.post(CMPL, content=b"\xff\xfe\x00", headers={"Content-Type": "application/json"})
    assert_error_shape(r, 400)
    assert_still_works(http)


def _refusals_repeated(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("leaplm_refusals_repeated_total "):
            return float(line.split()[-1])
    raise AssertionError("leaplm_refusals_repeated_total missing from /metrics")


@pytest.fixture
def parses(monkeypatch) -> list:
    """One entry per request body parsed and validated (every one goes through the lone-surrogate check)."""
    import leaplm.server.protocol as protocol

    seen: list = []
    real = protocol.lone_surrogate
    monkeypatch.setattr(protocol, "lone_surrogate", lambda data: (seen.append(1), real(data))[1])
    return seen


def test_a_body_refused_before_it_ran_gets_the_same_400_without_being_parsed(http, parses):
    """The 400 a body got before it ran (validation, planning, a grammar llguidance refuses) is answered again,
    byte for byte, from a digest of its raw bytes: not parsed, validated or planned again. Another byte, another
    Content-Type or another route is a body of its own; a body answered 200 runs every time."""
    json_type = {"Content-Type": "application/json"}
    for case in ("max-tokens-zero", "prompt-longer-than-context", "guided-regex-invalid",
                 "json-schema-unsupported-keyword"):
        _, path, body, status, param, _ = next(x for x in CASES if x[0] == case)
        raw = json.dumps(body).encode()
        first = http.post(path, content=raw, headers=json_type)
        assert_error_shape(first, 400)
        count, repeated = len(parses), _refusals_repeated(http)
        again = [http.post(path, content=raw, headers=json_type) for _ in range(3)]
        assert len(parses) == count and _refusals_repeated(http) == repeated + 3, case
        assert all(r.status_code == 400 and r.content == first.content for r in again), case
        assert again[0].json()["error"]["param"] == param
        for other, headers in ((raw + b" ", json_type), (raw, {"Content-Type": "application/json; charset=utf-8"})):
            r = http.post(path, content=other, headers=headers)
            assert r.status_code == 400 and r.json() == first.json()
        assert len(parses) == count + 2, case
    count = len(parses)
    ok = json.dumps({**OK_CMPL, "temperature": 0}).encode()
    assert [http.post(CMPL, content=ok, headers=json_type).status_code for _ in range(2)] == [200, 200]
    assert len(parses) == count + 2


def test_a_400_given_after_the_request_ran_is_not_kept(http, parses):
    """A grammar failing while generating is a 400 that depends on what ran (sampled tokens may differ): the body
    is parsed and run again each time."""
    body = json.dumps({**OK_CMPL, "temperature": 0, "guided_regex": "(x{1000}){1000}"}).encode()
    answers = [http.post(CMPL, content=body, headers={"Content-Type": "application/json"}) for _ in range(2)]
    assert [assert_error_shape(r, 400)["code"] for r in answers] == ["grammar_error"] * 2
    assert len(parses) == 2


def test_refused_bodies_kept_are_the_last_few(server, http, parses, monkeypatch):
    from leaplm.server.state import Recent

    monkeypatch.setattr(server.state, "refused", Recent(2))
    bodies = [json.dumps(c(max_tokens=-i)).encode() for i in range(1, 4)]
    for b in bodies + bodies[1:] + bodies[:1]:
        assert_error_shape(http.post(CMPL, content=b, headers={"Content-Type": "application/json"}), 400)
    assert len(parses) == 4             # the three, then the first again (pushed out by the next two)
