"""The server's structured-output fields (OpenAI's response_format, vLLM's guided_* and structured_outputs) to a
StructuredOutput, every error naming the request's own field."""
from __future__ import annotations

import pytest

from leaplm.config import ConfigError
from leaplm.structured.requests import from_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_response_format_kinds():
    assert from_request() is None
    assert from_request(response_format={"type": "text"}) is None
    assert from_request(response_format={"type": "json_object"}).kind == "json_object"
    so = from_request(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA,
                                                                              "strict": True}})
    assert so.kind == "json" and so.json == SCHEMA
    assert from_request(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA,
                                                                                "strict": False}}).json == SCHEMA


def test_vllm_spellings():
    assert from_request(guided_json=SCHEMA).kind == "json"
    assert from_request(guided_regex="[0-9]+").kind == "regex"
    assert from_request(guided_choice=["a", "b"]).choice == ["a", "b"]
    assert from_request(guided_grammar='root ::= "x"').kind == "grammar"
    assert from_request(structured_outputs={"regex": "a+"}).regex == "a+"
    assert from_request(structured_outputs={"json_object": True}).kind == "json_object"


@pytest.mark.parametrize("kw, field, reason", [
    (dict(response_format={"type": "xml"}), "response_format.type", "json_schema"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema", "name and schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
     "response_format.json_schema.name", "letters"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "a"}}),
     "response_format.json_schema.schema", "required"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": "yes"}}),
     "response_format.json_schema.strict", "true, false"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array",
                                                                                            "uniqueItems": True}}}),
     "response_format.json_schema.schema", "uniqueItems"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "x": 1}}),
     "response_format.json_schema.x", "unknown"),
    (dict(response_format={"type": "text", "json_schema": {}}), "response_format.json_schema", "only with"),
    (dict(guided_regex="a("), "guided_regex", "unclosed group"),
    (dict(guided_choice=[]), "guided_choice", "non-empty"),
    (dict(guided_json={"type": "strin"}), "guided_json", "Invalid type"),
    (dict(guided_grammar="start: nothing_here"), "guided_grammar", "unknown name"),
    (dict(structured_outputs={"regex": "(", "json": None}), "structured_outputs.regex", "unclosed"),
    (dict(structured_outputs={"xml": "<a/>"}), "structured_outputs.xml", "unknown field"),
    (dict(structured_outputs={}), "structured_outputs", "exactly one"),
    (dict(guided_regex="a", guided_choice=["b"]), "guided_choice", "one structured-output field"),
    (dict(response_format={"type": "json_object"}, guided_regex="a"), "response_format", "one structured-output"),
])
def test_bad_input_names_the_request_field(kw, field, reason):
    with pytest.raises(ConfigError) as e:
        from_request(**kw)
    assert e.value.field == field, e.value
    assert reason in e.value.message
