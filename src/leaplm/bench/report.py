"""Pictures of benchmark results (matplotlib, Agg backend: no display needed) and their markdown tables
(`leaplm bench report`: results_markdown)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


def plot_speedups(summaries, path: Path) -> None:
    """Grouped bars: speedup over `none` per configuration, one group per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(s.workload for s in summaries))
    configs = list(dict.fromkeys(s.config for s in summaries))
    by = {(s.workload, s.config): s.speedup or 0.0 for s in summaries}
    width = 0.8 / max(1, len(configs))
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(workloads) * max(1, len(configs)) / 3, 3.6))
    for i, c in enumerate(configs):
        xs = [wi + i * width for wi in range(len(workloads))]
        ax.bar(xs, [by.get((w, c), 0.0) for w in workloads], width, label=c)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([wi + width * (len(configs) - 1) / 2 for wi in range(len(workloads))], workloads)
    ax.set_ylabel("tokens/s relative to none")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass
class KSweepRow:
    workload: str
    method: str
    adaptive: float          # speedup of adaptive K vs none
    best_k: int              # the fixed K with the highest speedup
    best: float              # its speedup (1.0 when every fixed K is slower than none: K = 0 is the best)


def k_sweep_rows(summaries) -> list[KSweepRow]:
    """From `bench --k-sweep` summaries ("<method> adaptive", "<method> k=<K> fixed"): adaptive vs the best fixed
    K in 0..k_max per workload and method (K = 0, plain decoding, counts as a fixed K of speedup 1)."""
    by: dict[tuple[str, str], dict] = {}
    for s in summaries:
        parts = s.config.split()
        if len(parts) == 2 and parts[1] == "adaptive":
            by.setdefault((s.workload, parts[0]), {})["adaptive"] = s.speedup
        elif len(parts) == 3 and parts[2] == "fixed" and parts[1].startswith("k="):
            by.setdefault((s.workload, parts[0]), {}).setdefault("fixed", {})[int(parts[1][2:])] = s.speedup
    rows = []
    for (w, m), d in by.items():
        if d.get("adaptive") is None or not d.get("fixed"):
            continue
        best_k, best = max(d["fixed"].items(), key=lambda kv: kv[1])
        if best < 1.0:
            best_k, best = 0, 1.0
        rows.append(KSweepRow(w, m, d["adaptive"], best_k, best))
    return rows


def plot_serve_speedup(report: dict, path: Path) -> None:
    """`leaplm bench serve`: speedup (speculation on / off, tokens/s) against client concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["summary"] if r["speculative"] and r["speedup_vs_none"]]
    xs = sorted({r["concurrency"] for r in rows})
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
    backends = list(dict.fromkeys(r.get("backend", "") for r in rows))     # one line per server's backend
    for b in backends:
        mine = [r for r in rows if r.get("backend", "") == b]
        label = "speculation on / off" + (f", {b}" if len(backends) > 1 else "")
        ax.plot([r["concurrency"] for r in mine], [r["speedup_vs_none"] for r in mine], marker="o", label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent streaming requests")
    ax.set_ylabel("tokens/s speedup")
    m = report["models"]
    ax.set_title(f"{m['target']} + {m['draft']} ({m['method']}, K<={m['k']})", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_block_costs(rep, path: Path) -> None:
    """`leaplm bench --roofline --plot`: per weight type, each kernel's whole-forward cost over T tokens (x one
    token), and each speculating method's mean accepted length drawn at T = K + 1 on the file's own type: a method
    above a curve yields more tokens per verify forward than that forward costs on that kernel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .roofline import single_row_forward

    whole = [c for c in rep.curves if single_row_forward(c.kernel)] or list(rep.curves)
    types = list(dict.fromkeys(c.weight_type for c in whole)) or [rep.weight_type or "model"]
    fig, axes = plt.subplots(1, len(types), figsize=(4.2 * len(types), 3.6), squeeze=False, sharey=True)
    for ax, wt in zip(axes[0], types):
        for c in (c for c in whole if c.weight_type == wt):
            ax.plot(c.tokens, c.vs_one, marker=".", label=c.kernel)
            if c.compute_floor_ms and c.ms:       # the machine's floor for this forward, in its one-token units
                floor = [max(c.bandwidth_floor_ms, f) / c.ms[0] for f in c.compute_floor_ms]
                ax.plot(c.tokens, floor, linestyle="--", linewidth=0.8, color="gray",
                        label=f"floor of {c.kernel}: max(bytes / bandwidth, MACs x T / int8 rate)")
        if wt == rep.weight_type or len(types) == 1:
            for i, m in enumerate(m for m in rep.methods if m.k > 0):
                ax.scatter([m.k + 1], [m.mean_accepted_length], marker="*", s=90, zorder=3, color=f"C{5 + i}",
                           label=f"{m.config}: mean acc. len{' (adaptive K)' if m.adaptive_k else ''}")
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_title(f"{wt}{' (the file)' if wt == rep.weight_type else ''}", fontsize=9)
        ax.set_xlabel("tokens in the verify block (T)")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("forward cost (x one token) / tokens per forward")
    fig.suptitle(f"{Path(rep.model).name}, {rep.threads} thread{'s' if rep.threads != 1 else ''}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- markdown tables of result files (`leaplm bench report`) -----------------------------------------------------
# Which rows a result file's kind tabulates, and the columns shown: (heading, key).
BENCH_COLUMNS = [("workload", "workload"), ("config", "config"), ("tokens/s", "tokens_per_s"),
                 ("speedup", "speedup"), ("acceptance", "acceptance_rate"), ("tau", "mean_accepted_length"),
                 ("identical", "identical")]
SERVE_COLUMNS = [("concurrency", "concurrency"), ("backend", "backend"), ("speculative", "speculative"),
                 ("tokens/s", "tokens_per_s"), ("TTFT p50 s", "ttft_p50_s"), ("ITL p50 s", "itl_p50_s"),
                 ("ITL p99 s", "itl_p99_s"), ("acceptance", "acceptance_rate"), ("speedup", "speedup_vs_none"),
                 ("errors", "errors")]
METHOD_COLUMNS = [("config", "config"), ("ms/token", "ms_per_token"), ("propose ms", "propose_ms"),
                  ("score ms", "score_ms"), ("tau", "mean_accepted_length"), ("x floor", "vs_floor")]
# Free-text fields shown above a file's tables; a file's provenance (commit ids) is left to git.
META_KEYS = ("what", "command", "model", "date", "machine", "machine_description", "software", "result", "note")
SKIPPED_KEYS = {"samples", "commit", "code", "records"}
MAX_ROWS, MAX_COLUMNS, MAX_CELL = 40, 10, 90


def result_kind(data) -> str:
    """The kind of a result file, from its shape: bench (`leaplm bench --json`), roofline (`bench --roofline`),
    serve (`bench serve`), memory (`bench memory`), llama-bench (llama.cpp's JSON), table or other."""
    if isinstance(data, list):
        return "llama-bench" if data and isinstance(data[0], dict) and "avg_ts" in data[0] else "other"
    if "summaries" in data:
        return "bench"
    if "forwards" in data:
        return "roofline"
    if isinstance(data.get("summary"), list):
        return "serve"
    if isinstance(data.get("figures"), list):
        return "memory"
    if isinstance(data.get("table"), list):
        return "table"
    return "other"


def cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"
    if isinstance(v, (list, dict)):
        v = json.dumps(v)
    s = str(v).replace("\n", " ").replace("|", "\\|")
    return s if len(s) <= MAX_CELL else s[: MAX_CELL - 3] + "..."


def scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def md_table(rows: list[dict], columns: list[tuple[str, str]] | None = None) -> list[str]:
    """A markdown table of dict rows: the given (heading, key) columns, or every scalar key that some row fills
    (rows past MAX_ROWS and columns past MAX_COLUMNS are counted, not shown; a wide table of a few rows is
    printed transposed)."""
    if not rows:
        return []
    if columns is None:
        keys = list(dict.fromkeys(k for r in rows for k, v in r.items()
                                  if k not in SKIPPED_KEYS and scalar(v) and v is not None))
        if len(keys) > MAX_COLUMNS and len(rows) <= 4:
            return md_table([{"field": k, **{f"row {i + 1}": r.get(k) for i, r in enumerate(rows)}} for k in keys])
        columns = [(k, k) for k in keys]
    columns = [c for c in columns if any(r.get(c[1]) is not None for r in rows)]
    if not columns:
        return []
    shown, hidden = columns[:MAX_COLUMNS], len(columns) - MAX_COLUMNS
    out = ["| " + " | ".join(h for h, _ in shown) + " |", "|" + "---|" * len(shown)]
    out += ["| " + " | ".join(cell(r.get(k)) for _, k in shown) + " |" for r in rows[:MAX_ROWS]]
    notes = ([f"{len(rows) - MAX_ROWS} more rows"] if len(rows) > MAX_ROWS else []) + \
        ([f"{hidden} more columns"] if hidden > 0 else [])
    return out + ([f"\n({', '.join(notes)} in the file.)"] if notes else [])


def named_rows(d: dict) -> list[dict]:
    """{'name': {fields}} -> [{'name': name, fields...}] (the scalar fields)."""
    return [{"name": k, **{f: x for f, x in v.items() if scalar(x)}} for k, v in d.items() if isinstance(v, dict)]


def file_tables(data, kind: str) -> list[list[str]]:
    """The tables a result file renders to, by kind; any other file's lists and maps of records, generically."""
    if kind == "bench":
        s = data.get("settings", {})
        m = data.get("machine", {})
        line = ", ".join(f"{k} {cell(v)}" for k, v in (
            ("model", Path(str(s.get("model", ""))).name), ("draft", Path(str(s.get("draft") or "")).name),
            ("backend", s.get("backend")), ("K", s.get("k")), ("temperature", s.get("temperature")),
            ("threads", m.get("torch_threads")), ("cores", m.get("cores"))) if v not in (None, ""))
        return [[line, ""] + md_table(data["summaries"], BENCH_COLUMNS)]
    if kind == "roofline":
        head = (f"model {Path(str(data.get('model', ''))).name}, {data.get('threads')} threads, "
                f"{cell(data.get('bandwidth_GBps'))} GB/s measured, floor {cell(data.get('floor_ms'))} ms/token")
        out = [[head, ""] + md_table(data["forwards"], [("tokens", "tokens"), ("ms", "ms"), ("x one token", "vs_one")])]
        out.append(md_table(data.get("methods", []), METHOD_COLUMNS))
        curves = [{"kernel": c.get("kernel"), "weight type": c.get("weight_type"),
                   **{f"x1 at T={t}": v for t, v in zip(c.get("tokens", []), c.get("vs_one", [])) if t in (2, 4, 8, 16)},
                   "1-token ms": (c.get("ms") or [None])[0]} for c in data.get("curves") or []]
        out.append(md_table(curves))
        if isinstance(data.get("one_token_vs_llamacpp"), dict):
            out.append(md_table([data["one_token_vs_llamacpp"]], [("leaplm ms", "leaplm_ms"),
                                                                  ("llama-bench ms", "llama_ms"), ("ratio", "ratio")]))
        return out
    if kind == "serve":
        s, m = data.get("settings") or {}, data.get("machine") if isinstance(data.get("machine"), dict) else {}
        line = ", ".join(f"{k} {cell(v)}" for k, v in (
            ("model", Path(str(s.get("model") or "")).name), ("method", s.get("method")), ("K", s.get("k")),
            ("max tokens", s.get("max_tokens")), ("rounds", s.get("rounds")), ("threads", s.get("threads")),
            ("cpus", m.get("cpus"))) if v not in (None, ""))
        return [([line, ""] if line else []) + md_table(data["summary"], SERVE_COLUMNS)] + (
            [md_table([{"long prompt": k, **v} if isinstance(v, dict) else {"long prompt": k, "value": v}
                       for k, v in data["long_prompt"].items()])] if isinstance(data.get("long_prompt"), dict) else [])
    if kind == "memory":
        return [md_table([{"command": f.get("command"), "peak RSS MB": f.get("peak_rss_bytes", 0) / 1e6,
                           "KV cache peak MB": (f.get("kv_cache_peak_bytes") or 0) / 1e6,
                           "weights MB": f.get("weights_bytes", 0) / 1e6} for f in data["figures"]])]
    if kind == "llama-bench":
        return [md_table(data, [("model", "model_type"), ("threads", "n_threads"), ("prompt", "n_prompt"),
                                ("gen", "n_gen"), ("tokens/s", "avg_ts"), ("stddev", "stddev_ts"),
                                ("time", "test_time")])]
    if kind == "table":
        return [md_table(data["table"])]
    out = []
    for key, v in data.items() if isinstance(data, dict) else []:
        if key in SKIPPED_KEYS or key in META_KEYS:
            continue
        if isinstance(v, dict) and v and all(isinstance(x, dict) and result_kind(x) != "other" for x in v.values()):
            for name, x in v.items():       # a map of whole results (one `bench serve` report per run)
                out += [[f"`{key}` / {cell(name)}:", ""] + t for t in file_tables(x, result_kind(x)) if t]
            continue
        rows = [r for r in v if isinstance(r, dict)] if isinstance(v, list) else \
            named_rows(v) if isinstance(v, dict) and any(isinstance(x, dict) for x in v.values()) else \
            [v] if isinstance(v, dict) else []
        table = md_table(rows)
        if table:
            out.append([f"`{key}`:", ""] + table)
    scalars = {k: v for k, v in data.items() if k not in META_KEYS and k not in SKIPPED_KEYS and scalar(v)} \
        if isinstance(data, dict) else {}
    return out + ([md_table([scalars])] if scalars else [])


def file_meta(data) -> list[str]:
    """'- **machine**: ...' lines of a file's free-text provenance (a `bench` file's machine dict is summarised
    in its table's heading line)."""
    if not isinstance(data, dict):
        return []
    lines = []
    for k in META_KEYS:
        v = data.get(k)
        if isinstance(v, str) and v:
            text = v.replace("\n", " ") if len(v) <= 400 else v[:397].replace("\n", " ") + "..."
            lines.append(f"- **{k.replace('_', ' ')}**: {text}")
    return lines


def results_markdown(directory: Path, command: str = "leaplm bench report") -> str:
    """docs/results/README.md: an index of the result files, then each file's tables (rows by kind, see
    file_tables), in file-name order. Deterministic: the same files render to the same text."""
    files = sorted(Path(directory).glob("*.json"))
    loaded = []
    for f in files:
        try:
            loaded.append((f, json.loads(f.read_text())))
        except (OSError, ValueError) as e:
            raise ValueError(f"{f.name}: not a JSON result file ({e})") from e
    out = ["# Benchmark results", "",
           f"Generated by `{command}` from the JSON files in this folder; do not edit by hand. Each file is what",
           "the command in its section (or in the page that cites it) wrote; the pages in docs/ quote these figures.",
           "", "| file | kind | tables |", "|---|---|---|"]
    sections = []
    for f, data in loaded:
        kind = result_kind(data)
        tables = [t for t in file_tables(data, kind) if t]
        pics = f.with_suffix(".png")
        out.append(f"| [{f.name}](#{slug(f.name)}) | {kind} | {len(tables)} |")
        sections += ["", f"## {f.name}", "", f"Kind: {kind}. File: [{f.name}]({f.name})"
                     + (f", picture: [{pics.name}]({pics.name})" if pics.exists() else "") + "."]
        meta = file_meta(data)
        if meta:
            sections += [""] + meta
        for t in tables:
            sections += [""] + t
    return "\n".join(out + sections) + "\n"


def slug(heading: str) -> str:
    """A markdown heading's anchor as GitHub writes it: lower case, punctuation but '-' and '_' dropped."""
    import re

    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
