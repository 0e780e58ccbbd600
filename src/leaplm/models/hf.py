"""Fallback adapter: any transformers causal LM (gpt2, gpt_neox, ...) behind leaplm's CausalLM protocol.

Batch size 1 and chains only (no tree masks, no layer subsets). Rollback crops the DynamicCache lazily: the
committed length lives in `lengths`, and entries past it are cropped before the next forward.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from ..config import ConfigError
from .base import ModelCapabilities


class HFCache:
    def __init__(self, max_len: int):
        from transformers import DynamicCache

        self.pkv = DynamicCache()
        self.lengths = [0]
        self.max_len = max_len
        self.peak_nbytes = 0                   # transformers' DynamicCache grows on its own: not counted

    @property
    def batch_size(self) -> int:
        return 1

    def held(self) -> tuple[int, int]:
        """(token positions transformers' cache holds, 1 if it holds any): the backend's own count."""
        n = self.pkv.get_seq_length()
        return n, int(n > 0)

    def advance(self, n: int, row: int = 0) -> None:
        self.lengths[row] += n

    def truncate(self, length: int, row: int = 0) -> None:
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"truncate to {length} outside [0, {self.lengths[row]}]")
        self.lengths[row] = length

    def compact(self, offsets: list[int], row: int = 0) -> None:
        if any(o != i for i, o in enumerate(offsets)):
            raise NotImplementedError("the transformers fallback cannot compact a tree")

    def sync(self) -> None:
        excess = self.pkv.get_seq_length() - self.lengths[0]
        if excess > 0:
            self.pkv.crop(-excess)   # a negative count removes that many (transformers 4.x and 5.x alike)


def _causal_lm_class_names() -> set[str]:
    """Class names transformers builds for AutoModelForCausalLM (e.g. GPT2LMHeadModel, not BertModel)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([v] if isinstance(v, str) else v)
    return names


class HFCausalLM(torch.nn.Module):
    capabilities = ModelCapabilities()          # one row at a time, no trees, no hidden states

    def __init__(self, model):
        super().__init__()
        self.quantized: dict[str, object] = {}          # transformers runs its own weights: none of leaplm's
        self.model = model
        cfg = model.config
        self.vocab_size = cfg.vocab_size
        self.num_layers = getattr(cfg, "num_hidden_layers", getattr(cfg, "n_layer", 0))
        self.max_len = getattr(cfg, "max_position_embeddings", getattr(cfg, "n_positions", 2048))

    @classmethod
    def load(cls, path: Path, cfg: dict, device: str, dtype: torch.dtype, field: str = "model") -> "HFCausalLM":
        from transformers import AutoModelForCausalLM

        what = f"unsupported architecture {cfg.get('model_type')!r} (architectures={cfg.get('architectures')})"
        if cfg.get("is_encoder_decoder"):
            raise ConfigError(field, f"{what}: an encoder-decoder model is not a causal LM")
        archs = cfg.get("architectures") or []
        if archs and not any(a in _causal_lm_class_names() for a in archs):
            raise ConfigError(field, f"{what}: the checkpoint holds no causal-LM head")
        try:
            model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, output_loading_info=True)
        except (ValueError, KeyError, OSError) as e:
            raise ConfigError(field, f"{what}: {str(e).splitlines()[0]}") from None
        missing = sorted(info.get("missing_keys") or [])
        if missing:   # transformers would fill them with random weights and generate garbage
            raise ConfigError(field, f"{what}: weights missing from the checkpoint ({', '.join(missing[:3])}...)")
        return cls(model.to(device).eval())

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def new_cache(self, batch_size: int = 1, max_len: int | None = None) -> HFCache:
        if batch_size != 1:
            raise ValueError("the transformers fallback adapter runs one sequence at a time")
        return HFCache(max_len or self.max_len)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: HFCache, *, tree_mask=None, position_offsets=None,
                layers: Sequence[int] | None = None, last_only: bool = False) -> torch.Tensor:
        if tree_mask is not None or layers is not None:
            raise ValueError("the transformers fallback adapter supports neither tree masks nor layer subsets")
        cache.sync()
        out = self.model(input_ids=input_ids, past_key_values=cache.pkv, use_cache=True,
                         logits_to_keep=1 if last_only else 0)
        return out.logits
