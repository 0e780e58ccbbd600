"""Method name -> proposer factory. The only place that maps SpecConfig.method to code."""
from __future__ import annotations

from typing import Callable

from ..config import ConfigError, SpecConfig
from .base import ProposerFactory, SimpleFactory

# method -> builder(spec, target LoadedModel, draft LoadedModel | None) -> base.ProposerFactory. A factory whose
# new_group(max_rows, max_len) returns a group builds proposers that draft for many rows at once: each batch makes
# one group and passes it, factory(max_len, group) (base.ProposerGroup).
Builder = Callable[[SpecConfig, object, object], ProposerFactory]
BUILDERS: dict[str, Builder] = {}


def register(method: str):
    def deco(fn: Builder) -> Builder:
        BUILDERS[method] = fn
        return fn
    return deco


@register("draft")
def _draft(spec: SpecConfig, target, draft):
    from .draft_model import DraftModelFactory

    return DraftModelFactory(draft.model, out_device=target.model.device, vocab_size=target.model.vocab_size,
                             real_tokens=max(target.tokenizer.get_vocab().values()) + 1)


def make_proposer_factory(spec: SpecConfig, target, draft) -> ProposerFactory | None:
    """None for method 'none' (plain decoding through the same loop)."""
    if spec.method == "none":
        return None
    _load_builtin()
    if spec.method not in BUILDERS:
        raise ConfigError("method", f"method {spec.method!r} is not available in this build")
    factory = BUILDERS[spec.method](spec, target, draft)
    # a builder may return a plain function of max_len (proposers drafting row by row, remembering nothing)
    return factory if isinstance(factory, ProposerFactory) else SimpleFactory(factory)


def _load_builtin() -> None:
    """Import proposer modules so their @register runs (kept lazy: each pulls only what it needs)."""
    import importlib

    for mod in ("ngram", "suffix", "lookahead", "layer_skip", "eagle", "medusa"):
        try:
            importlib.import_module(f"{__package__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{mod}":
                raise
