"""A request's structured-output fields, as the OpenAI-compatible server receives them, to a StructuredOutput.

  response_format       OpenAI's: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "json_schema":
                        {"name", "schema", "strict", "description"}}. strict: false is accepted and the schema is
                        enforced all the same (a valid output is what strict asks for; leaplm has no looser mode)
  guided_json, guided_regex, guided_choice, guided_grammar, structured_outputs
                        vLLM's spellings (structured_outputs: {"json" | "regex" | "choice" | "grammar" |
                        "json_object": ...})

At most one of them may be given. Every error is a ConfigError naming the request's own field
(response_format.json_schema.schema, guided_regex, structured_outputs.choice, ...) with llguidance's reason.
"""
from __future__ import annotations

import re

from ..config import ConfigError, StructuredOutput

VLLM_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def from_request(response_format: dict | None = None, structured_outputs: dict | None = None,
                 **guided) -> StructuredOutput | None:
    """The constraint a request asks for (None: none). guided: vLLM's guided_* fields by name (None when absent)."""
    unknown = set(guided) - set(VLLM_FIELDS)
    if unknown:
        raise TypeError(f"unknown structured-output fields: {sorted(unknown)}")
    given = [name for name, v in guided.items() if v is not None]
    if response_format is not None and response_format.get("type", "text") != "text":
        given.append("response_format")
    if structured_outputs is not None:
        given.append("structured_outputs")
    if len(given) > 1:
        raise ConfigError(given[1], f"give one structured-output field; got {', '.join(given)}")
    if not given:
        if response_format is not None:
            _response_format(response_format)        # {"type": "text"}: checked all the same
        return None
    name = given[0]
    if name == "response_format":
        return _response_format(response_format)
    if name == "structured_outputs":
        return _structured_outputs(structured_outputs)
    return _build(name, **{VLLM_FIELDS[name]: guided[name]})


def _response_format(rf) -> StructuredOutput | None:
    if not isinstance(rf, dict):
        raise ConfigError("response_format", "must be an object")
    kind = rf.get("type")
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise ConfigError(f"response_format.{sorted(extra)[0]}", "unknown field")
    if kind == "text":
        if "json_schema" in rf:
            raise ConfigError("response_format.json_schema", "only with type json_schema")
        return None
    if kind == "json_object":
        if "json_schema" in rf:
            raise ConfigError("response_format.json_schema", "only with type json_schema")
        return _build("response_format", json_object=True)
    if kind != "json_schema":
        raise ConfigError("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise ConfigError("response_format.json_schema", "must be an object with name and schema")
    extra = set(js) - _JSON_SCHEMA_KEYS
    if extra:
        raise ConfigError(f"response_format.json_schema.{sorted(extra)[0]}", "unknown field")
    if not isinstance(js.get("name"), str) or not _NAME.match(js["name"]):
        raise ConfigError("response_format.json_schema.name", "must be 1-64 letters, digits, '_' or '-'")
    if "strict" in js and not isinstance(js["strict"], bool) and js["strict"] is not None:
        raise ConfigError("response_format.json_schema.strict", "must be true, false or null")
    if "description" in js and not isinstance(js["description"], (str, type(None))):
        raise ConfigError("response_format.json_schema.description", "must be a string")
    if "schema" not in js:
        raise ConfigError("response_format.json_schema.schema", "is required (the JSON Schema to follow)")
    return _build("response_format.json_schema.schema", json=js["schema"])


def _structured_outputs(so) -> StructuredOutput:
    if not isinstance(so, dict):
        raise ConfigError("structured_outputs", "must be an object")
    allowed = {"json", "regex", "choice", "grammar", "json_object"}
    extra = set(so) - allowed
    if extra:
        raise ConfigError(f"structured_outputs.{sorted(extra)[0]}",
                          f"unknown field; one of {', '.join(sorted(allowed))}")
    try:
        return StructuredOutput(**{k: v for k, v in so.items() if v is not None and v is not False})
    except ConfigError as e:
        raise ConfigError(e.field.replace("structured", "structured_outputs", 1), e.message) from None


def _build(field: str, **kw) -> StructuredOutput:
    """StructuredOutput(**kw), its errors named `field` (a nested field of the spec keeps its suffix)."""
    try:
        return StructuredOutput(**kw)
    except ConfigError as e:
        raise ConfigError(field, e.message) from None
