"""What transformers makes of a GGUF file's metadata (its Hugging Face config and fast tokenizer), made from the
metadata parse_gguf has already read.

transformers' own entry points read the file again through the `gguf` package's reader, which walks every element
of the tokenizer's arrays through numpy views: about 2 s for SmolLM2's 49k tokens and merges, paid once for the
config and once more by AutoTokenizer (which reads the config to pick the tokenizer's class). Both are the first
start's largest parts. Here:

  config      transformers' own key table (GGUF_CONFIG_MAPPING) applied to parse_gguf's fields, as its GGUF
              loader applies it (load_gguf_checkpoint, return_tensors=False); equal dicts on every architecture
              leaplm runs (tests/models/test_gguf_hf.py)
  tokenizer   the class AutoTokenizer would pick from that config, asked to build itself from the file (its GGUF
              path reads only the tokenizer's metadata); where AutoTokenizer may pick by anything but the config's
              model type (a tokenizer_config.json beside the file, a listed model name, Mistral's own backend),
              AutoTokenizer itself
"""
from __future__ import annotations

from fnmatch import fnmatch
from collections.abc import Container
from pathlib import Path


TEXT_BACKBONES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}


def hf_config_dict(fields: dict, tensor_names: Container[str]) -> dict:
    """The config dict load_gguf_checkpoint(path, return_tensors=False)["config"] holds for a file of these
    metadata fields and tensors (parse_gguf's GGUFFile.fields and .tensors): every
    metadata key transformers' table renames, the file's values as its reader returns them (a one-element array as
    its element, the architecture's name inside strings as the model type), tied embeddings when the file has no
    output.weight, and the vocabulary's size from the token list when no key gives it."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    f = fields
    arch = str(f["general.architecture"])
    # transformers names a llama file mistral only when general.name is exactly "mistral"
    model_type = "mistral" if "llama" in arch and f.get("general.name") == "mistral" else arch
    cfg: dict = {"tie_word_embeddings": "output.weight" not in tensor_names}
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {})
    for k, v in defaults.items():
        cfg.setdefault(k, v)
    for key, value in f.items():
        prefix, _, rest = key.replace(arch, model_type).partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest, -1)
        if renamed is None or renamed == -1:
            continue
        if hasattr(value, "tolist"):                 # numeric arrays: numpy in parse_gguf, lists in transformers
            value = value.tolist()
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, model_type)
        cfg[renamed] = value
    # as load_gguf_checkpoint: a Gemma 3 / 4 file holds the text backbone only
    cfg["model_type"] = TEXT_BACKBONES.get(cfg.get("model_type"), cfg.get("model_type"))
    if "vocab_size" not in cfg and "tokenizer.ggml.tokens" in f:
        cfg["vocab_size"] = len(f["tokenizer.ggml.tokens"])
    return cfg


def tokenizer_class(path: Path, cfg: dict):
    """The class AutoTokenizer.from_pretrained(path's directory, gguf_file=path's name) builds for a file with
    config dict `cfg` (hf_config_dict), or None where its choice may rest on more than the config's type."""
    from transformers import AutoConfig
    from transformers.models.auto import tokenization_auto as ta

    if (path.parent / "tokenizer_config.json").exists():      # a class named there comes first
        return None
    config = AutoConfig.for_model(**cfg)
    name = str(getattr(config, "_name_or_path", "") or "").lower()
    if getattr(config, "tokenizer_class", None) or any(fnmatch(name, p) for p in ta.MODEL_IDS_TO_TOKENIZERS_BACKEND):
        return None
    backend = ta.TokenizersBackend
    cls = ta.TOKENIZER_MAPPING.get(type(config), backend)
    if cls is None or backend is None or getattr(cls, "__name__", "") == "MistralCommonBackend":
        return None
    return cls


def convert_tokenizer(path: Path, cfg: dict):
    """The transformers fast tokenizer of a GGUF file, as AutoTokenizer builds it (tokenizer_class says when its
    own class choice can be skipped)."""
    cls = tokenizer_class(path, cfg)
    if cls is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return cls.from_pretrained(str(path.parent), gguf_file=path.name, _from_auto=True)
