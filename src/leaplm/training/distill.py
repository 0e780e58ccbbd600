"""Distilling a draft from a trained target, resumable, saved as a Hugging Face checkpoint.

loss = alpha * KL(p || q) + (1 - alpha) * CE(text), per token, at temperature 1, where p is the target's
distribution (computed online, frozen) and q the draft's. Forward KL is the quantity speculative sampling
pays for: acceptance is 1 - TV(p, q), and KL(p || q) bounds TV by Pinsker. The CE term is plain next-token
loss on the corpus text.

With `logits_dir` (shards from `ondata.generate_target_logits`) the target is not run at all: the draft trains
on the target's own greedy continuations against their cached top-k log-probs, loss = alpha * KL(p_k || q)
+ (1 - alpha) * CE(target's greedy token), where p_k is p renormalised over its top k. That is on-policy
distillation at the cost of the draft alone, so it can run for many epochs.

Drafts for users who sample: speculative sampling at temperature T accepts a drafted token with probability
sum_x min(p_T(x), q_T(x)) = 1 - TV(p_T, q_T), so a draft that pays at T must match the whole tempered
distribution, on the states sampled continuations visit (`ondata --temperature`), not only the greedy token.
`loss` picks the divergence D(p_T || q_T) matched on the cached top k ("kl": forward KL, "tv": total variation,
the quantity acceptance pays for directly) and `temperatures` the T at which it is averaged; the greedy recipe
is loss "kl" at temperatures (1.0,), the defaults.

A draft trained with plain CE needs nothing here: that is `pretrain.pretrain` with preset draft-3m or draft-1m
(same tokenizer as the target); its output directory can then be this recipe's `draft_init`.
"""
from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import ConfigError
from .corpus import TokenStream, corpus_texts
from .loop import Checkpoint, LoopConfig, Schedule, StepLog, StepResult, Trainer, adamw
from .presets import PRESETS, llama_config
from .pretrain import load_tokenizer, save_hf

log = logging.getLogger(__name__)


@dataclass
class DistillConfig:
    target_dir: str                   # HF checkpoint of the target, with its tokenizer
    out_dir: str
    draft_init: str = "draft-3m"      # a preset name (random init) or an HF checkpoint dir (e.g. a CE-pretrained draft)
    corpus: str = "stdlib"
    tokens: int = 4_000_000           # training budget in tokens
    batch_size: int = 16
    seq_len: int = 512
    long_seq_len: int = 1024          # the last `long_fraction` of steps use this length (same tokens per step)
    long_fraction: float = 0.1
    # 1.0 = pure KL: acceptance depends only on p vs q, and the corpus text is a noisier signal of p than p itself
    alpha: float = 1.0
    lr: float = 1.5e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 100             # steps between resumable checkpoints
    eval_every: int = 100
    eval_batches: int = 8
    max_files: int | None = None      # limit the corpus (tests)
    bf16: bool = True
    # cached target logits (shards of ondata.generate_target_logits); then `corpus` and the seq_len fields are
    # unused and `tokens` counts supervised (generated) positions
    logits_dir: str | None = None
    # cached logits: divergence matched between p_T and q_T on the top k ("kl" or "tv"), averaged over these T
    loss: str = "kl"
    temperatures: tuple[float, ...] = (1.0,)

    def validate(self) -> None:
        for name in ("tokens", "batch_size", "seq_len", "warmup_steps", "save_every", "eval_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.alpha <= 1:
            raise ConfigError("alpha", f"must be in [0, 1], got {self.alpha}")
        if not 0 <= self.long_fraction < 1:
            raise ConfigError("long_fraction", f"must be in [0, 1), got {self.long_fraction}")
        if self.lr <= 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr}")
        if self.loss not in LOSSES:
            raise ConfigError("loss", f"must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if not self.temperatures or not all(0 < t <= 10 for t in self.temperatures):
            raise ConfigError("temperatures", f"must be a non-empty list of values in (0, 10], got {self.temperatures}")
        if (self.loss, tuple(self.temperatures)) != ("kl", (1.0,)) and self.logits_dir is None:
            raise ConfigError("loss", "tempered and TV losses need cached logits (logits_dir)")
        if self.logits_dir is not None and not Path(self.logits_dir).is_dir():
            raise ConfigError("logits_dir", f"{self.logits_dir!r} is not a directory")
        if not (Path(self.target_dir) / "config.json").exists():
            raise ConfigError("target_dir", f"{self.target_dir!r} is not a Hugging Face checkpoint (no config.json)")
        if self.draft_init not in PRESETS:
            if not (Path(self.draft_init) / "config.json").exists():
                raise ConfigError("draft_init", f"{self.draft_init!r} is neither a preset {sorted(PRESETS)} "
                                                "nor a Hugging Face checkpoint directory")
            # a pretrain out_dir holds its own train_state.pt, which this run would otherwise "resume"
            if Path(self.draft_init).resolve() == Path(self.out_dir).resolve():
                raise ConfigError("out_dir", "must differ from draft_init")

    @property
    def steps(self) -> int:
        return max(1, self.tokens // (self.batch_size * self.seq_len))


@dataclass
class DistillStepLog(StepLog):
    """StepLog.loss is the mixed loss; eval_loss is the draft's held-out CE."""

    kl: float = 0.0                   # KL(p || q) on this batch, nats per token
    ce: float = 0.0                   # draft CE on this batch's text, nats per token
    eval_kl: float | None = None      # held-out KL(p || q)
    agree: float | None = None        # cached logits: how often argmax q = the target's greedy token (train batch)
    eval_agree: float | None = None   # the same on the validation shards: per-token greedy acceptance
    eval_overlap: float | None = None  # validation shards: mean 1 - TV(p_T, q_T) over cfg.temperatures, i.e. the
                                       # per-token acceptance of speculative sampling at those T (teacher-forced)


@dataclass
class DistillLoss:
    loss: torch.Tensor                # [] the mixed loss, differentiable
    kl: torch.Tensor                  # [] KL(p || q) per token
    ce: torch.Tensor                  # [] CE per predicted token


def distill_loss(draft_logits: torch.Tensor, target_logp: torch.Tensor, ids: torch.Tensor,
                 alpha: float) -> DistillLoss:
    """alpha * KL(p || q) + (1 - alpha) * CE, averaged over tokens.

    draft_logits: [batch, seq, vocab]; target_logp: [batch, seq, vocab] fp32 log p; ids: [batch, seq].
    """
    logq = F.log_softmax(draft_logits.float(), dim=-1)  # [batch, seq, vocab]
    vocab = logq.shape[-1]
    # KL at every position; batchmean over the flattened [batch * seq] rows = per-token mean
    kl = F.kl_div(logq.reshape(-1, vocab), target_logp.reshape(-1, vocab), log_target=True, reduction="batchmean")
    ce = F.nll_loss(logq[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    return DistillLoss(alpha * kl + (1 - alpha) * ce, kl, ce)


LOSSES = ("kl", "tv")


@dataclass
class CachedLoss(DistillLoss):
    agree: torch.Tensor               # [] fraction of positions where argmax q is the target's greedy token
    overlap: torch.Tensor             # [] mean over positions and temperatures of 1 - TV(p_T,k, q_T)


@dataclass
class TemperedDivergence:
    kl: torch.Tensor                  # [batch, new] KL(p_T,k || q_T) on the top k
    tv: torch.Tensor                  # [batch, new] TV(p_T,k, q_T): half the L1 distance over the top k, plus
                                      # the mass q_T puts outside it (p_T,k has none there)


def tempered_divergence(draft_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor,
                        temperature: float) -> TemperedDivergence:
    """Divergences between the target and the draft both processed at `temperature`.

    draft_logits: [batch, new, vocab]; topk_ids, topk_logp: [batch, new, k], log p at T = 1. p_T,k is
    softmax(topk_logp / T): p at T renormalised over its top k (the tail was not stored)."""
    logq = F.log_softmax(draft_logits.float() / temperature, dim=-1)   # [batch, new, vocab]
    logq_k = logq.gather(-1, topk_ids)                                  # [batch, new, k]
    logp_k = F.log_softmax(topk_logp.float() / temperature, dim=-1)     # [batch, new, k]
    p_k, q_k = logp_k.exp(), logq_k.exp()
    kl = (p_k * (logp_k - logq_k)).sum(-1)
    tv = 0.5 * ((p_k - q_k).abs().sum(-1) + (1 - q_k.sum(-1)).clamp_min(0))
    return TemperedDivergence(kl, tv)


def cached_loss(draft_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor,
                alpha: float, loss: str = "kl", temperatures: tuple[float, ...] = (1.0,)) -> CachedLoss:
    """alpha * D + (1 - alpha) * CE(greedy token), averaged over positions, where D is the mean over
    `temperatures` of KL(p_T,k || q_T) (loss "kl") or TV(p_T,k, q_T) (loss "tv").

    draft_logits: [batch, new, vocab]; topk_ids: [batch, new, k] (column 0 is the target's argmax);
    topk_logp: [batch, new, k] log p. p_k renormalises p over its top k: the tail holds little mass and
    was not stored. With the defaults this is alpha * KL(p_k || q) + (1 - alpha) * CE, the greedy recipe."""
    divs = [tempered_divergence(draft_logits, topk_ids, topk_logp, t) for t in temperatures]
    kl = torch.stack([d.kl.mean() for d in divs]).mean()
    tv = torch.stack([d.tv.mean() for d in divs]).mean()
    logq0 = F.log_softmax(draft_logits.float(), dim=-1).gather(-1, topk_ids[..., :1])   # [batch, new, 1]
    ce = -logq0.mean()
    agree = (draft_logits.argmax(-1) == topk_ids[..., 0]).float().mean()
    d = kl if loss == "kl" else tv
    return CachedLoss(alpha * d + (1 - alpha) * ce, kl, ce, agree, 1 - tv.detach())


def _cached_step(draft, b, cfg: DistillConfig) -> CachedLoss:
    """Draft forward over prompt + continuation; logits only where the target's distribution is known."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
        logits = draft(input_ids=b.input_ids[:, :-1], logits_to_keep=b.new_tokens).logits  # [batch, new, vocab]
        return cached_loss(logits, b.topk_ids, b.topk_logp, cfg.alpha, cfg.loss, tuple(cfg.temperatures))


@dataclass
class CachedEval:
    ce: float                         # held-out CE on the target's greedy token
    kl: float                         # held-out KL(p_T,k || q_T), mean over cfg.temperatures
    agree: float                      # argmax q = the target's greedy token
    overlap: float                    # 1 - TV(p_T,k, q_T), mean over cfg.temperatures


@torch.no_grad()
def eval_cached(draft, shards, cfg: DistillConfig, n_batches: int) -> CachedEval:
    """Validation-shard CE, KL, greedy agreement and sampled overlap."""
    draft.eval()
    batches = shards.valid_batches(cfg.batch_size, n_batches)
    rs = [_cached_step(draft, b, cfg) for b in batches]
    draft.train()
    n = len(rs)
    return CachedEval(*(sum(getattr(r, f).item() for r in rs) / n for f in ("ce", "kl", "agree", "overlap")))


def target_logprobs(target, ids: torch.Tensor, bf16: bool) -> torch.Tensor:
    """log p of the frozen target: [batch, seq] -> [batch, seq, vocab] fp32, usable in autograd."""
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logp = F.log_softmax(target(input_ids=ids).logits.float(), dim=-1)
    # inference tensors cannot be saved for backward (kl_div saves its target); a clone outside the mode can
    return logp.clone()


def check_same_vocab(target_config, draft, target_tok, draft_tok=None) -> None:
    """A draft must score the target's tokens: equal vocab sizes, and equal tokenizers when the draft has one."""
    t, d = target_config.vocab_size, draft.config.vocab_size
    if t != d:
        raise ConfigError("draft_init", f"draft vocab_size {d} != target vocab_size {t}; "
                                        "a draft must use the target's tokenizer")
    if draft_tok is not None and draft_tok.get_vocab() != target_tok.get_vocab():
        raise ConfigError("draft_init", f"draft tokenizer differs from the target's (both {t} tokens); "
                                        "a draft must use the target's tokenizer")


@dataclass
class DistillEval:
    ce: float                         # draft held-out CE, nats per token
    kl: float                         # held-out KL(p || q), nats per token


@torch.no_grad()
def eval_distill(draft, target, stream: TokenStream, cfg: DistillConfig, n_batches: int) -> DistillEval:
    """Held-out CE and KL on fixed random windows (same windows every call)."""
    draft.eval()
    rng = random.Random(1234)
    ce, kl = 0.0, 0.0
    for _ in range(n_batches):
        x = stream.batch(rng, cfg.batch_size, cfg.seq_len)  # [batch, seq]
        logp = target_logprobs(target, x, cfg.bf16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            r = distill_loss(draft(input_ids=x).logits, logp, x, cfg.alpha)
        ce, kl = ce + r.ce.item(), kl + r.kl.item()
    draft.train()
    return DistillEval(ce / n_batches, kl / n_batches)


def _load_draft(cfg: DistillConfig, target_config, target_tok):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if cfg.draft_init in PRESETS:
        config = llama_config(cfg.draft_init, vocab_size=target_config.vocab_size, eos_id=target_tok.eos_token_id,
                              max_position_embeddings=target_config.max_position_embeddings)
        draft = LlamaForCausalLM(config)
        draft_tok = None
    else:
        draft = AutoModelForCausalLM.from_pretrained(cfg.draft_init, dtype=torch.float32)  # fp32 master weights
        has_tok = (Path(cfg.draft_init) / "tokenizer_config.json").exists()
        draft_tok = load_tokenizer(cfg.draft_init) if has_tok else None
    check_same_vocab(target_config, draft, target_tok, draft_tok)
    return draft


def distill(cfg: DistillConfig,
            on_step: Callable[[DistillStepLog], None] | None = None) -> DistillStepLog | None:
    """Train (or resume) the draft and write its checkpoint, with the target's tokenizer, to cfg.out_dir.

    Returns the last step's log (None when a resumed run had no steps left)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .logit_shards import LogitShards

    cfg.validate()
    out = Path(cfg.out_dir)
    tok = load_tokenizer(cfg.target_dir)
    target_config = AutoConfig.from_pretrained(cfg.target_dir)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    draft = _load_draft(cfg, target_config, tok)
    shards = train = held = target = None
    if cfg.logits_dir is not None:
        shards = LogitShards.load(cfg.logits_dir)
        if shards.vocab_bound > target_config.vocab_size:
            raise ConfigError("logits_dir", f"shards hold token id {shards.vocab_bound - 1}, outside the target's "
                                            f"vocabulary of {target_config.vocab_size}")
        per_step = cfg.batch_size * shards.train[0].topk_ids.shape[1]
        log.info("cached logits: %d supervised tokens, %d validation shards", shards.train_tokens, len(shards.valid))
    else:
        target = AutoModelForCausalLM.from_pretrained(cfg.target_dir,
                                                      dtype=torch.bfloat16 if cfg.bf16 else torch.float32)
        target.eval().requires_grad_(False)
        train = TokenStream.build(corpus_texts(cfg.corpus, "train", cfg.max_files), tok, tok.eos_token_id)
        if cfg.corpus == "stdlib":
            held = TokenStream.build(corpus_texts("stdlib", "heldout", cfg.max_files), tok, tok.eos_token_id)
        per_step = cfg.batch_size * cfg.seq_len
        log.info("corpus: %d training tokens, %s held-out", len(train), len(held) if held else "no")
    steps = max(1, cfg.tokens // per_step)

    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(cfg.seed)
    long_from = int(steps * (1 - cfg.long_fraction))

    def step(i: int) -> StepResult:
        if shards is not None:
            b = shards.batch(rng, cfg.batch_size)
            r = _cached_step(draft, b, cfg)
            n_tok = b.topk_ids.shape[0] * b.new_tokens
        else:
            if i >= long_from and cfg.long_seq_len > cfg.seq_len:
                x = train.batch(rng, max(1, cfg.batch_size * cfg.seq_len // cfg.long_seq_len), cfg.long_seq_len)
            else:
                x = train.batch(rng, cfg.batch_size, cfg.seq_len)  # [batch, seq]
            logp = target_logprobs(target, x, cfg.bf16)  # [batch, seq, vocab]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                r = distill_loss(draft(input_ids=x).logits, logp, x, cfg.alpha)
            n_tok = x.numel()
        return StepResult(r.loss, n_tok, dict(kl=r.kl.item(), ce=r.ce.item(),
                                              agree=r.agree.item() if isinstance(r, CachedLoss) else None))

    def evaluate(s: DistillStepLog) -> None:
        if shards is not None and shards.valid:
            ev = eval_cached(draft, shards, cfg, cfg.eval_batches)
            s.eval_loss, s.eval_kl, s.eval_agree, s.eval_overlap = ev.ce, ev.kl, ev.agree, ev.overlap
        elif held is not None:
            ev = eval_distill(draft, target, held, cfg, cfg.eval_batches)
            s.eval_loss, s.eval_kl = ev.ce, ev.kl

    available = shards.train_tokens if shards else len(train)
    with (out / "train_config.json").open("w") as f:
        json.dump(asdict(cfg) | {"kind": "distill", "steps": steps,
                                 "n_params": sum(p.numel() for p in draft.parameters()),
                                 "target_n_params": _n_params(cfg.target_dir, target),
                                 "train_tokens_available": available}, f, indent=1)
    last = Trainer(draft, adamw(draft.parameters(), cfg.lr, cfg.weight_decay),
                   LoopConfig(steps, Schedule(cfg.lr, cfg.min_lr, cfg.warmup_steps, steps), cfg.grad_clip,
                              cfg.save_every, cfg.eval_every),
                   step, DistillStepLog, Checkpoint(out / "train_state.pt"), out / "train_log.jsonl", rng,
                   evaluate=evaluate, on_step=on_step).run()
    save_hf(draft, tok, out)
    return last


def _n_params(target_dir: str, target) -> int:
    """The target's parameter count, from the loaded model or from its safetensors headers (no load)."""
    if target is not None:
        return sum(p.numel() for p in target.parameters())
    from safetensors import safe_open

    n = 0
    for f in Path(target_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n
