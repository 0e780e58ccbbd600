"""The spellings vLLM and llama.cpp users already type, mapped onto leaplm's options (or refused with an error
that says what leaplm calls the thing). The commands declare the aliases; the translation lives here.

  vLLM       --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
             --speculative-config '{"model": "DRAFT", "num_speculative_tokens": 5}'
  llama.cpp  -md DRAFT, --draft-max N (K), --draft-min N (refused: leaplm has no minimum), -c N (context),
             -t N (threads), -ngl N (0 accepted: leaplm runs the whole model on --device), -n N (tokens in
             llama.cpp, samples in vLLM: leaplm's spelling is --samples; -n is refused when the value looks like a
             token count)
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..config import MAX_SAMPLES, ConfigError

# vLLM's method names -> leaplm's
SPEC_METHODS = {"ngram": "ngram", "draft_model": "draft", "draft": "draft", "suffix": "suffix",
                "lookahead": "lookahead", "layerskip": "layerskip", "none": "none"}
# vLLM's speculative_config keys -> leaplm's option names
SPEC_KEYS = {"method": "method", "num_speculative_tokens": "k", "model": "draft", "prompt_lookup_max": "ngram_max",
             "prompt_lookup_min": "ngram_min"}
# keys that only tune vLLM's own machinery: accepted and ignored, the output does not depend on them
SPEC_IGNORED = {"draft_tensor_parallel_size", "disable_by_batch_size", "max_model_len", "quantization", "revision",
                "draft_model_revision", "code_revision", "enforce_eager"}
SAMPLES_LOOK_LIKE_TOKENS = 16     # -n above this is almost surely llama.cpp's -n (tokens to predict)
# ConfigError fields raised here -> the flag the user typed
ALIAS_FLAGS = {"n": "-n", "samples": "--samples", "ngl": "-ngl", "draft_min": "--draft-min",
               "speculative_config": "--speculative-config"}


@dataclass
class SpecOverrides:
    """What --speculative-config says, in leaplm's names (None: not given)."""
    method: str | None = None
    k: int | None = None
    draft: str | None = None
    ngram_min: int | None = None
    ngram_max: int | None = None


def parse_speculative_config(text: str | None) -> SpecOverrides:
    """vLLM's --speculative-config JSON -> leaplm's method, k, draft, ngram_min/max; ConfigError naming the key."""
    out = SpecOverrides()
    if text is None:
        return out
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError("speculative_config", f"not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(d, dict):
        raise ConfigError("speculative_config", f"must be a JSON object, got {type(d).__name__}")
    for key, value in d.items():
        if key in SPEC_IGNORED:
            continue
        if key not in SPEC_KEYS:
            raise ConfigError("speculative_config", f"key {key!r} is not supported (leaplm reads: "
                                                    f"{', '.join(SPEC_KEYS)})")
        if key == "method":
            if value not in SPEC_METHODS:
                raise ConfigError("speculative_config", f"method {value!r} is not available in leaplm (methods: "
                                                        f"{', '.join(SPEC_METHODS)})")
            value = SPEC_METHODS[value]
        elif key == "model":
            if not isinstance(value, str) or not value:
                raise ConfigError("speculative_config", f"model must be a path or name, got {value!r}")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError("speculative_config", f"{key} must be a non-negative integer, got {value!r}")
        setattr(out, SPEC_KEYS[key], value)
    if out.method is None and out.draft is not None:
        out.method = "draft"
    return out


def check_llama_cpp_only(draft_min: int | None, n_gpu_layers: int | None) -> None:
    """llama.cpp options leaplm has no equivalent for: refused with leaplm's name for the nearest thing."""
    if draft_min is not None:
        raise ConfigError("draft_min", "leaplm has no minimum draft length: K is chosen per step from measured "
                                       "costs up to --k (--draft-max); --fixed-k always drafts --k")
    if n_gpu_layers not in (None, 0):
        raise ConfigError("ngl", "leaplm does not split a model across devices; --device cuda puts all of it "
                                 "on the GPU (-ngl 0 = --device cpu is accepted)")


def check_samples(n: int | None, samples: int = 1) -> int:
    """The number of samples: --samples N (at most MAX_SAMPLES, as the Python API), or vLLM's -n N, which
    llama.cpp users mean as tokens: refused above SAMPLES_LOOK_LIKE_TOKENS, naming --samples and --max-new-tokens."""
    if n is not None:
        if samples != 1:
            raise ConfigError("n", f"give --samples or -n, not both (got --samples {samples} and -n {n})")
        if n < 1:
            raise ConfigError("n", f"must be >= 1, got {n}")
        if n > SAMPLES_LOOK_LIKE_TOKENS:
            raise ConfigError("n", f"{n} samples? -n is the number of independent samples (vLLM's n); for tokens "
                                   f"to generate (llama.cpp's -n) use --max-new-tokens {n}; for {n} samples, "
                                   f"--samples {n}")
        return n
    if not (1 <= samples <= MAX_SAMPLES):
        raise ConfigError("samples", f"must be in [1, {MAX_SAMPLES}], got {samples}")
    return samples


def pick(option_value, alias_value, option: str, alias: str):
    """One of two spellings of the same setting; both given and different is an error naming both."""
    if alias_value is None:
        return option_value
    if option_value is not None and option_value != alias_value:
        raise ConfigError(option.lstrip("-").replace("-", "_"), f"{alias} {alias_value!r} contradicts "
                                                                f"{option} {option_value!r}; give one")
    return alias_value
