"""A batch whose rows verify drafts of different lengths, on the C++ layer loop (ModelCapabilities.ragged_rows):
each row's real positions give the same logits, argmax and cache entries as the padded block, bit for bit, and
the padding is neither computed nor cached (its slots keep what they held; its logits are 0). Through the engine,
a batch of rows drafting different K decodes what each prompt decodes alone."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_writer import write_tiny_gguf  # noqa: E402

from leaplm.models import load_model  # noqa: E402


@pytest.fixture(scope="module", params=["Q4_K_M", "Q4_0"])
def model(request, tmp_path_factory):
    from leaplm.kernels.build import unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    path = write_tiny_gguf(tmp_path_factory.mktemp(f"rag_{request.param}"), request.param)[0]
    m = load_model(path, quantization="gguf").model
    assert m.capabilities.ragged_rows and m.fused_layers() is not None, "the C++ layer loop must run here"
    return m


PROMPTS = [[5, 9, 2, 7, 7, 1, 3], [11, 4], [8, 8, 6, 2, 9]]
BLOCK = torch.tensor([[3, 4, 5, 6, 7], [2, 9, 0, 0, 0], [1, 0, 0, 0, 0]])   # [3, 5]: 5, 2 and 1 real tokens
WIDTHS = [5, 2, 1]
MARK = 7.0


def _cache(m):
    """A 3-row cache holding each prompt (rows of different lengths), the block's slots after each marked."""
    c = m.new_cache(len(PROMPTS), 64)
    c.reserve(32)
    for b, p in enumerate(PROMPTS):
        m(torch.tensor([p]), c.row_view(b))
        c.lengths[b] = len(p)
        for i in range(len(c.k)):
            c.k[i][b, :, len(p):len(p) + 5] = MARK
            c.v[i][b, :, len(p):len(p) + 5] = MARK
    return c


def test_real_positions_equal_the_padded_block_and_padding_is_not_computed(model):
    m = model
    padded, ragged = _cache(m), _cache(m)
    want = m(BLOCK, padded)                                                     # [3, 5, V]
    got = m(BLOCK, ragged, row_tokens=WIDTHS)
    for b, n in enumerate(WIDTHS):
        assert torch.equal(got[b, :n], want[b, :n]), b
        assert (got[b, n:] == 0).all()
        L = len(PROMPTS[b])
        for i in range(len(ragged.k)):
            for c_rag, c_pad in ((ragged.k[i], padded.k[i]), (ragged.v[i], padded.v[i])):
                assert torch.equal(c_rag[b, :, :L + n], c_pad[b, :, :L + n]), (b, i)
                assert (c_rag[b, :, L + n:L + 5] == MARK).all(), (b, i)          # padding slots untouched
    ids = m.forward_argmax(BLOCK, _cache(m), row_tokens=WIDTHS)
    for b, n in enumerate(WIDTHS):
        assert torch.equal(ids[b, :n], want[b, :n].argmax(-1)), b
    # control: without row_tokens the padding is computed and cached
    assert not (padded.k[0][2, :, len(PROMPTS[2]) + 1:len(PROMPTS[2]) + 5] == MARK).all()


def test_row_tokens_out_of_range_or_with_last_only_are_refused(model):
    c = _cache(model)
    with pytest.raises(ValueError, match="row_tokens must be 3 counts in"):
        model(BLOCK, c, row_tokens=[5, 6, 1])
    with pytest.raises(ValueError, match="last_only"):
        model(BLOCK, c, row_tokens=WIDTHS, last_only=True)


def test_a_batch_of_rows_drafting_different_lengths_decodes_each_prompt_as_alone(tmp_path, monkeypatch):
    """Rows with a prediction the output follows (long drafts), one it does not (short) and none (no draft): the
    steps' forwards are ragged, and every row's greedy text is plain decoding's."""
    from leaplm.config import SamplingParams
    from leaplm.engine.engine import Engine
    from leaplm.quant import fused

    file = write_tiny_gguf(tmp_path, "Q4_0")[0]
    # a fixed K: the predictions draft at every step whatever a tiny model's costs would advise
    eng = Engine(str(file), method="none", k=4, adaptive_k=False, backend="torch", quantization="gguf")
    prompt = "the quick brown fox"
    plain = eng.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    widths = []
    real = fused.FusedLayers.__call__

    def spy(self, x, cache, pos, mask, layers, kv_len, widths_=None, **kw):
        widths.append(widths_)
        return real(self, x, cache, pos, mask, layers, kv_len, widths_, **kw)

    monkeypatch.setattr(fused.FusedLayers, "__call__", spy)
    params = [SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, prediction=pred)
              for pred in (plain.text, "zz qq xx " * 6, None)]
    outs = eng.generate_batch(prompt, params)
    assert [o.text for o in outs] == [plain.text] * 3
    assert any(w is not None and len(set(w)) > 1 for w in widths), widths     # ragged steps ran
