"""Write a tiny random Llama as a GGUF file with the `gguf` package's writer, as llama.cpp's converter would:
llama.cpp tensor names, q/k rows permuted into llama.cpp's rope layout, 1-D tensors in F32, the byte-level BPE
tokenizer of tests/conftest.py as tokenizer.ggml.* metadata, and a chat template.

The `gguf` package quantizes to Q8_0, Q4_x and Q5_x but not to the K-quants, so Q4_K and Q6_K blocks are written
here by plain round-to-nearest encoders in llama.cpp's block layout (block_q4_K, block_q6_K); the tests check them
with the `gguf` package's dequantizer. qtype "Q4_K_M" mixes the types as llama.cpp's Q4_K_M does on a small model:
K-quants where a row is a multiple of 256, Q5_0 / Q8_0 elsewhere, Q6_K for the embedding and output."""
from __future__ import annotations

import json

import numpy as np
import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's rotate-half rows -> llama.cpp's interleaved pairs, per head (what convert_hf_to_gguf does)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _root_conftest():
    """tests/conftest.py as a module: `import conftest` finds whichever conftest pytest loaded first (several
    test folders have one), so load the root one by path."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "leaplm_tests_root_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "conftest.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _f16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the fp16 bytes [..., 2], their value in fp32)."""
    h = np.asarray(v, dtype=np.float32).astype(np.float16)
    return h[..., None].view(np.uint8), h.astype(np.float32)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b > 0, a / np.where(b > 0, b, 1), 0)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """x [N, K] fp32 (K a multiple of 256) -> block_q4_K bytes [N, K / 256 * 144]: per block of 32 a 6-bit scale
    and min under the super-block's fp16 d and dmin; w = d * sc * q - dmin * m, q in 0..15."""
    N, K = x.shape
    S = K // 256
    b = x.reshape(N, S, 8, 32)
    lo, hi = np.minimum(b.min(-1), 0), b.max(-1)                      # [N, S, 8]
    sub_scale, sub_min = (hi - lo) / 15, -lo
    d, dv = _f16(sub_scale.max(-1) / 63)
    dmin, dminv = _f16(sub_min.max(-1) / 63)
    sc = np.clip(np.rint(_div(sub_scale, dv[..., None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_div(sub_min, dminv[..., None])), 0, 63).astype(np.uint8)
    s, m = dv[..., None] * sc, dminv[..., None] * mn
    q = np.clip(np.rint(_div(b + m[..., None], s[..., None])), 0, 15).astype(np.uint8)   # [N, S, 8, 32]
    scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], -1)      # [N, S, 12]
    qs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(N, S, 128)   # chunk c: blocks 2c (low), 2c + 1 (high)
    return np.concatenate([d, dmin, scales, qs], -1).reshape(N, S * 144)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """x [N, K] fp32 (K a multiple of 256) -> block_q6_K bytes [N, K / 256 * 210]: per 16 weights an int8 scale
    under the super-block's fp16 d; w = d * sc * (q - 32), q in 0..63."""
    N, K = x.shape
    S = K // 256
    b = x.reshape(N, S, 16, 16)
    sub = np.abs(b).max(-1) / 31                                        # [N, S, 16]
    d, dv = _f16(sub.max(-1) / 127)
    sc = np.clip(np.rint(_div(sub, dv[..., None])), -128, 127).astype(np.int8)
    s = dv[..., None] * sc
    q = (np.clip(np.rint(_div(b, s[..., None])), -32, 31) + 32).astype(np.uint8).reshape(N, S, 2, 4, 32)
    ql = np.concatenate([q[:, :, :, 0] & 15 | ((q[:, :, :, 2] & 15) << 4),
                         q[:, :, :, 1] & 15 | ((q[:, :, :, 3] & 15) << 4)], -1).reshape(N, S, 128)
    qh = (q[:, :, :, 0] >> 4 | (q[:, :, :, 1] >> 4) << 2 | (q[:, :, :, 2] >> 4) << 4 |
          (q[:, :, :, 3] >> 4) << 6).reshape(N, S, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d], -1).reshape(N, S * 210)


K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


def q4_k_m_type(name: str) -> str:
    """The type of tensor `name` in the tiny Q4_K_M file: layer 0 in K-quants (a Q6_K attn_v beside Q4_K q and k,
    as llama.cpp writes half of a large model's layers), layer 1 as on a model whose rows are not multiples of 256
    (Q5_0, a Q8_0 attn_v), ffn_down Q6_K then Q4_K, the embedding and output Q6_K."""
    if name in ("token_embd.weight", "output.weight"):
        return "Q6_K"
    layer, kind = int(name.split(".")[1]), name.split(".")[2]
    if kind == "ffn_down":
        return "Q6_K" if layer == 0 else "Q4_K"
    if layer == 0:
        return "Q6_K" if kind == "attn_v" else "Q4_K"
    return "Q8_0" if kind == "attn_v" else "Q5_0"


def write_tiny_gguf(dir_path, qtype: str = "F32", seed: int = 0, tied: bool = False, add_bos: bool | None = False,
                    arch: str = "llama", name: str = "tiny random llama", layout: str = "llama",
                    floats: dict[str, float] | None = None, layers: int = 2) -> tuple[str, str]:
    """(gguf file path, Hugging Face directory of the same random model). Dimensions are multiples of 32 so every
    block quantization applies to every matrix (qtype "Q4_K_M": of 256, for the K-quants). layout "phi3" writes
    the same weights as llama.cpp's phi3 architecture stores them (q/k/v fused in rotate-half order, gate and up
    fused). floats: extra float metadata, "{arch}" in a key standing for the architecture. layers: decoder layers."""
    import gguf
    from gguf.quants import quantize
    from transformers import LlamaConfig, LlamaForCausalLM

    write_byte_tokenizer = _root_conftest().write_byte_tokenizer

    hf_dir = dir_path / "hf"
    tok = write_byte_tokenizer(hf_dir)
    vocab = len(tok)
    torch.manual_seed(seed)
    wide = qtype == "Q4_K_M"
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256 if wide else 64, intermediate_size=512 if wide else 128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64 if wide else 16,
                      max_position_embeddings=256,
                      initializer_range=0.3, tie_word_embeddings=tied, rms_norm_eps=1e-5, rope_theta=10000.0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():                  # norms away from 1 so a misplaced norm shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(hf_dir))
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads

    path = str(dir_path / f"tiny-{qtype}.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(vocab)
    # tokenizer: the byte-level BPE's vocabulary and merges, as llama.cpp stores a gpt2-type tokenizer
    tj = json.loads(tok.backend_tokenizer.to_str())
    id2tok = {i: t for t, i in tok.get_vocab().items()}
    tokens = [id2tok[i] for i in range(vocab)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t == "<eos>" else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    eos = tok.convert_tokens_to_ids("<eos>")
    w.add_eos_token_id(eos)
    w.add_bos_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (floats or {}).items():
        w.add_float32(key.format(arch=arch), value)

    def put(name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 1 or qtype == "F32":
            w.add_tensor(name, arr)
        elif qtype == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            tname = q4_k_m_type(name) if qtype == "Q4_K_M" else qtype
            t = gguf.GGMLQuantizationType[tname]
            raw = K_QUANTIZERS[tname](arr) if tname in K_QUANTIZERS else quantize(arr, t)
            w.add_tensor(name, raw, raw_dtype=t)

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if not tied:
        put("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers if layout == "phi3" else 0):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(f"blk.{i}.attn_qkv.weight", np.concatenate([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.ffn_up.weight", np.concatenate([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    for i in range(cfg.num_hidden_layers if layout == "llama" else 0):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(f"blk.{i}.attn_q.weight", llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], H))
        put(f"blk.{i}.attn_k.weight", llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], Hkv))
        put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, str(hf_dir)
