"""No silently wrong output: every config field that changes the maths is implemented natively (greedy equal to
transformers, biases randomized so that dropping one shows), or the model runs through the transformers fallback
(greedy equal too), or it is refused with an error naming the field."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from leaplm.config import ConfigError, SamplingParams
from leaplm.engine.engine import Engine
from leaplm.models import load_model

PROMPT = "the quick brown fox jumps over the lazy dog; un café crème 🙂 speculative decoding drafts tokens"

NATIVE = ["llama_biases", "llama_gelu", "llama_yarn", "llama_dynamic", "qwen2_swa", "qwen3_bias"]
FALLBACK = ["llama_longrope"]
# the field turned off in transformers: the logits must move (so matching with it on means it is implemented)
FIELD_OFF = {
    "llama_biases": dict(attention_bias=False, mlp_bias=False),
    "llama_gelu": dict(hidden_act="silu"),
    "llama_yarn": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen2_swa": dict(layer_types=["full_attention", "full_attention"]),
    "qwen3_bias": dict(attention_bias=False),
}
N = 24


def prompt_ids(tokenizer) -> list[int]:
    return tokenizer(PROMPT, add_special_tokens=False)["input_ids"] * 2


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None          # run the full n tokens, as ignore_eos does
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=0,
                         pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", NATIVE + FALLBACK)
def test_greedy_equals_transformers(name, checkpoint, loaded):
    lm = loaded(name)
    assert (type(lm.model).__name__ == "LlamaForCausalLM") == (name in NATIVE)
    ids = prompt_ids(lm.tokenizer)                                     # longer than the sliding window of 8
    ref = hf_greedy(AutoModelForCausalLM.from_pretrained(checkpoint(name)).eval(), ids, N)
    out = Engine(lm, method="none").generate(ids, SamplingParams(temperature=0, max_new_tokens=N, ignore_eos=True))
    assert out.token_ids == ref


@pytest.mark.parametrize("name", sorted(FIELD_OFF))
def test_the_field_matters(name, checkpoint, loaded):
    ids = torch.tensor([prompt_ids(loaded(name).tokenizer)])
    with torch.no_grad():
        on = AutoModelForCausalLM.from_pretrained(checkpoint(name)).eval()(ids).logits
        off = AutoModelForCausalLM.from_pretrained(checkpoint(name), **FIELD_OFF[name]).eval()(ids).logits
    assert (on - off).abs().max() > 1e-2


def test_qwen2_window_only_on_layers_past_max_window_layers(loaded):
    a = loaded("qwen2_swa").model.args
    assert [a.layer_window(i) for i in range(a.num_hidden_layers)] == [None, 8]


def test_fallback_is_logged_with_the_field(checkpoint, caplog):
    with caplog.at_level("WARNING", logger="leaplm.models.loading"):
        load_model(checkpoint("llama_longrope"))
    assert "rope_scaling: rope_type 'longrope'" in caplog.text and "transformers fallback" in caplog.text


def test_a_field_neither_can_run_is_refused_naming_it(checkpoint, tmp_path):
    d = tmp_path / "bad_act"
    shutil.copytree(checkpoint("llama_gelu"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_act"] = "no_such_activation"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        load_model(str(d))
    assert e.value.field == "model" and "hidden_act" in e.value.message and "no_such_activation" in e.value.message
