"""Model cards of trained heads: what was trained, for which target, how long, and the loss and acceptance
curves (matplotlib) from the run's train_log.jsonl."""
from __future__ import annotations

import json
from pathlib import Path

from .modelcard import hms, markdown_table, read_train_record

PLOT = "loss_curve.png"


def plot_head_curves(steps: list[dict], path: Path, kind: str) -> Path:
    """Train loss and KL per step; held-out acceptance 1 - TV(p, q) per draft position (or head)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    x = [s["step"] for s in steps]
    a.plot(x, [s["loss"] for s in steps], lw=0.8, label="train loss (weighted over positions)")
    a.plot(x, [s["kl"] for s in steps], lw=0.8, label="train KL(p || q), first position")
    a.set_xlabel("step")
    a.set_ylabel("nats per token")
    a.grid(alpha=0.3)
    a.legend()
    ev = [s for s in steps if s.get("eval_accept")]
    for j in range(len(ev[0]["eval_accept"]) if ev else 0):
        b.plot([s["step"] for s in ev], [s["eval_accept"][j] for s in ev], "o-", ms=3,
               label=f"{'head' if kind == 'medusa' else 'draft position'} {j + 1}")
    b.set_xlabel("step")
    b.set_ylabel("held-out acceptance 1 - TV(p, q)")
    b.set_ylim(0, 1)
    b.grid(alpha=0.3)
    if ev:
        b.legend()
    fig.suptitle(f"leaplm train {kind}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_head_card(head_dir: str | Path, acceptance: list[dict] | None = None, command: str | None = None) -> Path:
    d = Path(head_dir)
    rec = read_train_record(d)
    meta = json.loads((d / "config.json").read_text())
    kind = meta.get("kind", "eagle")
    steps = rec.steps
    plot_head_curves(steps, d / PLOT, kind)
    last = steps[-1] if steps else {}
    ev = [s for s in steps if s.get("eval_accept")]
    facts = [("kind", kind), ("target", meta.get("target_name")),
             ("target weights sha256", meta["target"]["weights_sha256"][:16] + "..."),
             ("head", ", ".join(f"{k}={v}" for k, v in meta["head"].items())),
             ("steps", f"{last.get('step')} of {rec.config.get('steps')}"),
             ("tokens trained on (replays counted)", f"{last.get('tokens_seen', 0):,}"),
             ("wall time", hms(last.get("elapsed_s", 0.0))),
             ("data", f"chat prompts of {rec.config.get('corpus')} through the target's chat template, answered "
                      f"by the target at temperatures {rec.config.get('temperatures')} (loss on the answers)"
              if rec.config.get("chat") else
              f"corpus {rec.config.get('corpus')} prompts continued by the target at temperatures "
              f"{rec.config.get('temperatures')}; corpus windows {rec.config.get('corpus_fraction')}"),
             ("draft vocabulary", _vocab_fact(meta)),
             (f"final held-out acceptance 1 - TV by {'head' if kind == 'medusa' else 'position'}",
              ", ".join(f"{a:.3f}" for a in ev[-1]["eval_accept"]) if ev else None),
             ("command", f"`{command}`" if command else None)]
    out = [f"# leaplm {kind} head", "", f"Trained with `leaplm train {kind}` on a CPU against the frozen target.",
           "", markdown_table([{"": k, "value": v} for k, v in facts if v is not None])]
    if acceptance:
        out += ["", "## Speculative decoding", "", markdown_table(acceptance)]
    out += ["", "## Curves", "", f"![loss and acceptance]({PLOT})", ""]
    (d / "README.md").write_text("\n".join(out))
    return d / "README.md"


def _vocab_fact(meta: dict) -> str | None:
    n = meta["head"].get("draft_vocab_size")
    if not n:
        return None
    cov = meta.get("draft_vocab_coverage")
    return (f"{n} of {meta['head']['vocab_size']} target tokens, the head's own output layer"
            + (f"; covers {cov:.3f} of the held-out answers' tokens" if cov is not None else ""))
