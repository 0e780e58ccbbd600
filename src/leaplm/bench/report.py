"""Pictures of benchmark results (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

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
