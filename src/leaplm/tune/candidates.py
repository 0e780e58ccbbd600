"""What `leaplm tune` can measure on a target: every draft that shares its tokenizer, and the draft-free methods,
each over a small K grid. A draft that cannot run with the target is skipped with a one-line reason."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ConfigError
from ..models import LoadedModel

DRAFT_FREE = ("ngram", "suffix", "layerskip", "lookahead")
HEADS = ("eagle", "medusa")           # tried with the head shipped for this very target, skipped otherwise
DEFAULT_K_GRID = (2, 4, 6)
# Per method, the Ks tried (the first is the method's screening K: measured first when the budget is short).
K_GRIDS = {"draft": (4, 2, 6), "ngram": (4, 8), "suffix": (8, 4), "layerskip": (3, 2), "lookahead": (5,),
           "eagle": (4, 8), "medusa": (4,)}


@dataclass(frozen=True)
class Candidate:
    method: str                       # "none" or a SpecConfig method
    k: int = 0                        # 0 for none
    draft: str | None = None          # draft name (method draft)
    draft_label: str | None = None    # short name for tables

    @property
    def label(self) -> str:
        if self.method == "none":
            return "none"
        who = f"draft {self.draft_label}" if self.method == "draft" else self.method
        return f"{who} k={self.k}"

    @property
    def family(self) -> str:
        """The method (and draft): what 'pick the draft' compares; K is what 'tune K' varies."""
        return "none" if self.method == "none" else (
            f"draft {self.draft_label}" if self.method == "draft" else self.method)


@dataclass
class CandidateSet:
    baseline: Candidate
    ordered: list[Candidate]                              # screening Ks of every family first, then the rest
    skipped: list[str] = field(default_factory=list)     # one line per draft or method that cannot run


def draft_fits(target: LoadedModel, draft: LoadedModel) -> str | None:
    """None when draft can propose for target, else the one-line reason why not."""
    from ..engine.engine import check_vocab

    try:
        check_vocab(target, draft)
    except ConfigError as e:
        return e.message
    return None


def build_candidates(target: LoadedModel, drafts: dict[str, LoadedModel | str], methods: list[str],
                     k_grid: list[int] | None = None) -> CandidateSet:
    """drafts: label -> loaded draft, or a string saying why it could not be loaded."""
    skipped: list[str] = []
    families: list[list[Candidate]] = []
    for m in methods:
        if m == "draft":
            for label, d in drafts.items():
                if isinstance(d, str):
                    skipped.append(f"draft {label}: {d}")
                    continue
                why = draft_fits(target, d)
                if why:
                    skipped.append(f"draft {label}: {why}")
                    continue
                ks = k_grid or K_GRIDS["draft"]
                families.append([Candidate("draft", k, d.name, label) for k in ks])
            if not drafts:
                skipped.append("draft: no draft given and none shipped for this target")
        elif m in HEADS:
            from ..heads.loader import default_head_dir

            if default_head_dir(target, m) is None:
                skipped.append(f"{m}: no {m} head ships for this target (train one: leaplm train {m})")
            else:
                families.append([Candidate(m, k) for k in (k_grid or K_GRIDS[m])])
        elif m == "layerskip" and target.config.get("num_hidden_layers", 0) < 2:
            skipped.append("layerskip: the target has fewer than 2 layers to skip")
        else:
            families.append([Candidate(m, k) for k in (k_grid or K_GRIDS[m])])
    ordered = [f[0] for f in families] + [c for f in families for c in f[1:]]
    return CandidateSet(Candidate("none"), ordered, skipped)
