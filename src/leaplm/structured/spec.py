"""What a request's output must match, checked where the request is made.

One of: a JSON Schema (`json`), any JSON object (`json_object`), a regular expression (`regex`), one string of a
list (`choice`), or a grammar (`grammar`: Lark in llguidance's dialect, or GBNF, told apart by its `::=` rules).
llguidance compiles each into one grammar; a spec that does not compile is refused here with the library's
reason, and so is a JSON Schema keyword llguidance does not implement (it names it: never silently ignored).

JSON is written with fixed separators (", " between items, ": " after a key) and no other whitespace outside
strings: the grammar then forces every separator, key and closing bracket, and those tokens are drafted for free
(structured/state.py). A schema may choose other separators through llguidance's "x-guidance" key.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, field

from ..errors import ConfigError

JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutput:
    """Exactly one of the fields below is set. Errors name the field as `structured.<field>`."""

    json: dict | str | None = None
    """A JSON Schema (an object, or its JSON text): the output is one JSON value valid against it."""
    json_object: bool = False
    """The output is any JSON object."""
    regex: str | None = None
    """The output matches this regular expression in full (Rust regex syntax, as llguidance reads it)."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar: Lark (llguidance's dialect, `start:` rule) or GBNF (`root ::= ...`)."""
    compiled: str = field(default="", init=False, repr=False, compare=False)
    """The llguidance grammar all of the above compile to (set by validate)."""

    MAX_TEXT = 1 << 20          # characters of a schema, regex or grammar
    MAX_CHOICES = 4096

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if (getattr(self, k) is not None and getattr(self, k) is not False))

    def validate(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            raise ConfigError("structured", f"set exactly one of {', '.join(KINDS)}; got "
                                            f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        name = f"structured.{kind}"
        try:
            grammar = self._grammar(kind, name)
        except ValueError as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(name, str(e)) from None
        import llguidance as llg

        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error or messages:
            # a warning means llguidance would approximate or ignore part of it (an unknown format, say)
            raise ConfigError(name, "; ".join(m.strip() for m in messages) or "not accepted by llguidance")
        self.compiled = grammar

    def _grammar(self, kind: str, name: str) -> str:
        """The llguidance grammar text of the one field set (kind)."""
        import llguidance as llg

        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                _check_size(schema, name)
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise ConfigError(name, f"not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ConfigError(name, f"a JSON Schema must be an object, got {type(schema).__name__}")
            try:
                text = _json.dumps(schema, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ConfigError(name, f"not JSON-serialisable: {e}") from None
            _check_size(text, name)
            self.json = schema
            grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        elif kind == "json_object":
            if self.json_object is not True:
                raise ConfigError(name, f"must be true or false, got {self.json_object!r}")
            grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise ConfigError(name, "must be a non-empty string")
            _check_size(self.regex, name)
            grammar = llg.LLMatcher.grammar_from_regex(self.regex)
        elif kind == "choice":
            c = self.choice
            if not isinstance(c, (list, tuple)) or not c or not all(isinstance(s, str) and s for s in c):
                raise ConfigError(name, "must be a non-empty list of non-empty strings")
            if len(c) > self.MAX_CHOICES:
                raise ConfigError(name, f"at most {self.MAX_CHOICES} choices, got {len(c)}")
            self.choice = list(c)
            _check_size("".join(c), name)
            # Lark string literals take JSON's escapes
            grammar = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(_json.dumps(s) for s in c))
        else:
            g = self.grammar
            if not isinstance(g, str) or not g.strip():
                raise ConfigError(name, "must be a non-empty string")
            _check_size(g, name)
            if "::=" in g:
                from llguidance.gbnf_to_lark import gbnf_to_lark
                try:
                    g = gbnf_to_lark(g)
                except Exception as e:  # noqa: BLE001 - the converter's own parse errors, whatever their type
                    raise ConfigError(name, f"invalid GBNF grammar: {e}") from None
            grammar = llg.LLMatcher.grammar_from_lark(g)
        return grammar


def _check_size(text: str, name: str) -> None:
    if len(text) > StructuredOutput.MAX_TEXT:
        raise ConfigError(name, f"at most {StructuredOutput.MAX_TEXT} characters, got {len(text)}")
