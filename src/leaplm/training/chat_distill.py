"""Distilling a small reduced-vocabulary draft for any target from chat shards (chat_ondata.py).

The draft is a narrow llama over N rows (models/draft_vocab.py): row 0 stands for "any other target token",
rows 1..N-1 are the target tokens that carry the most of the target's probability mass in the training shards
(answers and their top-k). Its embedding starts as the target's own embedding rows projected on their top
principal directions, so a draft trained on little data starts from the target's notion of token similarity.

loss = alpha * mean_T KL(p_T,k || q_T) + (1 - alpha) * CE(emitted token), over answer positions, where p_T,k
is the target's cached top k at temperature T renormalised over the tokens in the draft's vocabulary and q_T
the draft's distribution with row 0 masked, as at inference. Resumable; logs train_log.jsonl rows that the
model card's loss curve reads.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import ConfigError
from .chat_draft_init import CUT_PREFIX, DRAFT_SHAPES, build_draft, cut_layers, target_embedding
from .chat_shards import ChatRow, ChatShards, choose_vocab, coverage, text_token_mass
from .distill import DistillStepLog
from .loop import Checkpoint, LoopConfig, Schedule, StepResult, Trainer, adamw

log = logging.getLogger(__name__)

LOSSES = ("kl", "tv")


@dataclass
class ChatDistillConfig:
    model: str                         # the target: GGUF file or checkpoint directory (its tokenizer, embedding)
    logits_dir: str                    # chat shards (train chatdata)
    out_dir: str
    shape: str = "chat-2x256"
    draft_vocab: int = 4096            # N rows, row 0 included
    steps: int = 2000
    batch_size: int = 16               # rows per step
    alpha: float = 0.9
    # divergence between p_T and q_T at each temperature: "kl" (forward KL, renormalised inside the draft
    # vocabulary) or "tv" (total variation against the target's cached top k: 1 - TV is the sampled acceptance)
    loss: str = "kl"
    temperatures: tuple[float, ...] = (1.0, 0.8)
    lr: float = 3e-3
    min_lr: float = 1e-4
    warmup_steps: int = 50
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 100
    eval_every: int = 100
    valid_every: int = 10              # every valid_every-th shard is held out (the last one when fewer)
    # plain next-token CE on a text corpus (draft compute only, no target): a cheap prior for the draft when the
    # target's answers are few; text_weight 0 turns it off
    text_corpus: str = "stdlib"
    text_weight: float = 0.0
    text_seq_len: int = 256
    text_max_files: int | None = 300   # the first files of the corpus (tokenizing all of the stdlib takes minutes)
    # prompt tokens a row keeps before its answer (its first token, BOS, kept too); None: all. The draft's cost
    # per step is mostly the prompts' when they are long; its attention then learns from shorter contexts
    max_context: int | None = None

    def validate(self) -> None:
        for name in ("steps", "batch_size", "warmup_steps", "save_every", "eval_every", "valid_every"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.shape not in DRAFT_SHAPES and cut_layers(self.shape) is None:
            raise ConfigError("shape", f"{self.shape!r} unknown; choose from {sorted(DRAFT_SHAPES)} or "
                                       f"{CUT_PREFIX}N (the target's first N layers)")
        if self.loss not in LOSSES:
            raise ConfigError("loss", f"{self.loss!r} unknown; choose from {', '.join(LOSSES)}")
        if self.draft_vocab < 2:
            raise ConfigError("draft_vocab", f"must be >= 2, got {self.draft_vocab}")
        if self.max_context is not None and self.max_context < 1:
            raise ConfigError("max_context", f"must be >= 1 or None, got {self.max_context}")
        if not 0 <= self.alpha <= 1:
            raise ConfigError("alpha", f"must be in [0, 1], got {self.alpha}")
        if not self.temperatures or not all(0 < t <= 10 for t in self.temperatures):
            raise ConfigError("temperatures", f"must be values in (0, 10], got {self.temperatures}")
        if not Path(self.logits_dir).is_dir():
            raise ConfigError("logits_dir", f"{self.logits_dir!r} is not a directory")


# ---- the loss ----------------------------------------------------------------------------------------------

@dataclass
class ChatBatch:
    inputs: torch.Tensor               # [B, L] draft ids (right-padded with 0)
    where: torch.Tensor                # [M, 2] (row, position) of each supervised answer position
    topk: torch.Tensor                 # [M, k] draft ids of the target's top k
    topk_in: torch.Tensor              # [M, k] bool: inside the draft vocabulary
    topk_logp: torch.Tensor            # [M, k]
    emitted: torch.Tensor              # [M] draft id of the emitted token (0 = outside)
    argmax_in: torch.Tensor            # [M] bool: the target's argmax is inside the draft vocabulary


def _cut_context(r: ChatRow, max_context: int | None) -> ChatRow:
    """The row with only its first token and the last max_context tokens of its prompt before the answer."""
    start = 1 if max_context is None else max(1, r.prompt_len - max_context)
    if start == 1:
        return r
    return ChatRow(torch.cat([r.ids[:1], r.ids[start:]]), r.prompt_len - start + 1, r.topk_ids, r.topk_logp)


def make_batch(rows: list[ChatRow], t2d: torch.Tensor, max_context: int | None = None) -> ChatBatch:
    rows = [_cut_context(r, max_context) for r in rows]
    L = max(len(r.ids) for r in rows) - 1
    inputs = torch.zeros(len(rows), L, dtype=torch.long)
    where, topk, logp, emitted = [], [], [], []
    for b, r in enumerate(rows):
        x = t2d[r.ids[:-1]]
        inputs[b, : len(x)] = x
        N = r.topk_ids.shape[0]
        pos = torch.arange(r.prompt_len - 1, r.prompt_len - 1 + N)     # logits at pos predict ids[pos + 1]
        where.append(torch.stack([torch.full_like(pos, b), pos], 1))
        topk.append(r.topk_ids)
        logp.append(r.topk_logp)
        emitted.append(r.ids[r.prompt_len:])
    tk = torch.cat(topk)
    dk = t2d[tk]
    return ChatBatch(inputs, torch.cat(where), dk, dk > 0, torch.cat(logp), t2d[torch.cat(emitted)], dk[:, 0] > 0)


@dataclass
class ChatLoss:
    loss: torch.Tensor
    kl: torch.Tensor                   # [] mean_T KL(p_T,k || q_T) over in-vocabulary top-k
    ce: torch.Tensor                   # [] CE of emitted tokens inside the vocabulary
    agree: torch.Tensor                # [] argmax q == the target's argmax (positions where it is in vocabulary)
    overlap: torch.Tensor              # [] mean_T sum_k min(p_T,k, q_T): per-token sampled acceptance (k-bounded)


def chat_loss(logits: torch.Tensor, b: ChatBatch, alpha: float, temperatures: tuple[float, ...],
              loss: str = "kl") -> ChatLoss:
    """logits [M, N] at the supervised positions; row 0 is masked as at inference. loss "kl": alpha * KL +
    (1 - alpha) * CE; "tv": alpha * TV + (1 - alpha) * CE, where TV(p_T, q_T) = 1 - sum_k min(p_T,k, q_T) over
    the cached top k (the mass outside them counted as disagreement), what rejection sampling loses."""
    logits = logits.float().clone()
    logits[:, 0] = float("-inf")
    kls, overlaps = [], []
    for T in temperatures:
        logq = F.log_softmax(logits / T, -1)                                    # [M, N]
        logq_k = logq.gather(-1, b.topk)                                         # [M, k]
        has = b.topk_in.any(-1)                                                  # [M]
        lp = (b.topk_logp / T).masked_fill(~b.topk_in, float("-inf"))
        # a position whose top k all lie outside the vocabulary would give NaN here, and NaN gradients through the
        # masked terms below even though they are dropped: such rows get finite stand-ins, excluded by `has`
        lp = torch.where(has[:, None], lp, torch.zeros_like(lp))
        logp_k = F.log_softmax(lp, -1)                                           # [M, k] renormalised in vocab
        p = logp_k.exp()
        term = torch.where(b.topk_in, p * (logp_k - logq_k), torch.zeros_like(p))
        kls.append(term.sum(-1)[has].mean())
        # acceptance at T: sum over tokens min(p, q); with p the full-vocabulary top-k mass (not renormalised)
        p_full = F.softmax(b.topk_logp / T, -1)                                  # [M, k] over the cached top k
        q_k = torch.where(b.topk_in, logq_k.exp(), torch.zeros_like(p))
        overlaps.append(torch.minimum(p_full, q_k).sum(-1).mean())
    kl = torch.stack(kls).mean()
    overlap = torch.stack(overlaps).mean()
    inv = b.emitted > 0
    ce = -F.log_softmax(logits, -1)[inv].gather(-1, b.emitted[inv].unsqueeze(1)).mean()
    agree = (logits.argmax(-1) == b.topk[:, 0]) & b.argmax_in
    div = kl if loss == "kl" else 1 - overlap
    return ChatLoss(alpha * div + (1 - alpha) * ce, kl, ce, agree.float().mean(), overlap)


def _forward(draft, b: ChatBatch) -> torch.Tensor:
    h = draft.model(input_ids=b.inputs).last_hidden_state                       # [B, L, H]
    return draft.lm_head(h[b.where[:, 0], b.where[:, 1]])                        # [M, N]


def text_ce(draft, x: torch.Tensor, t2d: torch.Tensor, bos: int | None = None) -> torch.Tensor:
    """Next-token CE of the draft on target-tokenized text x [B, S]; targets outside the vocabulary skipped.
    With `bos`, each window starts with it as every prompt does (no loss on the window's first token, which
    follows BOS here but not in the text)."""
    if bos is not None:
        x = torch.cat([torch.full_like(x[:, :1], bos), x], 1)                  # [B, S + 1]
    d = t2d[x]                                                                  # [B, S] draft ids
    logits = draft(input_ids=d[:, :-1]).logits.float()                          # [B, S-1, N]
    logits[..., 0] = float("-inf")
    y = d[:, 1:].clone()
    if bos is not None:
        y[:, 0] = 0
    keep = y > 0
    return F.cross_entropy(logits[keep], y[keep])


# ---- training ----------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(draft, rows: list[ChatRow], t2d: torch.Tensor, cfg: ChatDistillConfig) -> ChatLoss | None:
    if not rows:
        return None
    draft.eval()
    parts = [chat_loss(_forward(draft, b), b, cfg.alpha, cfg.temperatures, cfg.loss)
             for b in (make_batch(rows[i : i + cfg.batch_size], t2d, cfg.max_context)
                       for i in range(0, len(rows), cfg.batch_size))]
    draft.train()
    return ChatLoss(*(torch.stack([getattr(p, f) for p in parts]).mean()
                      for f in ("loss", "kl", "ce", "agree", "overlap")))


def distill_chat(cfg: ChatDistillConfig, on_step: Callable[[DistillStepLog], None] | None = None):
    """Train (or resume) the draft; writes the shippable draft directory (models/draft_vocab.py) to out_dir."""
    from ..models.draft_vocab import t2d_table

    cfg.validate()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.text_weight > 0 and not any(Path(cfg.logits_dir).glob("chat-*.safetensors")):
        shards = ChatShards([], [])                 # text only: a prior before any answer exists
    else:
        shards = ChatShards.load(cfg.logits_dir, cfg.valid_every)
    tok = _target_tokenizer(cfg.model)
    V = len(tok.get_vocab())
    text = None
    if cfg.text_weight > 0:
        from .corpus import TokenStream, corpus_texts

        text = TokenStream.build(corpus_texts(cfg.text_corpus, "train", cfg.text_max_files), tok, tok.eos_token_id)
        log.info("text corpus %s: %d tokens (CE weight %g)", cfg.text_corpus, len(text), cfg.text_weight)
    from ..models.tokens import bos_to_add

    bos = bos_to_add(tok)
    vocab_path = out / "d2t.pt"
    d2t = torch.load(vocab_path) if vocab_path.exists() else choose_vocab(
        shards.train, cfg.draft_vocab, V, text_token_mass(text.ids, V) if text is not None else None,
        keep=() if bos is None else (bos,))
    torch.save(d2t, vocab_path)
    t2d = t2d_table(d2t, V)
    cov = coverage(shards.valid or shards.train, d2t)
    log.info("chat shards: %d train rows (%d answer tokens), %d valid rows; temperatures %s; draft vocabulary "
             "%d covers %.3f of held-out answer tokens", len(shards.train), shards.answer_tokens(),
             len(shards.valid), shards.temperatures, len(d2t), cov)
    draft = build_draft(cfg.shape, cfg.model, cfg.seed, d2t, None if cut_layers(cfg.shape) else target_embedding(cfg.model), tok.eos_token_id)
    n_params = sum(p.numel() for p in draft.parameters())
    with (out / "train_config.json").open("w") as f:
        json.dump(asdict(cfg) | {"kind": "distill-chat", "target_dir": cfg.model, "n_params": n_params,
                                 "train_tokens_available": shards.answer_tokens(), "vocab_coverage": cov,
                                 "shard_temperatures": shards.temperatures}, f, indent=1)
    rng = random.Random(cfg.seed)

    def step(i: int) -> StepResult:
        r, loss, n_tok = None, torch.zeros(()), 0
        if shards.train:
            b = make_batch(rng.sample(shards.train, min(cfg.batch_size, len(shards.train))), t2d, cfg.max_context)
            r = chat_loss(_forward(draft, b), b, cfg.alpha, cfg.temperatures, cfg.loss)
            loss, n_tok = r.loss, len(b.emitted)
        if text is not None:
            loss = loss + cfg.text_weight * text_ce(draft, text.batch(rng, cfg.batch_size, cfg.text_seq_len), t2d, bos)
            n_tok += cfg.batch_size * cfg.text_seq_len
        return StepResult(loss, n_tok, dict(kl=r.kl.item() if r else 0.0, ce=r.ce.item() if r else 0.0,
                                            agree=r.agree.item() if r else None))

    def evaluate_log(s: DistillStepLog) -> None:
        ev = evaluate(draft, shards.valid, t2d, cfg)
        if ev is not None:
            s.eval_loss, s.eval_kl, s.eval_agree = ev.ce.item(), ev.kl.item(), ev.agree.item()
            s.eval_overlap = ev.overlap.item()

    return Trainer(draft, adamw(draft.parameters(), cfg.lr, cfg.weight_decay),
                   LoopConfig(cfg.steps, Schedule(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps), cfg.grad_clip,
                              cfg.save_every, cfg.eval_every),
                   step, DistillStepLog, Checkpoint(out / "train_state.pt"), out / "train_log.jsonl", rng,
                   evaluate=evaluate_log, on_checkpoint=lambda _: save_draft(draft, d2t, tok, out, cfg.model),
                   on_step=on_step).run()


def _target_tokenizer(model: str):
    from ..models.gguf import inspect_gguf, is_gguf, load_gguf_tokenizer

    if is_gguf(model):
        return load_gguf_tokenizer(inspect_gguf(model))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def save_draft(draft, d2t: torch.Tensor, tok, out: Path, target: str) -> None:
    """The shippable directory: fp16 llama weights, draft_vocab.safetensors, the target's tokenizer and the
    tokenizer fingerprint the engine matches targets by."""
    import copy

    from safetensors.torch import save_file

    from ..models.draft_vocab import DRAFT_VOCAB_FILE, tokenizer_fingerprint

    m = copy.deepcopy(draft).to(torch.float16)
    m.config.torch_dtype = torch.float16
    m.config.leaplm_draft = {"target_vocab_size": len(tok.get_vocab()), "tokenizer_sha256": tokenizer_fingerprint(tok),
                             "target": Path(target).name}
    m.save_pretrained(str(out), safe_serialization=True)
    save_file({"d2t": d2t.contiguous()}, str(out / DRAFT_VOCAB_FILE))
    tok.save_pretrained(str(out))
