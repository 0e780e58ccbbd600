"""engine/prepare.py: a request is prepared once, into a frozen value, by the one function every caller uses; the
method table is looked up in one place."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from leaplm.config import MAX_SAMPLES, ConfigError, SamplingParams
from leaplm.engine.engine import Engine
from leaplm.engine.prepare import PreparedRequest, prepare

SRC = Path(__file__).resolve().parents[2] / "src" / "leaplm"


@pytest.fixture(scope="module")
def engine(loaded):
    return Engine(loaded("llama_tied"), draft=loaded("llama_draft"), method="draft", k=3, adaptive_k=False)


def test_prepared_request_is_frozen_and_resolved(engine):
    req = engine.prepare("the quick brown", SamplingParams(max_new_tokens=4, temperature=0))
    assert isinstance(req, PreparedRequest)
    assert (req.method, req.k) == ("draft", 3)                      # the engine's, resolved here
    assert req.ids == engine.encode("the quick brown", req.params)
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.method = "none"
    plain = prepare(engine, req.ids, req.params, method="none", k=5)
    assert (plain.method, plain.k) == ("none", 0)                   # no drafts: K 0 whatever was asked


def test_a_prepared_request_runs_as_it_was_prepared(engine):
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    req = engine.prepare([5, 9, 2, 7], sp, method="none")
    out = engine.generate(req)
    assert out.stats.method == "none" and out.prompt_ids == [5, 9, 2, 7]
    assert out.token_ids == engine.generate([5, 9, 2, 7], sp).token_ids    # greedy: the same tokens as draft's
    with pytest.raises(ConfigError) as e:
        engine.generate(req, sp)
    assert e.value.field == "params"


@pytest.mark.parametrize("settings, field", [
    (dict(method="telepathy"), "method"), (dict(method=3), "method"), (dict(k=0), "k"), (dict(k=65), "k"),
    (dict(k=True), "k"), (dict(adaptive_k="yes"), "adaptive_k"), (dict(prompt_logprobs=21), "prompt_logprobs"),
])
def test_bad_settings_name_their_field(engine, settings, field):
    with pytest.raises(ConfigError) as e:
        engine.prepare([1, 2, 3], SamplingParams(max_new_tokens=2), **settings)
    assert e.value.field == field


def test_chat_messages_are_prepared_through_the_template(loaded):
    from leaplm.models.tokens import chat_prompt

    eng = Engine(loaded("llama_tied"), method="none")
    eng.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    try:
        msgs = [{"role": "user", "content": "hi"}]
        req = eng.prepare(msgs, SamplingParams(max_new_tokens=2))
        assert req.ids == eng.encode(chat_prompt(eng.tokenizer, msgs), req.params)
    finally:
        eng.tokenizer.chat_template = None


def test_samples_are_limited_as_the_cli(engine):
    with pytest.raises(ConfigError) as e:
        engine.generate_batch([1, 2, 3], [SamplingParams(max_new_tokens=1)] * (MAX_SAMPLES + 1))
    assert e.value.field == "samples"
    with pytest.raises(ConfigError):
        engine.generate_batch([1, 2, 3], [])


def test_the_method_table_is_looked_up_in_one_place():
    """propose/registry.py maps a method name to code (BUILDERS); Engine.proposer_factory is its one caller;
    request preparation (engine/prepare.py) resolves a request's method, and the step builds the row's proposer."""
    lookups, resolvers = [], []
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        rel = path.relative_to(SRC).as_posix()
        if re.search(r"BUILDERS\[", text):
            lookups.append(rel)
        if re.search(r"make_proposer_factory\(", text) and rel != "propose/registry.py":
            resolvers.append(rel)
    assert lookups == ["propose/registry.py"], lookups
    assert resolvers == ["engine/engine.py"], resolvers
    # the server and the scheduler take a prepared request: neither looks a method up again
    callers = sorted(p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")
                     if re.search(r"\.proposer_factory\(", p.read_text()))
    assert "engine/prepare.py" in callers
    assert all(c.startswith("engine/") and c != "engine/scheduler.py" for c in callers), callers
