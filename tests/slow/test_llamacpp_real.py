"""The llamacpp baseline against the real llama.cpp binaries: the embedded target written as f32 GGUF, one code
prompt, greedy. llama.cpp must tokenize the prompt as leaplm does and, on the same f32 weights, reproduce leaplm's
greedy tokens; its lookup and speculative binaries (the embedded draft as q8_0 GGUF) must reproduce its own plain
decoding (greedy verification is lossless in llama.cpp too).

Slow: needs llama.cpp's llama-completion, llama-lookup, llama-speculative-simple and llama-bench, found via
$LEAPLM_LLAMACPP_DIR, PATH, or the build directory the project's machines keep; skipped with the reason otherwise."""
from __future__ import annotations

from pathlib import Path

import pytest

from leaplm.bench import llamacpp as lc
from leaplm.config import ConfigError, SamplingParams
from leaplm.engine.engine import Engine
from leaplm.models import embedded, load_model
from leaplm.models.gguf_export import export_gguf
from leaplm.models.tokens import encode_prompt

pytestmark = pytest.mark.slow
PROMPT = "import os\n\n\ndef list_python_files(root):\n"
N = 16


@pytest.fixture(scope="module")
def binaries() -> lc.LlamaCppBinaries:
    try:
        return lc.find_binaries(None)
    except ConfigError as first:
        build = Path("/work/cache/llamacpp-src/build/bin")
        if build.is_dir():
            try:
                return lc.find_binaries(str(build))
            except ConfigError:
                pass
        pytest.skip(f"llama.cpp binaries unavailable: {first.message}")


def test_real_binaries_match_leaplm_on_f32_weights(binaries, tmp_path):
    target = load_model(embedded.default_target())
    model = export_gguf(target.path, str(tmp_path / "target-f32.gguf"), "f32").path
    draft = export_gguf(embedded.default_draft(), str(tmp_path / "draft-q8_0.gguf"), "q8_0",
                        tokenizer_from=str(model)).path
    setup = lc.LlamaCppSetup(binaries, str(model), threads=1, context=512, draft=str(draft))
    (tmp_path / "p.txt").write_bytes(PROMPT.encode())
    lc.probe_repack(setup, str(tmp_path / "p.txt"))
    plain, lookup, spec = lc.llamacpp_contenders(setup, k=4, workdir=str(tmp_path))
    runs = {c.name: c.run(PROMPT, N)[1] for c in (plain, lookup, spec)}
    ours = Engine(target, method="none").generate(PROMPT, SamplingParams(max_new_tokens=N, temperature=0.0,
                                                                         ignore_eos=True)).token_ids
    p = runs["llama.cpp"]
    assert p.new_tokens == N and p.seconds > 0 and p.decode_tokens_per_s > 0 and p.wall_seconds > p.seconds
    assert p.prompt_tokens == len(encode_prompt(target.tokenizer, PROMPT, target.bos_id))
    # the same f32 weights: the engines differ only in rounding (~1e-6 relative), far below this model's margins
    assert lc.common_prefix_tokens(target.tokenizer, ours, p.text) == N, (p.text, target.tokenizer.decode(ours))
    for name in ("llama.cpp lookup k=4", "llama.cpp draft k=4"):
        r = runs[name]
        assert r.new_tokens >= N and r.prompt_tokens == p.prompt_tokens
        assert r.text.startswith(p.text), (name, r.text, p.text)
    assert runs["llama.cpp draft k=4"].draft_tokens > 0       # a draft model proposes at every step
    fig = lc.run_llama_bench(setup, n_gen=16, repetitions=1)
    assert fig.n_gen == 16 and fig.tokens_per_s > 0
