"""leaplm models export-gguf: leaplm loads what it wrote and decodes the same greedy tokens; a reduced-vocabulary
draft expands to the target's vocabulary with the same logits on its own tokens; what cannot be expressed is
refused by name."""
from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from leaplm.cli import app
from leaplm.config import ConfigError, SamplingParams
from leaplm.engine.engine import Engine
from leaplm.models import load_model
from leaplm.models.gguf_export import _expand_draft_vocab, export_gguf

PROMPT = "def add(a, b):\n    return"


def _greedy(model, n: int = 12) -> list[int]:
    return Engine(model, method="none").generate(PROMPT, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)).token_ids


@pytest.mark.parametrize("name", ["llama_tied", "llama_draft"])          # tied and untied LM heads
def test_f32_round_trip_same_greedy_tokens_and_logits(checkpoint, loaded, tmp_path, name):
    r = export_gguf(checkpoint(name), str(tmp_path / f"{name}.gguf"), "f32")
    back = load_model(str(r.path), backend="torch")    # the same code on both sides (libllama: test_llamacpp.py)
    src = loaded(name)
    assert back.tokenizer(PROMPT)["input_ids"] == src.tokenizer(PROMPT)["input_ids"]
    assert _greedy(back) == _greedy(src)
    ids = torch.tensor([src.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        a = src.model(ids, src.model.new_cache(1, 64))                   # [1, T, V]
        b = back.model(ids, back.model.new_cache(1, 64))
    # the same fp32 weights through the same code: the only change is q/k rows permuted and permuted back
    tol = torch.finfo(torch.float32).eps * src.config["hidden_size"] * a.abs().max()
    assert (a - b).abs().max() <= tol


def test_q8_0_export_writes_q8_0_matrices_and_loads(checkpoint, tmp_path):
    from gguf import GGUFReader

    r = export_gguf(checkpoint("llama_draft"), str(tmp_path / "d.gguf"), "q8_0")
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(r.path)).tensors}
    assert types["blk.0.ffn_up.weight"] == "Q8_0" and types["output_norm.weight"] == "F32"
    assert len(_greedy(load_model(str(r.path)), 4)) == 4


def test_tokenizer_from_copies_the_fields_and_checks_the_vocabulary(checkpoint, tmp_path):
    from gguf import GGUFReader

    t = export_gguf(checkpoint("llama_tied"), str(tmp_path / "t.gguf"), "f32")
    d = export_gguf(checkpoint("llama_draft"), str(tmp_path / "d.gguf"), "f32", tokenizer_from=str(t.path))
    ft, fd = GGUFReader(str(t.path)).fields, GGUFReader(str(d.path)).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id"):
        assert fd[key].contents() == ft[key].contents()
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "three.gguf"), "llama")       # another tokenizer: 3 tokens
    w.add_token_list(["a", "b", "c"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for bad, words in (("three.gguf", "3 tokens"), ("missing.gguf", "not a file")):
        with pytest.raises(ConfigError) as e:
            export_gguf(checkpoint("llama_draft"), str(tmp_path / "x.gguf"), "f32",
                        tokenizer_from=str(tmp_path / bad))
        assert e.value.field == "tokenizer_from" and words in e.value.message


def test_reduced_vocabulary_expands_with_the_mapped_logits():
    from leaplm.models.draft_vocab import t2d_table

    g = torch.Generator().manual_seed(0)
    N, d, V = 6, 8, 20
    embed, head = torch.randn(N, d, generator=g), torch.randn(N, d, generator=g)
    d2t = torch.tensor([-1, 3, 17, 0, 9, 5])                      # row 0: "any other token"
    full_embed, full_head = _expand_draft_vocab(embed, head, d2t, V)
    assert full_embed.shape == full_head.shape == (V, d)
    assert torch.equal(full_embed, embed[t2d_table(d2t, V)])     # inputs read as leaplm's mapping reads them
    h = torch.randn(4, d, generator=g)                             # [T, d] final hidden states
    small, full = h @ head.T, h @ full_head.T                      # [T, N], [T, V]
    assert torch.equal(full_head[d2t[1:]], head[1:])               # the draft's own tokens: its head rows,
    tol = torch.finfo(torch.float32).eps * d * small.abs().max()   # so its logits (matmul shapes differ)
    assert (full[:, d2t[1:]] - small[:, 1:]).abs().max() <= tol
    outside = torch.ones(V, dtype=torch.bool)
    outside[d2t[1:]] = False
    assert torch.equal(full[:, outside], torch.zeros(4, int(outside.sum())))   # elsewhere logit 0 (not -inf)


@pytest.mark.parametrize("name,word", [("llama_biases", "attention_bias"), ("llama3_rope", "rope_type"),
                                       ("qwen2_bias", "model_type")])
def test_refuses_what_llama_cpp_would_run_wrongly(checkpoint, tmp_path, name, word):
    with pytest.raises(ConfigError) as e:
        export_gguf(checkpoint(name), str(tmp_path / "x.gguf"))
    assert e.value.field == "source" and word in e.value.message


def test_cli_export_and_bad_input(checkpoint, tmp_path):
    out = tmp_path / "m.gguf"
    res = CliRunner().invoke(app, ["models", "export-gguf", checkpoint("llama_tied"), str(out), "--type", "f16"])
    assert res.exit_code == 0, res.output
    assert out.is_file() and "f16" in res.output
    res = CliRunner().invoke(app, ["models", "export-gguf", checkpoint("llama_tied"), str(out), "--type", "q4_k"])
    assert res.exit_code == 2 and "--type" in res.output
    res = CliRunner().invoke(app, ["models", "export-gguf", str(tmp_path / "nope"), str(out)])
    assert res.exit_code == 2 and "no config.json" in res.output
