"""Logits processors (penalty, temperature, top-k, top-p, min-p) -> probabilities; seeded sampling."""
from .processors import LogitsProcessor, block_presence, make_generator, tree_presence

__all__ = ["LogitsProcessor", "block_presence", "make_generator", "tree_presence"]
