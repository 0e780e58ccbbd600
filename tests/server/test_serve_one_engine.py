"""One engine behind every interface: 16 concurrent greedy requests with mixed methods and K each equal the same
request alone, and a seeded sampled request gives the same tokens from the CLI, the Python API and the server."""
from __future__ import annotations

import asyncio
import json

from typer.testing import CliRunner

from leaplm import Engine, SamplingParams
from leaplm.cli import app

from serverkit import MODEL

PROMPTS = [f"{w} {i}" for i, w in enumerate(["the quick", "déjà vu", "def add(a", "東京 と", "speculative",
                                             "un café", "über", "hello", "🙂 🚀", "return a + b",
                                             "lazy dog", "crème", "emoji", "verifies them", "fox jumps",
                                             "naïve façade"])]
# per request: the speculation it asks for (the server's default is draft, K = 4, adaptive)
VARIANTS = [{"method": "none"}, {"method": "draft", "k": 1, "adaptive_k": False}, {},
            {"method": "draft", "k": 6, "adaptive_k": False}, {"method": "ngram", "k": 3, "adaptive_k": False},
            {"method": "suffix", "k": 5}, {"method": "draft", "k": 2}, {"method": "ngram", "k": 8}] * 2


async def _complete(client, prompt: str, max_tokens: int, speculative: dict, **kw):
    extra = {"ignore_eos": True, **({"speculative": speculative} if speculative else {})}
    r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, logprobs=0,
                                        extra_body=extra, **kw)
    return r.choices[0]


def test_16_concurrent_greedy_requests_with_mixed_methods_equal_each_alone(aclient):
    """Alone = the same request (same method and K) with nothing else running on the server."""
    lengths = [20 + 3 * i for i in range(16)]              # rows leave at different steps

    async def main():
        crowd = await asyncio.gather(*[_complete(aclient, p, n, v, temperature=0)
                                       for p, n, v in zip(PROMPTS, lengths, VARIANTS)])
        single = [await _complete(aclient, p, n, v, temperature=0) for p, n, v in zip(PROMPTS, lengths, VARIANTS)]
        return crowd, single

    crowd, single = asyncio.run(main())
    for c, s, n in zip(crowd, single, lengths):
        assert c.logprobs.tokens == s.logprobs.tokens and c.text == s.text
        assert len(c.logprobs.tokens) == n


def test_cli_python_api_and_server_give_the_same_seeded_output(client, tiny_pair):
    target, draft = tiny_pair
    prompt, seed, n = "the lazy dog", 5, 24
    api = Engine(target, draft=draft, method="draft", k=4).generate(
        prompt, SamplingParams(max_new_tokens=n, temperature=0.8, seed=seed, ignore_eos=True))
    res = CliRunner().invoke(app, ["generate", prompt, "--model", target, "--draft", draft, "--method", "draft",
                                   "--k", "4", "--temperature", "0.8", "--seed", str(seed), "--max-new-tokens",
                                   str(n), "--ignore-eos", "--json"])
    assert res.exit_code == 0, res.output
    cli = json.loads(res.stdout)["samples"][0]
    srv = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0.8, seed=seed,
                                    extra_body={"ignore_eos": True})
    assert cli["token_ids"] == api.token_ids
    assert cli["text"] == api.text == srv.choices[0].text
    assert srv.usage.completion_tokens == n
