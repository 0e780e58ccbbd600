"""Gemma 3 on the native decoder against transformers' Gemma3ForCausalLM (fp32, a tiny random checkpoint): sliding
layers interleaved with global ones at their own RoPE bases, q/k norms, post-norms, (1 + w) norms, GELU-tanh, the
sqrt(hidden) embedding scale, query_pre_attn_scalar, a tied head and BOS at the prompt's start."""
from __future__ import annotations

import pytest
import torch
import transformers

from leaplm.config import SamplingParams
from leaplm.engine.engine import Engine
from leaplm.models import load_model

from perturb import perturb_ as _perturb_

PROMPT = "the quick brown fox jumps over the lazy dog; un café crème 🙂 speculative decoding drafts tokens"
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=256, initializer_range=0.3, sliding_window=8, layer_types=LAYER_TYPES,
            rope_theta=1e6, rope_local_base_freq=1e4, query_pre_attn_scalar=16)


def write_gemma3(path, tokenizer, **over) -> str:
    eos = tokenizer.eos_token_id
    cfg = transformers.Gemma3TextConfig(vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=eos,
                                        pad_token_id=0, **{**BASE, **over})
    torch.manual_seed(3)
    model = transformers.Gemma3ForCausalLM(cfg)
    _perturb_(model, 3)              # norm weights 1 + noise: (1 + w) then differs from w by far more than noise
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, byte_tokenizer) -> str:
    return write_gemma3(tmp_path_factory.mktemp("gemma3"), byte_tokenizer)


@pytest.fixture(scope="module")
def gemma(gemma_dir):
    return load_model(gemma_dir)


def hf(path: str, **over):
    return transformers.AutoModelForCausalLM.from_pretrained(path, **over).eval()


def prompt_ids(lm, repeat: int = 2) -> list[int]:
    return [lm.bos_id] + lm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"] * repeat


def tolerance(ref: torch.Tensor, length: int) -> float:
    """fp32 rounding grows with the reduction length (hidden, intermediate, keys) and the logits' scale."""
    return 8 * torch.finfo(torch.float32).eps * length * float(ref.abs().max())


def test_loader_reads_the_description(gemma):
    m = gemma.model
    a = m.args
    assert type(m).__name__ == "LlamaForCausalLM"
    assert a.window_layers == [True, False, True, False] and a.sliding_window == 8
    assert a.layer_rope_theta == [1e4, 1e6, 1e4, 1e6]
    assert a.post_norms and a.qk_norm and a.hidden_act == "gelu_pytorch_tanh"
    assert a.attn_scale == 16 ** -0.5 and a.embed_scale == 32 ** 0.5
    assert m.lm_head.weight.data_ptr() == m.embed_tokens.weight.data_ptr()
    # (1 + w) added once: the native norm weight is the checkpoint's plus one
    ref = hf(gemma.path).model.layers[0]
    torch.testing.assert_close(m.layers[0].self_attn.post_norm.weight, ref.post_attention_layernorm.weight + 1)
    torch.testing.assert_close(m.layers[0].post_attention_layernorm.weight, ref.pre_feedforward_layernorm.weight + 1)
    assert gemma.bos_id == gemma.config["bos_token_id"] is not None      # BOS required, though the tokenizer adds none


def test_logits_match_transformers_over_prefill_blocks_and_decoding(gemma):
    m = gemma.model
    ids = torch.tensor([prompt_ids(gemma)])                                   # [1, T], T > the window
    T = ids.shape[1]
    with torch.no_grad():
        ref = hf(gemma.path)(ids).logits[0]                                   # [T, V]
    tol = tolerance(ref, max(BASE["intermediate_size"], T))
    torch.testing.assert_close(m(ids, m.new_cache(1, 256))[0], ref, atol=tol, rtol=0)
    cache = m.new_cache(1, 256)
    split = T - 12
    parts = [m(ids[:, :split], cache)[0]]
    cache.advance(split)
    parts.append(m(ids[:, split:split + 6], cache)[0])                       # a verification block
    cache.advance(6)
    for t in range(split + 6, T):                                            # single decoding steps
        parts.append(m(ids[:, t:t + 1], cache)[0])
        cache.advance(1)
    torch.testing.assert_close(torch.cat(parts), ref, atol=tol, rtol=0)


def _local_base(c):
    c.rope_parameters["sliding_attention"]["rope_theta"] = 1e6


def _scalar(c):
    c.query_pre_attn_scalar = 8


def _window(c):
    c.sliding_window = 256


@pytest.mark.parametrize("change", [_local_base, _scalar, _window])
def test_each_feature_changes_the_logits(gemma, change):
    """Control: with the feature changed, transformers' logits move by far more than the parity tolerance."""
    ids = torch.tensor([prompt_ids(gemma)])
    cfg = transformers.AutoConfig.from_pretrained(gemma.path)
    change(cfg)
    with torch.no_grad():
        on = hf(gemma.path)(ids).logits
        off = hf(gemma.path, config=cfg)(ids).logits
    assert (on - off).abs().max() > 100 * tolerance(on, ids.shape[1])


def test_greedy_matches_generate_and_ngram_speculation(gemma):
    ids = prompt_ids(gemma, repeat=1)
    model = hf(gemma.path)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=48, min_new_tokens=0,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    ref = out[0, len(ids):].tolist()
    params = SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)
    plain = Engine(gemma, method="none").generate(ids, params)
    spec = Engine(gemma, method="ngram", k=4, adaptive_k=False).generate(ids, params)
    assert plain.token_ids == ref
    assert spec.token_ids == ref
    assert spec.stats.draft_tokens > 0


def test_text_prompts_start_with_bos(gemma):
    """The byte tokenizer adds no BOS of its own; the family's description makes the engine prepend it once."""
    bos = gemma.config["bos_token_id"]
    assert gemma.tokenizer("def f(")["input_ids"][:1] != [bos]
    out = Engine(gemma, method="none").generate("def f(", SamplingParams(temperature=0, max_new_tokens=1))
    assert out.prompt_ids[0] == bos and out.prompt_ids[1] != bos


def test_logit_softcapping_runs_through_the_fallback(tmp_path, byte_tokenizer, caplog):
    """A field the native model does not implement is named, and transformers' own code runs the model."""
    src = write_gemma3(tmp_path / "soft", byte_tokenizer, final_logit_softcapping=30.0)
    with caplog.at_level("WARNING"):
        lm = load_model(src)
    assert type(lm.model).__name__ == "HFCausalLM"
    assert "final_logit_softcapping" in caplog.text
