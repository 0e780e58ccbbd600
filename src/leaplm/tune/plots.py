"""tune's pictures (matplotlib, Agg backend): speedup against K per method and level, acceptance by position."""
from __future__ import annotations

from pathlib import Path


def plot_tune(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["method"] != "none"]
    fam = lambda r: r["method"] if r["method"] != "draft" else f"draft {r['draft']}"  # noqa: E731
    levels = sorted({r["concurrency"] for r in rows})
    paths = []
    fig, axes = plt.subplots(1, max(1, len(levels)), figsize=(4.2 * max(1, len(levels)), 3.4), squeeze=False)
    for ax, lv in zip(axes[0], levels):
        for name in dict.fromkeys(fam(r) for r in rows):
            pts = sorted((r["k"], r["speedup"]) for r in rows if fam(r) == name and r["concurrency"] == lv
                         and r["speedup"] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"concurrency {lv}")
        ax.set_xlabel("K")
        ax.set_ylabel("speedup vs none")
        ax.legend(fontsize=7)
    fig.tight_layout()
    p = out_dir / "tune_speedup_vs_k.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for r in rows:
        if r["concurrency"] == levels[0] and r["acceptance_by_position"]:
            ax.plot(range(len(r["acceptance_by_position"])), r["acceptance_by_position"], marker=".", label=r["config"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    ax.set_title(f"acceptance by position, concurrency {levels[0] if levels else 1}")
    ax.legend(fontsize=6)
    fig.tight_layout()
    p = out_dir / "tune_acceptance_by_position.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
