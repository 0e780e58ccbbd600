"""`leaplm train draft`: a draft for a target in one resumable command.

Two stages in one run directory:
  OUT/run.json     what the run is for: the target's tokenizer fingerprint and the settings that shape its data and
                   draft; a rerun with another target or other settings is refused, naming what differs
  OUT/chatdata/    stage 1, the target's own chat answers with top-k log-probs (chat_ondata.py, shards written
                   whole every shard_rows answers, so a killed run keeps them)
  OUT/draft/       stage 2, the distilled draft (chat_distill.py, checkpoint every save_every steps); when done
                   it is a draft directory `--draft OUT/draft` loads; with sampled_steps > 0, stage 3 continues
                   the same draft for that many steps on total variation at sampled_temperatures (1 - TV is what
                   rejection sampling accepts at those temperatures), the log running on from stage 2's steps
A rerun resumes: stage 1 skips the shards present, stages 2 and 3 continue from the last checkpoint.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from ..config import ConfigError
from .chat_distill import ChatDistillConfig, distill_chat
from .chat_ondata import ChatDataConfig, generate_chat_logits

RUN_FILE = "run.json"
RUN_KIND = "leaplm-train-draft"
# settings a rerun may change (budget, speed knobs); every other field must match the run on disk
RESUMABLE = ("steps", "threads", "save_every", "eval_every", "batch_size_data", "n_prompts", "sampled_steps")


@dataclass
class DraftRunConfig:
    """Defaults: a short run. The shipped SmolLM2 draft (embedded/smollm2-draft) is n_prompts=2048, steps=800,
    sampled_steps=100 (its card has the command); a larger n_prompts and steps buy acceptance with time
    (docs/drafts-and-heads.md)."""
    target: str                                   # GGUF file or checkpoint directory of the target
    out_dir: str
    shape: str = "cut-2"                          # chat_draft_init.DRAFT_SHAPES or cut-N
    draft_vocab: int = 4096
    # stage 1: data
    prompts: str = "chat"                         # "chat" (chat answers) or "text" (a base model's continuations)
    n_prompts: int = 320
    new_tokens: int = 128
    top_k: int = 20
    data_temperatures: tuple[float, ...] = (0.0, 0.8)
    max_prompt_tokens: int = 256
    batch_size_data: int = 32
    shard_rows: int = 16
    # stage 2: distillation
    steps: int = 200
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 20
    alpha: float = 0.9
    loss: str = "kl"
    temperatures: tuple[float, ...] = (1.0, 0.8)
    text_weight: float = 0.0
    # stage 3 (0 = none): steps of total variation at sampled_temperatures after the `steps` of stage 2
    sampled_steps: int = 0
    sampled_temperatures: tuple[float, ...] = (0.8, 1.0)
    save_every: int = 25
    eval_every: int = 50
    seed: int = 0
    threads: int | None = None
    max_files: int | None = None                  # limit the stdlib scan (tests)
    extra: dict = field(default_factory=dict)     # ChatDistillConfig fields passed through (tests, experiments)

    def data_config(self) -> ChatDataConfig:
        return ChatDataConfig(model=self.target, out_dir=str(Path(self.out_dir) / "chatdata"),
                              n_prompts=self.n_prompts, new_tokens=self.new_tokens, top_k=self.top_k,
                              batch_size=self.batch_size_data, shard_rows=self.shard_rows,
                              temperatures=self.data_temperatures, max_prompt_tokens=self.max_prompt_tokens,
                              seed=self.seed, max_files=self.max_files, threads=self.threads,
                              prompts=self.prompts)

    def distill_config(self) -> ChatDistillConfig:
        return ChatDistillConfig(model=self.target, logits_dir=str(Path(self.out_dir) / "chatdata"),
                                 out_dir=str(Path(self.out_dir) / "draft"), shape=self.shape,
                                 draft_vocab=self.draft_vocab, steps=self.steps, batch_size=self.batch_size,
                                 alpha=self.alpha, loss=self.loss, temperatures=self.temperatures, lr=self.lr,
                                 warmup_steps=self.warmup_steps, save_every=self.save_every,
                                 eval_every=self.eval_every, seed=self.seed, text_weight=self.text_weight,
                                 **self.extra)

    def sampled_config(self) -> ChatDistillConfig:
        """Stage 3: the draft of stage 2 trained on, `sampled_steps` more steps of the tv loss."""
        return replace(self.distill_config(), loss="tv", temperatures=self.sampled_temperatures,
                       steps=self.steps + self.sampled_steps)


@dataclass
class DraftRunProgress:
    """What on_progress receives: the stage, and its counts."""
    stage: str                                    # "data" or "distill"
    done: int
    total: int
    step_log: object | None = None                # distill: the DistillStepLog of the step


def target_fingerprint(target: str, chat: bool = True) -> tuple[str, int]:
    """(tokenizer sha256, vocabulary size) of a target the engine can load; ConfigError('target') otherwise (and
    when `chat` asks for a chat template the tokenizer lacks)."""
    from ..models.draft_vocab import tokenizer_fingerprint
    from ..models.gguf import inspect_gguf, is_gguf, load_gguf_tokenizer
    from ..models.loading import check_source

    if is_gguf(target):
        tok = load_gguf_tokenizer(inspect_gguf(target, "target"), "target")
    else:
        check_source(target, "target")
        p = Path(target)
        if not (p / "config.json").is_file():
            raise ConfigError("target", f"{target!r} is neither a GGUF file nor a checkpoint directory")
        cfg = json.loads((p / "config.json").read_text())
        from ..models.arch import arch_of

        if arch_of(cfg.get("model_type")) is None:
            raise ConfigError("target", f"{target}: model_type {cfg.get('model_type')!r} cannot be distilled from "
                                        "(leaplm's native families only)")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target)
    if chat and getattr(tok, "chat_template", None) is None:
        raise ConfigError("target", f"{target}: the tokenizer has no chat template (train draft generates chat "
                                    "answers; a base model takes prompts='text')")
    return tokenizer_fingerprint(tok), len(tok.get_vocab())


def _identity(cfg: DraftRunConfig, fingerprint: str) -> dict:
    d = asdict(cfg)
    for k in (*RESUMABLE, "out_dir", "target"):
        d.pop(k)
    return {"kind": RUN_KIND, "tokenizer_sha256": fingerprint, "target": Path(cfg.target).name} | \
        json.loads(json.dumps(d))


def check_run_dir(cfg: DraftRunConfig, fingerprint: str) -> None:
    """Refuse an output directory that holds anything but this run (another target, other settings, other files)."""
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError("out_dir", f"{cfg.out_dir!r} is not a directory")
    if not out.exists() or not any(out.iterdir()):
        return
    run = out / RUN_FILE
    if not run.is_file():
        raise ConfigError("out_dir", f"{cfg.out_dir!r} is not empty and holds no {RUN_FILE}: not a `train draft` "
                                     "run; choose an empty or new directory")
    have = json.loads(run.read_text())
    want = _identity(cfg, fingerprint)
    if have.get("kind") != RUN_KIND:
        raise ConfigError("out_dir", f"{run} is not a `train draft` run")
    if have.get("tokenizer_sha256") != fingerprint:
        raise ConfigError("out_dir", f"{cfg.out_dir!r} holds a run for another target ({have.get('target')}, "
                                     f"tokenizer {str(have.get('tokenizer_sha256'))[:12]}...; this target's is "
                                     f"{fingerprint[:12]}...); choose another directory")
    # a setting missing from an older run.json was made at that setting's default
    have = _identity(DraftRunConfig(target=cfg.target, out_dir=cfg.out_dir), fingerprint) | have
    diff = [k for k in want if k not in ("target",) and have.get(k) != want[k]]
    if diff:
        k = diff[0]
        raise ConfigError("out_dir", f"{cfg.out_dir!r} holds a run with other settings: {k} = {have.get(k)!r} there, "
                                     f"{want[k]!r} here ({len(diff)} setting(s) differ); rerun with the same "
                                     "settings to resume, or choose another directory")


def train_draft(cfg: DraftRunConfig, on_progress: Callable[[DraftRunProgress], None] | None = None):
    """Run (or resume) the stages; returns the last DistillStepLog (None when the draft was already done)."""
    cfg.data_config().validate()
    dcfg = cfg.distill_config()
    replace(dcfg, logits_dir=".").validate()      # the shards' directory is made by stage 1
    if cfg.sampled_steps < 0:
        raise ConfigError("sampled_steps", f"must be >= 0, got {cfg.sampled_steps}")
    if not cfg.sampled_temperatures or not all(0 < t <= 10 for t in cfg.sampled_temperatures):
        raise ConfigError("sampled_temperatures", f"must be values in (0, 10], got {cfg.sampled_temperatures}")
    fp, _ = target_fingerprint(cfg.target, chat=cfg.prompts == "chat")
    check_run_dir(cfg, fp)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_FILE).write_text(json.dumps(_identity(cfg, fp), indent=1))
    generate_chat_logits(cfg.data_config(), on_rows=lambda d, n: on_progress and on_progress(
        DraftRunProgress("data", d, n)))

    def on_step(s) -> None:
        if on_progress:
            on_progress(DraftRunProgress("distill", s.step, s.steps, s))

    last = distill_chat(dcfg, on_step)
    if cfg.sampled_steps:
        last = distill_chat(cfg.sampled_config(), on_step) or last
    return last
