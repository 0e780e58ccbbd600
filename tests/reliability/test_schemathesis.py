"""Property-based fuzzing of every operation in /openapi.json: no input may produce a 5xx.

A dedicated server with a 64-token context keeps each generated request cheap (a chat request's default
max_tokens is the rest of the context). In the positive mode the body's `model` is the served name, so the fuzzed
parameters reach validation, the scheduler and the engine instead of stopping at a 404 for an unknown model."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from serverkit import API_KEY, MODEL, InProcessServer


@pytest.fixture(scope="module")
def fuzz_server(tiny_pair):
    srv = InProcessServer(*tiny_pair, k=3, max_model_len=64)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_server_errors(api_schema, mode, figures):
    """Every operation, data valid per the schema (positive) and data that breaks it (negative). The loop is
    driven here rather than by schemathesis' pytest plugin, which does not support this pytest yet."""
    failures, statuses = [], {}
    operations = [r.ok() for r in api_schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions",
                                                "GET /v1/models", "GET /health", "GET /metrics"}
    for op in operations:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def fuzz(case):
            if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL
            r = case.call(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
            key = (case.operation.label, r.status_code)
            statuses[key] = statuses.get(key, 0) + 1
            case.validate_response(r, checks=[not_a_server_error])

        try:
            fuzz()
        except Unsatisfiable:               # nothing to break in an operation without parameters or body
            assert mode is GenerationMode.NEGATIVE and op.method.upper() == "GET"
        except Exception as e:  # noqa: BLE001 - collected, reported together below
            failures.append(f"{op.label}: {e}")
    figures.update(requests=sum(statuses.values()), status_5xx=sum(n for (_, c), n in statuses.items() if c >= 500),
                   generated=sum(n for (op, c), n in statuses.items() if c == 200 and op.startswith("POST")))
    assert not failures, "\n".join(failures)
    if mode is GenerationMode.POSITIVE:             # the fuzz reached the engine, not only the door
        assert statuses.get(("POST /v1/completions", 200), 0) > 0, statuses
        assert statuses.get(("POST /v1/chat/completions", 200), 0) > 0, statuses


def test_fuzz_server_still_healthy(fuzz_server):
    import httpx

    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    assert fuzz_server.metric("leaplm_requests_total", 'endpoint="/v1/completions",status="500"') == 0
    assert fuzz_server.metric("leaplm_requests_total", 'endpoint="/v1/chat/completions",status="500"') == 0


def _json_values():
    from hypothesis import strategies as st

    leaves = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8)
    return st.recursive(leaves, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "enum", "properties", "items", "required", "$ref", "anyOf", "pattern", "minLength",
                         "const", "x"]), kids, max_size=3), max_leaves=12)


def test_structured_and_prediction_fields_never_5xx(fuzz_server, figures):
    """The fields that reach a compiler or an aligner, fuzzed with hypothesis beyond what the OpenAPI schema
    describes (free text as regexes and grammars, arbitrary JSON as schemas, text as predictions): 0 5xx."""
    import httpx
    from hypothesis import strategies as st

    fields = st.one_of(
        st.builds(lambda t: {"guided_regex": t}, st.text(max_size=40)),
        st.builds(lambda t: {"guided_grammar": t}, st.text(max_size=40) | st.builds(lambda t: "start: " + t,
                                                                                     st.text(max_size=40))),
        st.builds(lambda c: {"guided_choice": c}, st.lists(st.text(max_size=6), max_size=5)),
        st.builds(lambda j: {"guided_json": j}, _json_values()),
        st.builds(lambda j: {"structured_outputs": j}, st.dictionaries(
            st.sampled_from(["json", "regex", "choice", "grammar", "json_object"]), _json_values(), max_size=2)),
        st.builds(lambda j: {"response_format": j}, _json_values()),
        st.builds(lambda t: {"prediction": {"type": "content", "content": t}}, st.text(max_size=200)),
        st.builds(lambda j: {"prediction": j}, _json_values()),
    )
    statuses: dict[int, int] = {}

    @given(extra=fields, chat=st.booleans())
    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def fuzz(extra, chat):
        body = {"model": MODEL, "max_tokens": 4, **extra}
        if chat:
            body["messages"] = [{"role": "user", "content": "hi"}]
        else:
            body["prompt"] = "the quick"
            body.pop("response_format", None)
        r = httpx.post(fuzz_server.url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body,
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (body, r.text[:500])

    fuzz()
    figures.update(requests=sum(statuses.values()), status_5xx=sum(n for c, n in statuses.items() if c >= 500),
                   status_200=statuses.get(200, 0), status_400=statuses.get(400, 0))
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses     # both reached: not all refused
