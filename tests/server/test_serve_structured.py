"""Structured output through a real server and the official openai client: response_format (json_schema, with
strict, and json_object), vLLM's guided_* and structured_outputs fields; outputs equal Engine(method="none") under
the same constraint and validate against their schema; bad input is a 400 naming the field."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from leaplm import SamplingParams, StructuredOutput

from serverkit import MODEL

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "describe a person as json"}]


def chat_text(reference) -> str:
    return reference.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_response_format_json_schema_equals_constrained_plain_decoding(client, reference):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    ref = reference.generate(chat_text(reference), SamplingParams(max_new_tokens=200, temperature=0,
                                                                  structured=StructuredOutput(json=PERSON)))
    content = r.choices[0].message.content
    assert content == ref.text and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(content), PERSON)
    assert r.usage.model_extra["speculative"]["method"] == "draft"


def test_sampled_outputs_validate(client):
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_and_streaming(client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0,
                                            stream=True, response_format={"type": "json_object"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if finish == ["stop"]:
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == ["length"] and text.startswith("{")


def test_vllm_fields_on_completions(client, reference):
    for extra, spec in [({"guided_regex": "[a-z]{2,5}-[0-9]{3}"}, StructuredOutput(regex="[a-z]{2,5}-[0-9]{3}")),
                        ({"guided_choice": ["yes", "no", "maybe"]}, StructuredOutput(choice=["yes", "no", "maybe"])),
                        ({"structured_outputs": {"json": PERSON}}, StructuredOutput(json=PERSON)),
                        ({"guided_grammar": 'root ::= "a" [b-d]+ "z"'},
                         StructuredOutput(grammar='root ::= "a" [b-d]+ "z"'))]:
        r = client.completions.create(model=MODEL, prompt="the answer:", max_tokens=60, temperature=0,
                                      extra_body=extra)
        ref = reference.generate("the answer:", SamplingParams(max_new_tokens=60, temperature=0, structured=spec))
        assert r.choices[0].text == ref.text, extra
        assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(extra_body={"guided_regex": "a("}), "guided_regex", "unclosed group"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}), "response_format.json_schema.schema", "uniqueItems"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
     "response_format.json_schema.schema", "Invalid type"),
    (dict(response_format={"type": "yaml"}), "response_format.type", "json_schema"),
    (dict(extra_body={"guided_choice": []}), "guided_choice", "non-empty"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "response_format", "one"),
])
def test_bad_constraints_are_400_naming_the_field(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, **kwargs)
    err = e.value.body
    assert err["param"] == param, err
    assert words in err["message"]


def test_repeated_structured_fields_are_built_once(server, monkeypatch):
    """A request repeating structured-output fields another sent (the same text) reuses what they came to: the
    StructuredOutput, or the 400; the answers are the same as the first's. Other text is built on its own."""
    import httpx

    from leaplm.server.protocol import CompletionRequest

    built = []
    real = CompletionRequest.structured_output

    def counting(self):
        built.append(self.guided_regex)
        return real(self)

    monkeypatch.setattr(CompletionRequest, "structured_output", counting)
    h = httpx.Client(base_url=server.url, headers=server.headers, timeout=60)

    def post(**fields):
        return h.post("/v1/completions", json={"model": MODEL, "prompt": "the quick", "max_tokens": 6,
                                                "temperature": 0, **fields})

    good, bad = "(ab|cd)+ kept once", "((unclosed kept once"
    answers = [post(guided_regex=good) for _ in range(3)]
    assert [r.status_code for r in answers] == [200] * 3
    assert len({r.json()["choices"][0]["text"] for r in answers}) == 1
    refused = [post(guided_regex=bad) for _ in range(3)]
    assert [r.status_code for r in refused] == [400] * 3
    assert all(r.json() == refused[0].json() and r.json()["error"]["param"] == "guided_regex" for r in refused)
    assert built == [good, bad]
    assert post(guided_regex="(ab|cd)+ kept twice").status_code == 200
    assert built == [good, bad, "(ab|cd)+ kept twice"]


def test_a_repeated_schema_is_built_once_as_the_metrics_count(server):
    """Requests of different prompts sharing one JSON Schema: the first builds it (a cache miss, its build time
    observed), the others find it kept (hits); /metrics counts both."""
    import httpx

    schema = {"type": "object", "properties": {"kept_by_its_text": {"type": "integer"}},
              "required": ["kept_by_its_text"]}
    h = httpx.Client(base_url=server.url, headers=server.headers, timeout=60)

    def counts():
        return (server.metric("leaplm_grammar_cache_total", 'result="hit"'),
                server.metric("leaplm_grammar_cache_total", 'result="miss"'),
                server.metric("leaplm_grammar_build_seconds_count", 'cache="miss"'),
                server.metric("leaplm_grammar_build_seconds_count", 'cache="hit"'))

    before = counts()
    for prompt in ("the quick", "brown fox", "lazy dog"):
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                                            "guided_json": schema})
        assert r.status_code == 200, r.text
    after = counts()
    assert [a - b for a, b in zip(after, before)] == [2, 1, 1, 2]
    r = h.post("/v1/completions", json={"model": MODEL, "prompt": "the quick", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and counts() == after            # no structured fields: nothing looked up
