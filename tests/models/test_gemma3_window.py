"""A sliding-window layer's cache holds its window: a ring of window + RING_BLOCK slots whatever the context
(cache/kv_cache.py), on the PyTorch layer loop and on the C++ layer loop (quant/fused.py). A tiny random Gemma 3 with
an 8-token window and a 1024-position context is checked against transformers far past the ring: prefills longer
than a ring (run in chunks), verification blocks whose tails are rejected, single steps, batches of rows of
different lengths, greedy decoding with n-gram speculation. Controls: a ring one block too short changes the
logits; a rollback deeper than the ring allows is refused."""
from __future__ import annotations

import pytest
import torch
import transformers

from leaplm.cache.kv_cache import RING_BLOCK
from leaplm.config import SamplingParams
from leaplm.engine.engine import Engine
from leaplm.models import load_model
from leaplm.models.gguf_export import export_gguf

from test_gemma3 import BASE, tolerance, write_gemma3
from test_gemma3_gguf import LLAMA_CPP_SHAPE

WINDOW = BASE["sliding_window"]
RING = WINDOW + RING_BLOCK
CTX = 1024
N = RING + 200                                        # a sequence well past the ring


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory, byte_tokenizer) -> str:
    return write_gemma3(tmp_path_factory.mktemp("gemma3_long"), byte_tokenizer, max_position_embeddings=CTX)


@pytest.fixture(scope="module")
def lm(long_dir):
    return load_model(long_dir)


@pytest.fixture(scope="module")
def kernel_lm(tmp_path_factory, byte_tokenizer):
    d = tmp_path_factory.mktemp("gemma3_q8")
    hf_dir = write_gemma3(d / "hf", byte_tokenizer, max_position_embeddings=CTX, **LLAMA_CPP_SHAPE)
    return load_model(str(export_gguf(hf_dir, str(d / "g.gguf"), "q8_0").path), quantization="gguf")


def sequence(lm, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [lm.bos_id] + torch.randint(3, lm.model.vocab_size, (n - 1,), generator=g).tolist()


def reference(model_dir: str, ids: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]                                  # [T, V]


def run_with_rollbacks(m, cache, ids: list[int], prefill: int, row: int = 0) -> dict[int, torch.Tensor]:
    """Logits per position: a prefill, then 6-token blocks of which 3 are kept (the rest rolled back), then steps."""
    view = cache.row_view(row) if cache.batch_size > 1 else cache
    got = {}
    with torch.inference_mode():
        out = m(torch.tensor([ids[:prefill]]), view)[0]
        got.update(enumerate(out))
        cache.advance(prefill, row)
        p = prefill
        while p + 6 <= len(ids) - 8:
            v = cache.row_view(row) if cache.batch_size > 1 else cache
            out = m(torch.tensor([ids[p:p + 6]]), v)[0]
            got.update({p + i: out[i] for i in range(3)})
            cache.advance(3, row)
            p += 3
        for t in range(p, len(ids)):
            v = cache.row_view(row) if cache.batch_size > 1 else cache
            got[t] = m(torch.tensor([ids[t:t + 1]]), v)[0, 0]
            cache.advance(1, row)
    return got


def assert_close_all(got: dict[int, torch.Tensor], ref: torch.Tensor, tol: float) -> None:
    idx = sorted(got)
    assert idx == list(range(ref.shape[0]))
    torch.testing.assert_close(torch.stack([got[i] for i in idx]), ref, atol=tol, rtol=0)


def test_a_sliding_layers_cache_is_constant_in_context_length(lm):
    m = lm.model
    cache = m.new_cache(1, CTX)
    assert cache.rings == [RING, 0, RING, 0]
    ids = sequence(lm, 900, 0)
    sizes = {}
    with torch.inference_mode():
        for end in (RING, 600, 900):
            m(torch.tensor([ids[cache.lengths[0]:end]]), cache)
            cache.advance(end - cache.lengths[0])
            sizes[end] = [cache.layer_slots(i) for i in range(4)], cache.nbytes
    for end, (slots, _) in sizes.items():
        assert slots[0] == slots[2] == RING                     # the window's ring, whatever the context
        assert slots[1] >= end and slots[3] >= end              # global layers hold every position
    per_slot = 2 * m.args.num_key_value_heads * m.args.head_dim * 4
    assert sizes[900][1] - sizes[RING][1] == 2 * (sizes[900][0][1] - sizes[RING][0][1]) * per_slot


def test_logits_match_transformers_past_the_ring_with_rollbacks(lm):
    ids = sequence(lm, N, 1)
    ref = reference(lm.path, ids)
    tol = tolerance(ref, max(BASE["intermediate_size"], N))
    cache = lm.model.new_cache(1, CTX)
    assert_close_all(run_with_rollbacks(lm.model, cache, ids, prefill=RING + 20), ref, tol)   # a chunked prefill


def test_rows_of_different_lengths_read_their_own_rings(lm):
    m = lm.model
    seqs = [sequence(lm, N, 2), sequence(lm, N - 37, 3)]
    refs = [reference(lm.path, s) for s in seqs]
    cache = m.new_cache(2, CTX)
    starts = [RING - 30, RING + 40]
    with torch.inference_mode():
        for b, s in enumerate(seqs):
            m(torch.tensor([s[:starts[b]]]), cache.row_view(b))
            cache.advance(starts[b], b)
        got = [[], []]
        for step in range(N - 37 - max(starts)):          # batched steps, the rows at different lengths
            ids = torch.tensor([[s[cache.lengths[b]]] for b, s in enumerate(seqs)])   # [2, 1]
            out = m(ids, cache)                                                         # [2, 1, V]
            for b in range(2):
                got[b].append(out[b, 0])
                cache.advance(1, b)
    for b in range(2):
        want = refs[b][starts[b]: starts[b] + len(got[b])]
        torch.testing.assert_close(torch.stack(got[b]), want, atol=tolerance(want, N), rtol=0)


def test_greedy_speculation_across_the_ring_matches_generate(lm):
    ids = sequence(lm, 40, 4) * 8                           # repetitive: n-gram drafts, some rejected
    hf = transformers.AutoModelForCausalLM.from_pretrained(lm.path).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64, min_new_tokens=0, pad_token_id=0,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    want = out[0, len(ids):].tolist()
    params = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
    plain = Engine(lm, method="none").generate(ids, params)
    spec = Engine(lm, method="ngram", k=6, adaptive_k=False).generate(ids, params)
    assert len(ids) + 64 > RING
    assert plain.token_ids == want and spec.token_ids == want
    assert spec.stats.draft_tokens > spec.stats.accepted_tokens > 0          # blocks were rolled back


def share_within(a: torch.Tensor, b: torch.Tensor, tol: float) -> float:
    """The share of positions ([T, V] each) whose logits agree within tol."""
    return float(((a - b).abs().max(-1).values <= tol).float().mean())


def test_the_c_layer_loop_keeps_the_ring_bit_for_bit(kernel_lm):
    """The C++ loop computes a token alike in any block: over the ring with chunked prefill, rejected block tails
    and single steps, the bits of one forward over a cache that keeps every position."""
    from leaplm.cache.kv_cache import KVCache

    m = kernel_lm.model
    assert m.fused_layers() is not None                     # Gemma's mixed windows run in the C++ loop
    a = m.args
    ids = sequence(kernel_lm, N, 5)
    ring = run_with_rollbacks(m, m.new_cache(1, CTX), ids, prefill=RING + 20)
    linear = KVCache(a.num_hidden_layers, 1, a.num_key_value_heads, a.head_dim, CTX)   # no ring
    with torch.inference_mode():
        whole = m(torch.tensor([ids]), linear)[0]
    assert torch.equal(torch.stack([ring[i] for i in range(N)]), whole)


def test_the_c_layer_loop_applies_the_windows_of_the_pytorch_loop(kernel_lm, monkeypatch):
    """Against the PyTorch loop over the same quantized linears: fp32 rounding apart, except where an activation's
    int8 rounding tips (one step is 1/127 of a block's largest value), which moves a few positions further. A loop
    that ignored the windows (the control) differs at nearly every position past the window."""
    from leaplm.quant import fused

    m = kernel_lm.model
    ids = torch.tensor([sequence(kernel_lm, 200, 8)])
    with torch.inference_mode():
        got = m(ids, m.new_cache(1, CTX))[0]
        saved = m._fused
        try:
            m._fused = None
            ref = m(ids, m.new_cache(1, CTX))[0]
            plain = fused.decoder_options

            def no_windows(model):
                opts = plain(model)
                for o in opts.layers:
                    o.window = 0
                return opts

            monkeypatch.setattr(fused, "decoder_options", no_windows)
            m._fused = fused.build_fused(m)
            wrong = m(ids, m.new_cache(1, CTX))[0]
        finally:
            m._fused = saved
    tol = tolerance(ref, max(BASE["intermediate_size"], ids.shape[1]))
    assert share_within(got, ref, tol) >= 0.8
    assert share_within(wrong[WINDOW + 1:], ref[WINDOW + 1:], tol) < 0.2


def test_greedy_speculation_on_the_c_layer_loop_across_the_ring(kernel_lm):
    seq = sequence(kernel_lm, 40, 6) * 8
    params = SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)
    plain = Engine(kernel_lm, method="none").generate(seq, params)
    spec = Engine(kernel_lm, method="ngram", k=6, adaptive_k=False).generate(seq, params)
    assert len(seq) + 48 > RING
    assert plain.token_ids == spec.token_ids and spec.stats.draft_tokens > spec.stats.accepted_tokens


def test_control_a_ring_one_block_short_changes_the_logits(lm):
    m = lm.model
    ids = sequence(lm, N, 1)
    ref = reference(lm.path, ids)
    cache = m.new_cache(1, CTX)
    short = WINDOW + 2                                     # less than window + a 6-token block
    for i, r in enumerate(cache.rings):
        if r:
            cache.rings[i] = short
            cache.k[i] = torch.zeros_like(cache.k[i][:, :, :short])
            cache.v[i] = torch.zeros_like(cache.v[i][:, :, :short])
    got = run_with_rollbacks(m, cache, ids, prefill=short)
    stacked = torch.stack([got[i] for i in range(N)])
    assert (stacked - ref).abs().max() > 100 * tolerance(ref, N)


def test_a_rollback_deeper_than_the_ring_allows_is_refused(lm):
    m = lm.model
    cache = m.new_cache(1, CTX)
    ids = sequence(lm, RING + 100, 7)
    with torch.inference_mode():
        m(torch.tensor([ids]), cache)                       # a chunked prefill of RING + 100 tokens
    with pytest.raises(ValueError, match="sliding-window cache"):
        cache.advance(10)                                  # keeping 10 of them would read overwritten slots
    cache.advance(len(ids))
    with pytest.raises(ValueError, match="sliding-window cache"):
        cache.truncate(len(ids) - RING_BLOCK - 2)
    cache.truncate(len(ids) - RING_BLOCK - 1)               # within the bound
    cache.truncate(0)                                       # a reset is always possible
