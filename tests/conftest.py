"""Shared fixtures: tiny random checkpoints built with transformers and saved to temporary directories with a
tokenizer, loading through leaplm's own loader in well under a second. No network.

  tiny_llama_factory / tiny_llama   word-level Llamas (t0..tN)
  checkpoint / loaded / bert_dir    every native family and the gpt2 fallback over a byte-level BPE
  tiny_vocab                        an 8-token target and two drafts, for Monte Carlo tests
  ref_probs                         transformers' own logits processors, the reference for leaplm's
"""
from __future__ import annotations

import os

import pytest
import torch
from perturb import perturb_ as _perturb_
from perturb import write_noisy_copy

torch.set_num_threads(1)  # the machine is shared with a long training job
os.environ.setdefault("HF_HUB_OFFLINE", "1")   # tests never touch the network (a hub id fails fast)
os.environ.setdefault("LEAPLM_NO_STARTUP_CACHE", "1")   # each test measures; tests of the cache turn it on


def write_tiny_llama(path, vocab: int = 16, layers: int = 4, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
                     max_len: int = 256, seed: int = 0, init_range: float = 0.5) -> str:
    """Save a random Llama of `vocab` tokens named t0..t{vocab-1} (space-separated words) to `path`.

    init_range well above the usual 0.02 makes p peaked enough that a wrong verifier shows in a few thousand
    samples, and makes greedy output fall into repetitions that draft-free proposers can exploit."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_len,
                      initializer_range=init_range, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(path))
    return str(path)


_built: dict[tuple, object] = {}


@pytest.fixture(scope="session")
def tiny_llama_factory(tmp_path_factory):
    """make(**write_tiny_llama options) -> LoadedModel, built once per option set per session."""
    from leaplm.models import load_model

    def make(**kw):
        key = tuple(sorted(kw.items()))
        if key not in _built:
            d = tmp_path_factory.mktemp("tiny_llama")
            _built[key] = load_model(write_tiny_llama(d, **kw))
        return _built[key]

    return make


@pytest.fixture(scope="session")
def long_context_llama(tmp_path_factory) -> str:
    """A tiny Llama (2 layers, 2 kv heads x 8) whose config allows 131072 positions, like Llama-3.2-1B's."""
    return write_tiny_llama(tmp_path_factory.mktemp("long_ctx"), vocab=32, layers=2, max_len=131072)


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_factory):
    """Vocabulary 16, 4 layers: small enough to enumerate distributions, big enough to have layers to skip."""
    return tiny_llama_factory()


# --- native-family and fallback checkpoints over a byte-level BPE tokenizer ------------------------------------
# Used by tests/models, tests/cache and tests/engine. Each checkpoint is a real Hugging Face directory
# (config.json + safetensors + tokenizer files) written by transformers, so leaplm loads it exactly as it
# would load a downloaded model. Sizes are tiny: a forward costs well under a millisecond.

BPE_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target verifies them",
    "un café crème, s'il vous plaît; naïve façade — déjà vu",
    "größer über Straße, 東京 と 大阪, 🙂 🚀 emoji",
    "def add(a, b):\n    return a + b\n",
] * 4

_FAMILY_BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, initializer_range=0.3)

# name -> (transformers config class name, overrides). Every native family with GQA (4 heads, 2 kv heads),
# tied and untied embeddings, both rope scalings, a sliding window shorter than the generated sequences.
FAMILIES = {
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama3_rope": ("LlamaConfig", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama_linear": ("LlamaConfig", dict(tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral_sw": ("MistralConfig", dict(sliding_window=8)),
    "qwen2_bias": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3_qknorm": ("Qwen3Config", dict(attention_bias=False)),
    # every other field that changes the maths (tests/models/test_config_fields.py): native or the fallback
    "llama_biases": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    "llama_gelu": ("LlamaConfig", dict(hidden_act="gelu_pytorch_tanh")),
    "llama_yarn": ("LlamaConfig", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64})),
    "llama_dynamic": ("LlamaConfig", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "llama_longrope": ("LlamaConfig", dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                         "long_factor": [2.0, 3.0, 4.0, 6.0],
                                                         "original_max_position_embeddings": 64})),
    "qwen2_swa": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3_bias": ("Qwen3Config", dict(attention_bias=True)),
    # drafts sharing the tokenizer: a different random llama that rarely agrees with any target
    "llama_draft": ("LlamaConfig", dict(num_hidden_layers=1, seed=7)),
    "llama_draft_short": ("LlamaConfig", dict(num_hidden_layers=1, seed=7, max_position_embeddings=48)),
}


def write_byte_tokenizer(path):
    """A byte-level BPE (256 bytes + merges learnt from BPE_CORPUS + "<eos>"): multi-byte characters such as
    "é" or "🙂" may span several tokens, which the streaming tests need."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(BPE_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(str(path))
    return fast


def write_family_checkpoint(path, name: str, tokenizer) -> str:
    import transformers

    cls_name, over = FAMILIES[name]
    over = dict(over)
    seed = over.pop("seed", sum(map(ord, name)))
    kw = {**_FAMILY_BASE, **over}
    eos = tokenizer.eos_token_id
    cfg = getattr(transformers, cls_name)(vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=eos,
                                          pad_token_id=None, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    _perturb_(model, seed)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def write_gpt2_checkpoint(path, tokenizer, seed: int = 0, layers: int = 2) -> str:
    """GPT-2 is not a native family: it loads through the transformers fallback adapter (models/hf.py)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    eos = tokenizer.eos_token_id
    cfg = GPT2Config(vocab_size=len(tokenizer), n_positions=256, n_embd=32, n_layer=layers, n_head=4,
                     bos_token_id=eos, eos_token_id=eos, initializer_range=0.3)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    _perturb_(model, seed)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def byte_tokenizer(tmp_path_factory):
    return write_byte_tokenizer(tmp_path_factory.mktemp("byte_tokenizer"))


_checkpoints: dict[str, str] = {}
_loaded: dict[str, object] = {}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, byte_tokenizer):
    """checkpoint(name) -> directory of a tiny random checkpoint: a FAMILIES name, "gpt2" or "gpt2_draft"."""

    def get(name: str) -> str:
        if name not in _checkpoints:
            d = tmp_path_factory.mktemp(name)
            if name == "gpt2":
                _checkpoints[name] = write_gpt2_checkpoint(d, byte_tokenizer, seed=3)
            elif name == "gpt2_draft":
                _checkpoints[name] = write_gpt2_checkpoint(d, byte_tokenizer, seed=11, layers=1)
            else:
                _checkpoints[name] = write_family_checkpoint(d, name, byte_tokenizer)
        return _checkpoints[name]

    return get


@pytest.fixture(scope="session")
def loaded(checkpoint):
    """loaded(name) -> leaplm LoadedModel of checkpoint(name), loaded once per session (engines share it)."""
    from leaplm.models import load_model

    def get(name: str):
        if name not in _loaded:
            _loaded[name] = load_model(checkpoint(name))
        return _loaded[name]

    return get


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory, byte_tokenizer) -> str:
    """An encoder-only checkpoint (BertModel): not a causal LM, so leaplm must refuse it."""
    from transformers import BertConfig, BertModel

    d = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(byte_tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(str(d))
    byte_tokenizer.save_pretrained(str(d))
    return str(d)


# --- a tiny-vocabulary target and two drafts, for Monte Carlo tests ---------------------------------------------


@pytest.fixture(scope="session")
def tiny_vocab(tmp_path_factory):
    """{"target", "far", "near"} -> LoadedModel over the same 8 words t0..t7 (no EOS):
    target: 2 layers; far: an unrelated random 1-layer model (rarely agrees); near: the target plus noise
    (agrees often). Small enough to enumerate the target's distribution over three generated tokens."""
    from leaplm.models import load_model

    target = write_tiny_llama(tmp_path_factory.mktemp("v8_target"), vocab=8, layers=2, seed=0, init_range=0.5)
    far = write_tiny_llama(tmp_path_factory.mktemp("v8_far"), vocab=8, layers=1, seed=2, init_range=0.25)
    near = write_noisy_copy(target, tmp_path_factory.mktemp("v8_near"), noise=0.03, seed=5)
    return {name: load_model(path) for name, path in (("target", target), ("far", far), ("near", near))}


# --- a readable reference for the logits processors: transformers' own warpers ----------------------------------
def reference_probs(logits: torch.Tensor, context: list[list[int]], params) -> torch.Tensor:
    """logits [N, V]; context[i]: every token id before row i (prompt included) -> processed p [N, V], computed
    with transformers' processors in generate's order: repetition penalty, temperature, top-k, top-p, min-p."""
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    rows = []
    for i in range(logits.shape[0]):
        ids = torch.tensor([context[i]], dtype=torch.long)
        x = logits[i : i + 1].float().clone()
        if params.repetition_penalty != 1.0 and context[i]:
            x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, x)
        if params.temperature != 1.0:
            x = TemperatureLogitsWarper(params.temperature)(ids, x)
        if params.top_k:
            x = TopKLogitsWarper(params.top_k)(ids, x)
        if params.top_p < 1.0:
            x = TopPLogitsWarper(params.top_p)(ids, x)
        if params.min_p > 0:
            x = MinPLogitsWarper(params.min_p)(ids, x)
        rows.append(x.softmax(-1))
    return torch.cat(rows)


@pytest.fixture(scope="session")
def ref_probs():
    """The reference_probs function (transformers' warpers), for tests that check leaplm's processors."""
    return reference_probs
