"""The Monte Carlo lossless test once through the HTTP server: the path users hit most. Requests of 16 seeded
choices each, several in flight, mixing draft K = 4, K = 1 and no speculation, on the 8-word vocabulary of
tests/engine/test_lossless_sampling.py; same statistic, bound and negative control (a verifier that accepts every
draft must fail it)."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
import torch

from leaplm.config import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from mc_bounds import tv_and_bound  # noqa: E402
from test_lossless_sampling import PROCESSED, PROMPT, always_accept, exact_positions_2_3  # noqa: E402

from serverkit import API_KEY, MODEL, InProcessServer  # noqa: E402

N = 1200
CHOICES = 16                       # seeds s .. s + 15 per request (the server's n)
KINDS = [{"method": "draft", "k": 4, "adaptive_k": False}, {"method": "none"},
         {"method": "draft", "k": 1, "adaptive_k": False}]


def sample_over_http(url: str, tokenizer, params: dict, n: int = N, in_flight: int = 6) -> torch.Tensor:
    V = len(tokenizer.get_vocab())
    counts = torch.zeros(V, V, dtype=torch.float64)

    async def one(client, i):
        body = {"model": MODEL, "prompt": list(PROMPT), "max_tokens": 3, "n": CHOICES, "seed": i * CHOICES,
                "logprobs": 0, "ignore_eos": True, "speculative": KINDS[i % len(KINDS)], **params}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return [tokenizer.convert_tokens_to_ids(c["logprobs"]["tokens"]) for c in r.json()["choices"]]

    async def main():
        sem = asyncio.Semaphore(in_flight)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=120) as client:
            async def guarded(i):
                async with sem:
                    return await one(client, i)
            return await asyncio.gather(*[guarded(i) for i in range(n // CHOICES)])

    samples = [ids for batch in asyncio.run(main()) for ids in batch]
    for ids in samples:
        assert len(ids) == 3
        counts[ids[1], ids[2]] += 1
    return counts / len(samples)


def run_case(tiny_vocab, ref_probs, params: dict) -> tuple[float, float]:
    exact = exact_positions_2_3(tiny_vocab["target"].path, SamplingParams(**params), ref_probs)
    srv = InProcessServer(tiny_vocab["target"].path, tiny_vocab["near"].path, method="draft", k=4, max_batch=8,
                          max_queue=256)
    try:
        srv.wait_ready()
        got = sample_over_http(srv.url, tiny_vocab["target"].tokenizer, params)
    finally:
        srv.stop()
    return tv_and_bound(got, exact, N // CHOICES * CHOICES)


def test_server_samples_follow_the_target(tiny_vocab, ref_probs):
    tv, bound = run_case(tiny_vocab, ref_probs, PROCESSED)
    assert tv < bound, f"TV {tv:.4f} >= bound {bound:.4f}"


@pytest.fixture
def accept_everything(monkeypatch):
    patched = [m for name, m in list(sys.modules.items())
               if name.startswith("leaplm.engine") and hasattr(m, "verify_coupled")]
    assert patched
    for m in patched:
        monkeypatch.setattr(m, "verify_coupled", always_accept)
    always_accept.calls = 0


def test_negative_control_over_http(tiny_vocab, ref_probs, accept_everything):
    tv, bound = run_case(tiny_vocab, ref_probs, PROCESSED)
    assert always_accept.calls >= N // 3
    assert tv > bound, f"the wrong verifier passed: TV {tv:.4f} < bound {bound:.4f}"
