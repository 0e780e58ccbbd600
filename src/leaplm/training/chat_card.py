"""Ship a chat draft (training/chat_distill.py) into the package: the files the engine loads, a loss curve and
a model card with the recipe's commands, the run's figures and the measured acceptance."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from .modelcard import markdown_table, plot_loss_curve, read_train_record

SHIPPED = ("config.json", "generation_config.json", "model.safetensors", "draft_vocab.safetensors",
           "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def ship_chat_draft(run_dir: str | Path, dest: str | Path, name: str, commands: list[str],
                    acceptance: list[dict] | None = None, notes: list[str] | None = None) -> Path:
    run, dest = Path(run_dir), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in SHIPPED:
        if (run / f).exists():
            shutil.copy2(run / f, dest / f)
    rec = read_train_record(run)
    plot_loss_curve(rec, dest / "loss_curve.png")
    c, last = rec.config, rec.steps[-1]
    cfg = json.loads((dest / "config.json").read_text())
    mb = sum(p.stat().st_size for p in dest.iterdir() if p.is_file()) / 1e6
    facts = [
        ("target", f"{cfg['leaplm_draft']['target']} (matched by tokenizer sha256 "
                   f"{cfg['leaplm_draft']['tokenizer_sha256'][:12]}...)"),
        ("shape", c["shape"] + (f" (the target's first {cfg['num_hidden_layers']} layer(s), final norm and "
                                "embedding rows, then distilled)" if c["shape"].startswith("cut-") else "")),
        ("distillation loss", f"{c.get('alpha', 0.9)} x {c.get('loss', 'kl')} at T = "
                              f"{', '.join(f'{t:g}' for t in c.get('temperatures', ()))} + "
                              f"{1 - c.get('alpha', 0.9):g} x CE"),
        ("architecture", f"Llama, {cfg['num_hidden_layers']} layer(s) x {cfg['hidden_size']}, "
                         f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} kv, MLP "
                         f"{cfg['intermediate_size']}, tied embedding; fp16 on disk"),
        ("vocabulary", f"{cfg['vocab_size']} rows of the target's {cfg['leaplm_draft']['target_vocab_size']} "
                       "(row 0 = any other token, never proposed)"),
        ("parameters", f"{c['n_params']:,}"),
        ("disk", f"{mb:.1f} MB"),
        ("answers trained on (target's own, with top-k log-probs)", f"{c['train_tokens_available']:,} tokens"),
        ("text CE weight / corpus", f"{c['text_weight']} / {c['text_corpus']} (first {c['text_max_files']} files)"),
        ("steps", f"{last['step']} of {last['steps']}"),
        ("tokens seen", f"{last['tokens_seen']:,}"),
        ("wall time", f"{last['elapsed_s'] / 60:.1f} min"),
        ("final train loss (mean of last 20 steps)", f"{rec.final_train('loss'):.3f}"),
    ]
    out = [f"# {name}", "", f"A reduced-vocabulary draft for {cfg['leaplm_draft']['target']}, trained by leaplm "
           "on the target's own chat answers (`leaplm train draft`: `train chatdata` then `train distill-chat`). "
           "`--method draft` picks it for any target whose tokenizer has the fingerprint in the table below.", "",
           "## Recipe", "", "```bash", *commands, "```", "",
           "## Training", "", markdown_table([{"": k, "value": v} for k, v in facts])]
    if acceptance:
        out += ["", "## Acceptance", "", markdown_table(acceptance)]
    if notes:
        out += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    out += ["", "## Loss curve", "", "![loss curve](loss_curve.png)", ""]
    (dest / "README.md").write_text("\n".join(out))
    return dest
