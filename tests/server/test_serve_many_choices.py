"""n up to 128 choices through the server (as Engine.generate_batch and `leaplm generate --samples` allow), with the
official openai client; and what admission does with a request that large: a request whose choices could never
be held (the KV-cache budget, or max_batch + max_queue sequences) is a 400 naming n, one that cannot be held now a
429 naming n, each before any of its sequences is queued, and the server goes on serving."""
from __future__ import annotations

import openai
import pytest

from leaplm.server.admission import Admission
from leaplm.server.protocol import APIError

from serverkit import API_KEY, MODEL, InProcessServer

MANY = 128
BUDGET_BYTES = 3000 * 512       # ~3000 tokens of the tiny target's cache (2 layers x 2 KV heads x 16 x fp32 x K,V)


@pytest.fixture(scope="module")
def wide_server(tiny_pair):
    """16 rows and 112 waiting places (128 sequences in flight at most), a KV-cache budget of a few thousand
    tokens."""
    srv = InProcessServer(*tiny_pair, method="draft", k=4, max_batch=16, max_queue=MANY - 16,
                          kv_cache_bytes=BUDGET_BYTES)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def wclient(wide_server):
    return openai.OpenAI(base_url=wide_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _in_flight_is_zero(srv) -> bool:
    return srv.metric("leaplm_sequences_in_flight") == 0 and srv.metric("leaplm_kv_cache_reserved_tokens") == 0


def test_128_choices_are_served_each_with_its_own_seed(wclient, wide_server):
    r = wclient.completions.create(model=MODEL, prompt="the quick brown fox", n=MANY, max_tokens=3, temperature=0.9,
                                   seed=11, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(MANY))
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 3 * MANY
    assert len({c.text for c in r.choices}) > 1                  # sampled: not 128 copies of one choice
    for i in (0, 77, MANY - 1):                                  # choice i samples with seed + i
        alone = wclient.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=3, temperature=0.9,
                                           seed=11 + i, extra_body={"ignore_eos": True})
        assert alone.choices[0].text == r.choices[i].text, i
    assert _in_flight_is_zero(wide_server)


def test_128_choices_stream(wclient):
    chunks = list(wclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=MANY,
                                                  max_tokens=2, temperature=0, stream=True,
                                                  stream_options={"include_usage": True}))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason is not None}
    assert finished == set(range(MANY))
    assert chunks[-1].usage.completion_tokens <= 2 * MANY


def test_choices_beyond_the_cache_budget_are_400_naming_n_and_the_server_goes_on(wclient, wide_server):
    B = wide_server.state.admission.budget_tokens
    assert MANY * 8 < B < 5000                          # 128 short choices fit, 128 long ones do not
    max_tokens = B // MANY + 1                          # one sequence fits the budget easily; 128 of them do not
    steps = wide_server.metric("leaplm_engine_steps_total")
    with pytest.raises(openai.BadRequestError) as e:
        wclient.completions.create(model=MODEL, prompt="hi", n=MANY, max_tokens=max_tokens, temperature=0)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "n" and err["code"] == "cache_budget_exceeded"
    assert str(B) in err["message"] and "max_tokens" in err["message"]
    assert wide_server.metric("leaplm_engine_steps_total") == steps       # refused before any decoding
    assert _in_flight_is_zero(wide_server)
    r = wclient.completions.create(model=MODEL, prompt="hi", n=MANY, max_tokens=2, temperature=0)
    assert len(r.choices) == MANY


def test_more_sequences_than_the_server_holds_are_400_naming_n(wclient, wide_server):
    with pytest.raises(openai.BadRequestError) as e:              # 2 prompts x 128 = 256 > 16 + 112
        wclient.completions.create(model=MODEL, prompt=["a", "b"], n=MANY, max_tokens=1, temperature=0)
    err = e.value.body
    assert err["param"] == "n" and "max_batch + max_queue = 128" in err["message"] and "--max-queue" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:              # beyond what any server serves
        wclient.completions.create(model=MODEL, prompt="a", n=MANY + 1, max_tokens=1)
    assert e.value.body["param"] == "n"
    assert len(wclient.completions.create(model=MODEL, prompt="a", n=2, max_tokens=1).choices) == 2


def test_choices_that_fit_later_are_429_naming_n():
    adm = Admission(max_batch=2, max_queue=6, budget_tokens=100, budget_bytes=100 * 512)
    adm.reserve(90)                                                # admitted sequences hold 90 of 100 tokens
    with pytest.raises(APIError) as e:
        adm.check(in_flight=1, reservations=[10] * 4, prompt_lens=[2], max_tokens=8, max_field="max_tokens",
                  prompt_field="prompt", n=4)
    assert e.value.status == 429 and e.value.param == "n" and e.value.code == "cache_full"
    assert int(e.value.headers["Retry-After"]) >= 1
    with pytest.raises(APIError) as e:                             # 1 + 8 sequences > 2 + 6 places
        adm.check(in_flight=1, reservations=[1] * 8, prompt_lens=[1], max_tokens=0, max_field="max_tokens",
                  prompt_field="prompt", n=8)
    assert e.value.status == 429 and e.value.param == "n" and e.value.code == "queue_full"
    adm.check(in_flight=1, reservations=[10], prompt_lens=[2], max_tokens=8, max_field="max_tokens",
              prompt_field="prompt", n=1)                          # one sequence of 10 fits what is left
    with pytest.raises(APIError) as e:                             # never: 400 (lower n)
        adm.check(in_flight=0, reservations=[30] * 4, prompt_lens=[2], max_tokens=28, max_field="max_tokens",
                  prompt_field="prompt", n=4)
    assert e.value.status == 400 and e.value.param == "n"


@pytest.mark.parametrize("max_batch", [1, 8, 16])
def test_the_default_queue_admits_the_largest_n_on_an_idle_server(max_batch):
    """Defaults: a request of n = 128 (MAX_N) fits max_batch + max_queue whatever max_batch, so what the API
    allows is served without a flag; the CLI's default is the config's. A queue set below that (the old default of
    64) refuses it with a 400 naming n and the --max-queue that would hold it (the negative control)."""
    from leaplm.cli.serve import serve
    from leaplm.config import ServerConfig
    from leaplm.server.protocol import MAX_N

    cfg = ServerConfig(max_batch=max_batch)
    adm = Admission(max_batch=cfg.max_batch, max_queue=cfg.max_queue, budget_tokens=None, budget_bytes=None)
    adm.check(in_flight=0, reservations=[3] * MAX_N, prompt_lens=[1], max_tokens=2, max_field="max_tokens",
              prompt_field="prompt", n=MAX_N)
    import inspect
    assert inspect.signature(serve).parameters["max_queue"].default.default == ServerConfig.max_queue
    old = Admission(max_batch=max_batch, max_queue=64, budget_tokens=None, budget_bytes=None)
    with pytest.raises(APIError) as e:
        old.check_count(MAX_N, MAX_N, "prompt")
    assert e.value.status == 400 and e.value.param == "n" and f"--max-queue {MAX_N - max_batch}" in e.value.message
