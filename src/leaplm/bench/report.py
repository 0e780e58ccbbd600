"""Pictures of benchmark results (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

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
