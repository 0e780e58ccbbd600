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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import ConfigError
from .distill import DistillStepLog
from .loop import Checkpoint, LoopConfig, Schedule, StepResult, Trainer, adamw

log = logging.getLogger(__name__)

# narrow llamas; the LM head and embedding are N x hidden (tied)
DRAFT_SHAPES: dict[str, dict] = {
    "chat-2x256": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=1),
    "chat-1x256": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=1),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1),
}
# "cut-N": the target's own first N layers, final norm and (tied) embedding rows of the draft vocabulary, copied
# from the target and then distilled: a draft that starts close to the target's early representation
CUT_PREFIX = "cut-"
LOSSES = ("kl", "tv")


def cut_layers(shape: str) -> int | None:
    """N of a "cut-N" shape, else None."""
    if not shape.startswith(CUT_PREFIX):
        return None
    n = shape[len(CUT_PREFIX):]
    return int(n) if n.isdigit() and int(n) >= 1 else None


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
        if not 0 <= self.alpha <= 1:
            raise ConfigError("alpha", f"must be in [0, 1], got {self.alpha}")
        if not self.temperatures or not all(0 < t <= 10 for t in self.temperatures):
            raise ConfigError("temperatures", f"must be values in (0, 10], got {self.temperatures}")
        if not Path(self.logits_dir).is_dir():
            raise ConfigError("logits_dir", f"{self.logits_dir!r} is not a directory")


# ---- shards ------------------------------------------------------------------------------------------------

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


def choose_vocab(rows: list[ChatRow], n: int, target_vocab: int, text_mass: torch.Tensor | None = None) -> torch.Tensor:
    """d2t [n] int64: -1 (row 0, "other"), then the n - 1 target tokens with the most target probability mass
    over the answers' top k (the emitted tokens counted once more), most first; text_mass ([V], sums to 1)
    adds a text corpus' frequencies at half the answers' weight (ranks the tokens the few answers never used)."""
    mass = torch.zeros(target_vocab, dtype=torch.float64)
    for r in rows:
        mass.index_add_(0, r.topk_ids.reshape(-1), r.topk_logp.exp().reshape(-1).double())
        mass.index_add_(0, r.ids[r.prompt_len:], torch.ones(len(r.ids) - r.prompt_len, dtype=torch.float64))
    mass = mass / mass.sum().clamp(min=1e-12)
    if text_mass is not None:
        mass = mass + 0.5 * text_mass
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


# ---- the draft ---------------------------------------------------------------------------------------------

def target_embedding(model: str) -> torch.Tensor:
    """[V, hidden] fp32 input embedding of the target (GGUF token_embd, or embed_tokens of a checkpoint)."""
    from ..models.gguf import is_gguf

    if is_gguf(model):
        from gguf import GGUFReader
        from gguf.quants import dequantize

        t = next(t for t in GGUFReader(model).tensors if t.name == "token_embd.weight")
        return torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
    from ..models.loading import read_state_dict

    sd = read_state_dict(Path(model))
    key = next(k for k in sd if k.endswith("embed_tokens.weight"))
    return sd[key].float()


# llama.cpp tensor names -> Hugging Face names of one layer
_GGUF_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def _llama_cpp_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """[rows, cols] llama.cpp's interleaved rotary pairs -> Hugging Face's rotate-half rows, per head (the inverse of
    models/gguf_export.llama_cpp_permute)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def target_checkpoint(model: str, n_layers: int | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(Hugging Face config dict, fp32 state dict with Hugging Face names) of the target; with n_layers, only the
    embedding, the final norm and layers 0..n_layers-1 (a GGUF file dequantizes only those tensors)."""
    from ..models.gguf import is_gguf

    if is_gguf(model):
        from gguf import GGUFReader
        from gguf.quants import dequantize
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        cfg = _full_config(load_gguf_checkpoint(model, return_tensors=False)["config"])
        heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        sd = {}
        for t in GGUFReader(model).tensors:
            name = t.name.rsplit(".", 1)[0]
            if name == "token_embd":
                key = "model.embed_tokens.weight"
            elif name == "output_norm":
                key = "model.norm.weight"
            elif name.startswith("blk."):
                _, i, kind = name.split(".", 2)
                if kind not in _GGUF_LAYER or (n_layers is not None and int(i) >= n_layers):
                    continue
                key = f"model.layers.{i}.{_GGUF_LAYER[kind]}.weight"
            else:
                continue
            w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
            if name.endswith("attn_q"):
                w = _llama_cpp_unpermute(w, heads)
            elif name.endswith("attn_k"):
                w = _llama_cpp_unpermute(w, kv)
            sd[key] = w
        return cfg, sd
    from ..models.loading import read_state_dict

    sd = {k if k.startswith(("model.", "lm_head")) else f"model.{k}": v.float()
          for k, v in read_state_dict(Path(model)).items()}
    return json.loads((Path(model) / "config.json").read_text()), sd


def _full_config(cfg: dict) -> dict:
    """The full Hugging Face config dict (defaults filled in) of a config dict read from a GGUF file."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**cfg).to_dict()


def build_cut_draft(model: str, n_layers: int, d2t: torch.Tensor, eos_target: int):
    """A HF llama over len(d2t) rows made of the target's first n_layers layers, its final norm and its
    embedding rows d2t (row 0, "other", = the mean row), tied as input embedding and LM head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tcfg, sd = target_checkpoint(model, n_layers)
    if tcfg.get("model_type", "llama") != "llama":
        raise ConfigError("shape", f"{CUT_PREFIX}N needs a llama target, got model_type {tcfg.get('model_type')!r}")
    total = int(tcfg["num_hidden_layers"])
    if n_layers >= total:
        raise ConfigError("shape", f"{CUT_PREFIX}{n_layers}: the target has only {total} layers")
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "max_position_embeddings", "head_dim", "rope_parameters", "rope_theta", "hidden_act")
    t2d_eos = int((d2t == eos_target).nonzero()[0]) if bool((d2t == eos_target).any()) else 0
    conf = LlamaConfig(vocab_size=len(d2t), tie_word_embeddings=True, num_hidden_layers=n_layers,
                       bos_token_id=t2d_eos, eos_token_id=t2d_eos, **{k: tcfg[k] for k in keep if k in tcfg})
    draft = LlamaForCausalLM(conf)
    emb = sd["model.embed_tokens.weight"]                               # [V, H]
    rows = emb[d2t.clamp(min=0)].clone()                                # [N, H]
    rows[0] = emb.mean(0)
    own = {"model.embed_tokens.weight": rows, "model.norm.weight": sd["model.norm.weight"]}
    own |= {k: v for k, v in sd.items() if k.startswith("model.layers.") and int(k.split(".")[2]) < n_layers}
    missing, unexpected = draft.load_state_dict(own, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" and "rotary_emb" not in k]
    if missing or unexpected:
        raise ValueError(f"shape: cannot cut the target: missing {missing[:3]}, unexpected {unexpected[:3]}")
    draft.tie_weights()
    return draft


def build_draft(cfg: ChatDistillConfig, d2t: torch.Tensor, target_emb: torch.Tensor | None, eos_target: int):
    """A fresh HF llama over len(d2t) rows, embedding = PCA projection of the target's rows (scaled to the
    usual init std); a "cut-N" shape starts from the target's own first N layers instead."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    if (n := cut_layers(cfg.shape)) is not None:
        return build_cut_draft(cfg.model, n, d2t, eos_target)
    shape = DRAFT_SHAPES[cfg.shape]
    t2d_eos = int((d2t == eos_target).nonzero()[0]) if bool((d2t == eos_target).any()) else 0
    conf = LlamaConfig(vocab_size=len(d2t), tie_word_embeddings=True, max_position_embeddings=8192,
                       rope_theta=100000.0, rms_norm_eps=1e-5, bos_token_id=t2d_eos, eos_token_id=t2d_eos, **shape)
    draft = LlamaForCausalLM(conf)
    h = shape["hidden_size"]
    rows = target_emb[d2t.clamp(min=0)]                               # [N, H_target]
    rows[0] = target_emb.mean(0)
    centered = rows - rows.mean(0)
    _, _, v = torch.pca_lowrank(centered, q=min(h, centered.shape[1]), center=False)
    proj = centered @ v                                                # [N, <= h]
    emb = torch.zeros(len(d2t), h)
    emb[:, : proj.shape[1]] = proj / proj.std() * conf.initializer_range
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(emb)
    return draft


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


def make_batch(rows: list[ChatRow], t2d: torch.Tensor) -> ChatBatch:
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


def text_ce(draft, x: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Next-token CE of the draft on target-tokenized text x [B, S]; targets outside the vocabulary skipped."""
    d = t2d[x]                                                                  # [B, S] draft ids
    logits = draft(input_ids=d[:, :-1]).logits.float()                          # [B, S-1, N]
    logits[..., 0] = float("-inf")
    y = d[:, 1:]
    keep = y > 0
    return F.cross_entropy(logits[keep], y[keep])


# ---- training ----------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(draft, rows: list[ChatRow], t2d: torch.Tensor, cfg: ChatDistillConfig) -> ChatLoss | None:
    if not rows:
        return None
    draft.eval()
    parts = [chat_loss(_forward(draft, b), b, cfg.alpha, cfg.temperatures, cfg.loss)
             for b in (make_batch(rows[i : i + cfg.batch_size], t2d) for i in range(0, len(rows), cfg.batch_size))]
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
    vocab_path = out / "d2t.pt"
    d2t = torch.load(vocab_path) if vocab_path.exists() else choose_vocab(
        shards.train, cfg.draft_vocab, V, text_token_mass(text.ids, V) if text is not None else None)
    torch.save(d2t, vocab_path)
    t2d = t2d_table(d2t, V)
    cov = coverage(shards.valid or shards.train, d2t)
    log.info("chat shards: %d train rows (%d answer tokens), %d valid rows; temperatures %s; draft vocabulary "
             "%d covers %.3f of held-out answer tokens", len(shards.train), shards.answer_tokens(),
             len(shards.valid), shards.temperatures, len(d2t), cov)
    draft = build_draft(cfg, d2t, None if cut_layers(cfg.shape) else target_embedding(cfg.model), tok.eos_token_id)
    n_params = sum(p.numel() for p in draft.parameters())
    with (out / "train_config.json").open("w") as f:
        json.dump(asdict(cfg) | {"kind": "distill-chat", "target_dir": cfg.model, "n_params": n_params,
                                 "train_tokens_available": shards.answer_tokens(), "vocab_coverage": cov,
                                 "shard_temperatures": shards.temperatures}, f, indent=1)
    rng = random.Random(cfg.seed)

    def step(i: int) -> StepResult:
        r, loss, n_tok = None, torch.zeros(()), 0
        if shards.train:
            b = make_batch(rng.sample(shards.train, min(cfg.batch_size, len(shards.train))), t2d)
            r = chat_loss(_forward(draft, b), b, cfg.alpha, cfg.temperatures, cfg.loss)
            loss, n_tok = r.loss, len(b.emitted)
        if text is not None:
            loss = loss + cfg.text_weight * text_ce(draft, text.batch(rng, cfg.batch_size, cfg.text_seq_len), t2d)
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
