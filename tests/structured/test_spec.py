"""StructuredOutput: each kind compiles; bad input is refused naming the field and llguidance's reason."""
from __future__ import annotations

import pytest

from leaplm.config import ConfigError, StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("kw", [dict(json=SCHEMA), dict(json='{"type": "string"}'), dict(json_object=True),
                                dict(regex="[0-9]{3}"), dict(choice=["yes", 'a "quoted"\nline']),
                                dict(grammar='start: "yes" | "no"'), dict(grammar='root ::= "yes" | "no"')],
                         ids=["schema", "schema_text", "json_object", "regex", "choice", "lark", "gbnf"])
def test_each_kind_compiles(kw):
    so = StructuredOutput(**kw)
    assert so.compiled and so.kind == next(iter(kw))


@pytest.mark.parametrize("kw, field, reason", [
    (dict(), "structured", "exactly one"),
    (dict(regex="a", choice=["b"]), "structured", "regex, choice"),
    (dict(regex="a("), "structured.regex", "unclosed group"),
    (dict(regex=""), "structured.regex", "non-empty"),
    (dict(json="{"), "structured.json", "not valid JSON"),
    (dict(json=[1]), "structured.json", "must be an object"),
    (dict(json={"type": "strin"}), "structured.json", "Invalid type"),
    (dict(json={"type": "array", "uniqueItems": True}), "structured.json", "uniqueItems"),  # refused by name
    (dict(json={"not": {"type": "string"}}), "structured.json", "not"),
    (dict(json={"type": "string", "format": "no-such-format"}), "structured.json", "Unknown format"),
    (dict(json={"x": float("nan")}), "structured.json", ""),
    (dict(choice=[]), "structured.choice", "non-empty"),
    (dict(choice=["a", ""]), "structured.choice", "non-empty"),
    (dict(choice="ab"), "structured.choice", "list"),
    (dict(grammar="start: undefined_rule"), "structured.grammar", "unknown name"),
    (dict(grammar="root ::= ("), "structured.grammar", ""),
    (dict(json_object="yes"), "structured.json_object", "true or false"),
    (dict(regex="a" * (StructuredOutput.MAX_TEXT + 1)), "structured.regex", "at most"),
])
def test_bad_input_names_the_field(kw, field, reason):
    with pytest.raises(ConfigError) as e:
        StructuredOutput(**kw)
    assert e.value.field == field
    assert reason in e.value.message
