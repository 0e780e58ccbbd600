"""`leaplm serve` on a GGUF target and draft running on libllama, through the official `openai` client: two
streams in flight at once, greedy and seeded, each one's text equal to the same request run alone on the same
server, and the backend reported by /metrics (`leaplm_backend_info`)."""
from __future__ import annotations

import asyncio
import time

import pytest

from leaplm.models.gguf_export import export_gguf
from leaplm.models.llamacpp.binding import available

from serverkit import API_KEY, MODEL, ServerProcess, write_pair

pytestmark = pytest.mark.skipif(not available(), reason="the llamacpp extra (llama-cpp-python) is not installed")

PROMPTS = ["the quick brown", "def add(a, b):"]
SETTINGS = {"greedy": dict(temperature=0), "seeded": dict(temperature=0.9, top_p=0.95, seed=11)}


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory):
    """`leaplm serve` (a subprocess) on the serverkit pair exported as Q8_0 GGUF files, draft-model speculation."""
    d = tmp_path_factory.mktemp("gguf_pair")
    target, draft = write_pair(d, eos="<|endoftext|>")
    files = [str(export_gguf(src, str(d / f"{name}.gguf"), "q8_0").path)
             for name, src in (("target", target), ("draft", draft))]
    # every step's tokens sent at its end (no coalescing): the chunks' arrival times show the two streams overlap
    srv = ServerProcess(files[0], files[1], "--method", "draft", "--k", "4", "--max-batch", "4",
                        "--backend", "llamacpp", "--stream-interval-ms", "0")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


async def stream(client, prompt: str, settings: dict) -> tuple[str, list[float]]:
    """(text, arrival time of each chunk)."""
    out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, stream=True,
                                          extra_body={"ignore_eos": True}, **settings)
    text, times = [], []
    async for c in out:
        if c.choices and c.choices[0].text:
            text.append(c.choices[0].text)
            times.append(time.monotonic())
    return "".join(text), times


@pytest.mark.parametrize("name", list(SETTINGS))
def test_two_concurrent_streams_equal_each_request_alone(gguf_server, name):
    import openai

    settings = SETTINGS[name]

    async def main():
        client = openai.AsyncOpenAI(base_url=gguf_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        alone = [await stream(client, p, settings) for p in PROMPTS]
        together = await asyncio.gather(*[stream(client, p, settings) for p in PROMPTS])
        await client.close()
        return alone, together

    alone, together = asyncio.run(main())
    for (a, _), (b, _), p in zip(alone, together, PROMPTS):
        assert a and b == a, p
    # the two were in flight at the same time: each got chunks before the other's last one
    (_, ta), (_, tb) = together
    assert ta[0] < tb[-1] and tb[0] < ta[-1]
    assert gguf_server.metric("leaplm_backend_info", 'backend="llamacpp",exactness="identical"') == 1.0
    assert gguf_server.metric("leaplm_backend_choice_info", 'backend="llamacpp",reason="--backend llamacpp"') == 1.0
