"""The chat shards a chat draft learns from (chat_ondata.py writes them) and the draft's vocabulary chosen from
them: the target tokens that carry the most of the target's probability mass."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class ChatRow:
    ids: torch.Tensor                  # [P + N] int64, prompt + answer
    prompt_len: int
    topk_ids: torch.Tensor             # [N, k] int64 target ids
    topk_logp: torch.Tensor            # [N, k] fp32


@dataclass
class ChatShards:
    train: list[ChatRow]
    valid: list[ChatRow]
    temperatures: dict[str, int] = field(default_factory=dict)   # shard temperature -> rows

    @classmethod
    def load(cls, directory: str | Path, valid_every: int = 10) -> "ChatShards":
        from safetensors import safe_open

        paths = sorted(Path(directory).glob("chat-*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"logits_dir: no chat-*.safetensors shards in {str(directory)!r}")
        held = {i for i in range(len(paths)) if i % valid_every == valid_every - 1} or \
            ({len(paths) - 1} if len(paths) > 1 else set())
        out = cls([], [])
        for i, p in enumerate(paths):
            with safe_open(str(p), "pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != "chat-v1":
                    raise ValueError(f"logits_dir: {p.name} is not a chat shard (format {meta.get('format')!r})")
                t = {k: f.get_tensor(k) for k in ("input_ids", "prompt_len", "answer_len", "topk_ids", "topk_logp")}
            out.temperatures[meta["temperature"]] = out.temperatures.get(meta["temperature"], 0) + len(t["prompt_len"])
            for r in range(len(t["prompt_len"])):
                P, N = int(t["prompt_len"][r]), int(t["answer_len"][r])
                if N < 1:
                    continue
                row = ChatRow(t["input_ids"][r, : P + N].long(), P, t["topk_ids"][r, :N].long(),
                              t["topk_logp"][r, :N].float())
                (out.valid if i in held else out.train).append(row)
        if not out.train:
            raise ValueError(f"logits_dir: {directory} has no training rows")
        return out

    def answer_tokens(self, rows: list[ChatRow] | None = None) -> int:
        return sum(r.topk_ids.shape[0] for r in (self.train if rows is None else rows))


def choose_vocab(rows: list[ChatRow], n: int, target_vocab: int, text_mass: torch.Tensor | None = None,
                 keep: tuple[int, ...] = ()) -> torch.Tensor:
    """d2t [n] int64: -1 (row 0, "other"), then the n - 1 target tokens with the most target probability mass
    over the answers' top k (the emitted tokens counted once more), most first; text_mass ([V], sums to 1)
    adds a text corpus' frequencies at half the answers' weight (ranks the tokens the few answers never used).
    `keep` (BOS) come first whatever their mass: every prompt starts with them, and a target that attends to its
    BOS (Gemma) reads it as no other token, so the draft must not see it as "other"."""
    mass = torch.zeros(target_vocab, dtype=torch.float64)
    for r in rows:
        mass.index_add_(0, r.topk_ids.reshape(-1), r.topk_logp.exp().reshape(-1).double())
        mass.index_add_(0, r.ids[r.prompt_len:], torch.ones(len(r.ids) - r.prompt_len, dtype=torch.float64))
    mass = mass / mass.sum().clamp(min=1e-12)
    if text_mass is not None:
        mass = mass + 0.5 * text_mass
    mass[list(keep)] = float("inf")
    top = mass.topk(min(n - 1, target_vocab)).indices
    return torch.cat([torch.tensor([-1]), top])


def text_token_mass(stream_ids: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """[V] float64 token frequencies of a text corpus, summing to 1."""
    c = torch.bincount(stream_ids.long(), minlength=target_vocab)[:target_vocab].double()
    return c / c.sum().clamp(min=1)


def coverage(rows: list[ChatRow], d2t: torch.Tensor) -> float:
    """Fraction of emitted answer tokens inside the draft vocabulary (the most a draft can ever match)."""
    keep = set(d2t[d2t >= 0].tolist())
    toks = [t for r in rows for t in r.ids[r.prompt_len:].tolist()]
    return sum(t in keep for t in toks) / max(1, len(toks))
