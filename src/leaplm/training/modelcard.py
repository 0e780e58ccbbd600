"""A model card (README.md) and loss-curve plot for a model trained by pretrain or distill.

Everything is read from the run's own records, train_config.json and train_log.jsonl, so a card can be
rewritten at any time (e.g. once acceptance has been measured) without retraining.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .corpus import HELD_OUT_MODULES
from .perplexity import Perplexity
from .presets import PRESETS

CARD = "README.md"
PLOT = "loss_curve.png"


@dataclass
class TrainRecord:
    config: dict                      # train_config.json
    steps: list[dict]                 # train_log.jsonl rows, one per step, in step order

    @property
    def kind(self) -> str:
        return self.config.get("kind", "distill" if "target_dir" in self.config else "pretrain")

    def final_train(self, key: str = "loss", last: int = 20) -> float | None:
        """Mean of a per-step field over the last `last` steps (a single step's loss is noisy)."""
        tail = [r[key] for r in self.steps[-last:] if r.get(key) is not None]
        return sum(tail) / len(tail) if tail else None

    def final(self, key: str):
        """The last non-null value of a log field (e.g. eval_loss), or None."""
        vals = [r[key] for r in self.steps if r.get(key) is not None]
        return vals[-1] if vals else None


def read_train_record(run_dir: str | Path) -> TrainRecord:
    """Load a run's config and log. A resumed run re-logs the steps after its last save; the later row wins."""
    run_dir = Path(run_dir)
    cfg_path, log_path = run_dir / "train_config.json", run_dir / "train_log.jsonl"
    if not cfg_path.exists() or not log_path.exists():
        raise FileNotFoundError(f"{run_dir} has no train_config.json / train_log.jsonl (not a training run)")
    config = json.loads(cfg_path.read_text())
    by_step: dict[int, dict] = {}
    for line in log_path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[row["step"]] = row
    return TrainRecord(config, [by_step[s] for s in sorted(by_step)])


def plot_loss_curve(record: TrainRecord, path: str | Path) -> Path:
    """Train loss (raw and smoothed) and held-out loss against tokens seen, written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["tokens_seen"] / 1e6 for r in record.steps]
    y = [r["loss"] for r in record.steps]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    train_label = "train loss" + (" (alpha-mixed)" if record.kind == "distill" else "")
    k = max(1, len(y) // 50)  # moving average over ~2% of the run
    if k > 1:
        ax.plot(x, y, color="tab:blue", alpha=0.3, lw=0.8, label=f"{train_label}, per step")
        train_label += f", mean of {k} steps"
    smooth = [sum(y[max(0, i - k + 1) : i + 1]) / len(y[max(0, i - k + 1) : i + 1]) for i in range(len(y))]
    ax.plot(x, smooth, color="tab:blue", lw=1.5, label=train_label)
    ev = [(r["tokens_seen"] / 1e6, r["eval_loss"]) for r in record.steps if r.get("eval_loss") is not None]
    if ev:
        ax.plot(*zip(*ev), "o-", color="tab:orange", ms=3, label="held-out CE")
    if record.kind == "distill":
        kl = [(r["tokens_seen"] / 1e6, r["eval_kl"]) for r in record.steps if r.get("eval_kl") is not None]
        if kl:
            ax.plot(*zip(*kl), "s--", color="tab:green", ms=3, label="held-out KL(p || q)")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("nats per token")
    ax.set_title(f"{record.kind}: {record.config.get('preset') or record.config.get('draft_init', '')}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v).replace("|", "\\|")  # a bare pipe would split the cell


def markdown_table(rows: list[dict]) -> str:
    """Rows of dicts as a Markdown table; columns in order of first appearance."""
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    lines = ["| " + " | ".join(_fmt(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def hms(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m {s:02d}s"


def _architecture(c: dict) -> str:
    preset = c.get("preset") or (c.get("draft_init") if c.get("draft_init") in PRESETS else None)
    if preset:
        return f"Llama, preset {preset}" + (" (random init)" if "draft_init" in c else "")
    return f"as {c.get('draft_init')} (its weights as the starting point)"


def _continuations(logits_dir: str) -> str:
    """'greedy continuations', or what the shard names say: e.g. 'continuations (greedy: 3 shards, sampled
    at T = 0.8: 6 shards)' (sampled shards carry -t<T>- in their names)."""
    import re
    from collections import Counter

    temps = Counter()
    for p in Path(logits_dir).glob("shard-*.safetensors"):
        m = re.search(r"-t([0-9.]+)-", p.name)
        temps[m.group(1) if m else "greedy"] += 1
    if set(temps) <= {"greedy"}:
        return "greedy continuations"
    parts = [f"{'greedy' if t == 'greedy' else f'sampled at T = {t}'}: {n} shards" for t, n in sorted(temps.items())]
    return f"continuations ({', '.join(parts)})"


def card_text(record: TrainRecord, name: str, perplexity: Perplexity | None = None,
              acceptance: list[dict] | None = None, plot_file: str | None = PLOT) -> str:
    """The README.md text; see write_model_card."""
    c, last = record.config, (record.steps[-1] if record.steps else {})
    cached = c.get("logits_dir")                  # distilled on cached target logits (on-policy)
    corpus = c.get("corpus", "?")
    held = ", ".join(HELD_OUT_MODULES) if corpus == "stdlib" or cached else None
    objective = "next-token cross-entropy"
    if record.kind == "distill":
        a = c.get("alpha", 1)
        objective = (f"{a} * KL(p_k || q) + {1 - a:.3g} * CE(target's greedy token); p_k: cached top-k target "
                     "log-probs" if cached else f"{a} * KL(p || q) + {1 - a:.3g} * CE, temperature 1")
        temps = [float(t) for t in c.get("temperatures", [1.0])]
        if cached and (c.get("loss", "kl"), temps) != ("kl", [1.0]):
            d = "KL(p_T,k || q_T)" if c.get("loss", "kl") == "kl" else "TV(p_T,k, q_T)"
            objective = (f"{a} * mean over T in {{{', '.join(f'{t:g}' for t in temps)}}} of {d} + {1 - a:.3g} * "
                         "CE(target's greedy token); p_T,k: cached top-k target log-probs at temperature T, "
                         "q_T: the draft's at T")
    facts = [
        ("recipe", record.kind),
        ("architecture", _architecture(c)),
        ("parameters", f"{c['n_params']:,}" if "n_params" in c else None),
        ("target", f"{c.get('target_dir')} ({c.get('target_n_params', 0):,} parameters)" if record.kind == "distill"
         else None),
        ("objective", objective),
        ("corpus", f"the target's {_continuations(cached)} of training-split prompts, with its logits ({cached})"
         if cached else "Python standard library" if corpus == "stdlib" else corpus),
        ("held-out modules (never trained on)", held),
        ("steps", f"{last.get('step', 0)} of {last.get('steps', '?')}"),
        ("tokens seen", f"{last.get('tokens_seen', 0):,}"),
        ("wall time", hms(last.get("elapsed_s", 0.0))),
        ("batch x sequence", f"{c.get('batch_size')} x (prompt + generated)" if cached
         else f"{c.get('batch_size')} x {c.get('seq_len')}"),
        ("learning rate", f"{c.get('lr')} -> {c.get('min_lr')} (warm-up {c.get('warmup_steps')} steps, cosine)"),
        ("final train loss (mean of last 20 steps)", record.final_train("loss")),
        ("final train KL(p || q) (mean of last 20 steps)", record.final_train("kl") if record.kind == "distill" else None),
        ("final held-out CE", record.final("eval_loss")),
        ("final held-out KL(p || q)" + (" (validation shards)" if cached else ""),
         record.final("eval_kl") if record.kind == "distill" else None),
        ("final greedy agreement, argmax q = target token (validation shards)", record.final("eval_agree")),
        ("final sampled overlap, 1 - TV(p_T, q_T) averaged over T (validation shards)",
         record.final("eval_overlap")),
    ]
    if perplexity is not None:
        facts.append((f"perplexity on {perplexity.corpus}/{perplexity.split} ({perplexity.tokens:,} tokens)",
                      f"{perplexity.perplexity:.3f} (CE {perplexity.loss:.4f})"))
    out = ["---", "library_name: transformers", "pipeline_tag: text-generation",
           "tags: [leaplm, speculative-decoding, python-code]", "---", "", f"# {name}", "",
           "A small Llama-architecture causal LM for Python code, part of leaplm's embedded model family "
           "(target and drafts share one tokenizer).", "", "## Training", "",
           markdown_table([{"": k, "value": v} for k, v in facts if v is not None])]
    if acceptance:
        out += ["", "## Speculative decoding acceptance", "", markdown_table(acceptance)]
    if plot_file:
        out += ["", "## Loss curve", "", f"![loss curve]({plot_file})"]
    out += ["", "## Usage", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "tok = AutoTokenizer.from_pretrained(path)", "model = AutoModelForCausalLM.from_pretrained(path)", "```", ""]
    return "\n".join(out)


def write_model_card(model_dir: str | Path, run_dir: str | Path | None = None, name: str | None = None,
                     perplexity: Perplexity | None = None, acceptance: list[dict] | None = None) -> Path:
    """Write README.md and loss_curve.png into model_dir; returns the README path.

    run_dir: where train_config.json and train_log.jsonl live (default: model_dir, as pretrain/distill write).
    name: the card's title (default: the directory name).
    perplexity: a held-out perplexity.Perplexity to report.
    acceptance: rows for an acceptance table, e.g. {"method": ..., "K": 4, "acceptance rate": 0.71, "tau": 3.1};
      columns are the keys in order of first appearance.
    """
    model_dir = Path(model_dir)
    record = read_train_record(run_dir or model_dir)
    plot = plot_loss_curve(record, model_dir / PLOT) if record.steps else None
    text = card_text(record, name or model_dir.resolve().name, perplexity, acceptance, plot.name if plot else None)
    path = model_dir / CARD
    path.write_text(text)
    return path
