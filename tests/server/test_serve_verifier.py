"""The `verifier` request field (leaplm extension) through the official `openai` client: it reaches the engine
(under the race a seeded sample is the same whatever K; under rejection sampling, asked for by the field, it
depends on K, which it would not if the field were dropped and the seed chose the race), and a bad value is a 400
naming the field."""
from __future__ import annotations

import pytest

from serverkit import MODEL

SEEDS = range(4)


def sample(client, verifier: str | None, k: int, seed: int, chat: bool = False) -> str:
    extra = {"ignore_eos": True, "speculative": {"method": "draft", "k": k, "adaptive_k": False}}
    if verifier is not None:
        extra["verifier"] = verifier
    kw = dict(model=MODEL, max_tokens=24, temperature=1.0, seed=seed, extra_body=extra)
    if chat:
        r = client.chat.completions.create(messages=[{"role": "user", "content": "the quick"}], **kw)
        return r.choices[0].message.content
    return client.completions.create(prompt="the quick", **kw).choices[0].text


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_verifier_field_reaches_the_engine(client, chat):
    race = {s: [sample(client, "race", k, s, chat) for k in (1, 6)] for s in SEEDS}
    assert all(a == b for a, b in race.values()), race                  # the race: K does not matter
    assert all(sample(client, None, 6, s, chat) == race[s][1] for s in SEEDS)   # auto with a seed: the race
    rejection = {s: [sample(client, "rejection", k, s, chat) for k in (1, 6, 6)] for s in SEEDS}
    assert all(r[1] == r[2] for r in rejection.values())                # seeded rejection reproduces at one K
    assert any(r[0] != r[1] for r in rejection.values()), rejection     # ... and its draws depend on K


@pytest.mark.parametrize("value", ["bogus", "", 1, True, ["race"]])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_bad_verifier_is_a_400_naming_the_field(client, value, chat):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        sample(client, value, 4, 0, chat)
    assert e.value.status_code == 400
    assert "verifier" in e.value.message and e.value.body.get("param") == "verifier", e.value.body
