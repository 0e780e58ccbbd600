"""Lossless sampling on Gemma 3: the Monte Carlo test of tests/engine/test_lossless_sampling.py (its statistic,
its bound: TV of the joint of generated positions 2 and 3 over 1500 seeds against the exact distribution
enumerated through transformers, exceeded by a correct engine with probability below 1e-6) on a tiny random
Gemma 3 of 8 tokens with sliding and global layers, drafted by a noisy copy of itself; and its negative control,
a verifier that keeps every token of an unrelated draft, which must exceed the bound."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_lossless_sampling import (N, PROCESSED, always_accept, exact_positions_2_3,  # noqa: E402
                                    sample_positions_2_3, tv_and_bound)

from leaplm.config import SamplingParams  # noqa: E402
from leaplm.engine.engine import Engine  # noqa: E402

# the prompt of the shared test is [1, 2, 3]: token 1 is BOS here, so the family's BOS rule adds nothing
BOS = 1


def write_gemma_v8(path, seed: int) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=2, sliding_window_pattern=2,
        layer_types=["sliding_attention", "full_attention"], rope_theta=1e6, rope_local_base_freq=1e4,
        query_pre_attn_scalar=8, initializer_range=0.05, bos_token_id=BOS, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(str(path))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(8)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def gemma_v8(tmp_path_factory):
    """{"target", "near" (the target plus noise: agrees often), "far" (an unrelated random Gemma 3)}."""
    from perturb import write_noisy_copy
    from leaplm.models import load_model

    target = write_gemma_v8(tmp_path_factory.mktemp("gemma_v8"), seed=0)
    near = write_noisy_copy(target, tmp_path_factory.mktemp("gemma_v8_near"), noise=0.03, seed=5)
    far = write_gemma_v8(tmp_path_factory.mktemp("gemma_v8_far"), seed=2)
    return {"target": load_model(target), "near": load_model(near), "far": load_model(far)}


def draft_engine(models, draft: str = "near") -> Engine:
    return Engine(models["target"], draft=models[draft], method="draft", k=3, adaptive_k=False)


@pytest.mark.parametrize("verifier", ["race", "rejection"])
def test_gemma3_speculative_samples_follow_the_target(gemma_v8, ref_probs, verifier):
    exact = exact_positions_2_3(gemma_v8["target"].path, SamplingParams(**PROCESSED), ref_probs)
    got, acceptance = sample_positions_2_3(draft_engine(gemma_v8), dict(PROCESSED, verifier=verifier))
    tv, bound = tv_and_bound(got, exact, N)
    assert float(exact.max()) < 0.5 and int((exact >= 0.01).sum()) >= 4   # a distribution a wrong verifier would move
    assert acceptance > 0.3                                        # the draft really drafted and was kept
    assert tv < bound, f"TV {tv:.4f} >= bound {bound:.4f} ({verifier})"


def test_gemma3_negative_control_always_accept_fails_the_bound(gemma_v8, ref_probs, monkeypatch):
    patched = [m for name, m in list(sys.modules.items())
               if name.startswith("leaplm.engine") and hasattr(m, "verify_coupled")]
    assert patched
    for m in patched:
        monkeypatch.setattr(m, "verify_coupled", always_accept)
    always_accept.calls = 0
    exact = exact_positions_2_3(gemma_v8["target"].path, SamplingParams(**PROCESSED), ref_probs)
    got, _ = sample_positions_2_3(draft_engine(gemma_v8, "far"), PROCESSED)
    tv, bound = tv_and_bound(got, exact, N)
    assert always_accept.calls >= N
    assert tv > bound, f"the wrong verifier passed: TV {tv:.4f} < bound {bound:.4f}"
