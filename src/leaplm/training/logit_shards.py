"""Reading the cached-logit shards that `ondata.generate_target_logits` writes.

Every shard holds rows of one prompt length P, so a batch is drawn from a single shard and needs no padding.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class LogitBatch:
    input_ids: torch.Tensor           # [batch, P + new] int64
    topk_ids: torch.Tensor            # [batch, new, k] int64: the target's top-k tokens at each generated position
    topk_logp: torch.Tensor           # [batch, new, k] fp32: their log-probabilities under the target
    prompt_tokens: int                # P

    @property
    def new_tokens(self) -> int:
        return self.topk_ids.shape[1]


@dataclass
class _Shard:
    input_ids: torch.Tensor           # [rows, P + new] int32
    topk_ids: torch.Tensor            # [rows, new, k] int16
    topk_logp: torch.Tensor           # [rows, new, k] fp16
    prompt_tokens: int

    def rows(self, idx: list[int]) -> LogitBatch:
        return LogitBatch(self.input_ids[idx].long(), self.topk_ids[idx].long(), self.topk_logp[idx].float(),
                          self.prompt_tokens)


@dataclass
class LogitShards:
    train: list[_Shard]
    valid: list[_Shard]               # shards never trained on (see load)

    @classmethod
    def load(cls, directory: str | Path, valid_every: int = 25) -> "LogitShards":
        from safetensors import safe_open

        paths = sorted(Path(directory).glob("shard-*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"logits_dir: no shard-*.safetensors files in {str(directory)!r}")
        train, valid = [], []
        # every valid_every-th shard validates; with fewer shards than that, the last one (if there are two)
        held = {i for i in range(len(paths)) if i % valid_every == valid_every - 1} or \
            ({len(paths) - 1} if len(paths) > 1 else set())
        for i, p in enumerate(paths):
            with safe_open(str(p), "pt") as f:
                meta = f.metadata() or {}
                if "prompt_tokens" not in meta:
                    raise ValueError(f"logits_dir: {p.name} has no prompt_tokens metadata; not a logit shard")
                s = _Shard(f.get_tensor("input_ids"), f.get_tensor("topk_ids"), f.get_tensor("topk_logp"),
                           int(meta["prompt_tokens"]))
            (valid if i in held else train).append(s)
        return cls(train, valid)

    @property
    def vocab_bound(self) -> int:
        """One past the largest token id stored (to check against the draft's vocabulary)."""
        return 1 + max(int(s.input_ids.max()) for s in self.train + self.valid)

    @property
    def train_tokens(self) -> int:
        """Supervised positions (generated tokens) in the training shards."""
        return sum(s.topk_ids.shape[0] * s.topk_ids.shape[1] for s in self.train)

    def batch(self, rng: random.Random, batch_size: int) -> LogitBatch:
        """Random rows of one random training shard (fewer than batch_size if the shard is smaller)."""
        s = self.train[rng.randrange(len(self.train))]
        n = s.input_ids.shape[0]
        return s.rows(rng.sample(range(n), min(batch_size, n)))

    def valid_batches(self, batch_size: int, limit: int) -> list[LogitBatch]:
        """Fixed validation batches (the same ones every call)."""
        out = []
        for s in self.valid:
            for a in range(0, s.input_ids.shape[0], batch_size):
                if len(out) == limit:
                    return out
                out.append(s.rows(list(range(a, min(a + batch_size, s.input_ids.shape[0])))))
        return out
