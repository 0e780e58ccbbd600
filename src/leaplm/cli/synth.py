"""`leaplm models synth SHAPE`: a random-weight GGUF file of a published model's shape, for benchmarks only
(models/synth.py; the shapes: models/synth_shapes.py)."""
from __future__ import annotations

from typing import Optional

import typer

from .common import err, fail, out


def synth(
    shape: str = typer.Argument(..., help="A published shape: Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B, "
                                          "Qwen2.5-7B, Gemma-3-1B."),
    fmt: str = typer.Option("Q4_0", "--format", help="Q4_0 | Q8_0 (every matrix in that type) | Q4_K_M "
                                                     "(llama.cpp's mix)."),
    output: str = typer.Option(..., "--out", help="The .gguf file to write."),
    tokenizer_from: Optional[str] = typer.Option(None, "--tokenizer-from", help="A GGUF file whose tokenizer.* "
                                                 "fields are borrowed (default: the smollm2 catalog model's)."),
    vocab: str = typer.Option("real", "--vocab", help="real: the shape's vocabulary (the tokenizer padded with "
                              "unused tokens) | tokenizer: the borrowed tokenizer's size."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Write random weights in the shape of a published model as GGUF, block by block (random quants, fp16
    scales; memory bounded by a chunk of blocks). Its text is noise: `leaplm generate` refuses such files unless
    --allow-synthetic is passed; `leaplm bench` times them."""
    from ..config import ConfigError
    from ..models import catalog
    from ..models.synth import FORMATS, write_synthetic_gguf
    from ..models.synth_shapes import shape_named

    if fmt.upper() not in FORMATS:
        fail(f"--format: unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    try:
        s = shape_named(shape)
        tok = tokenizer_from or str(catalog.resolve_model_name("smollm2", "tokenizer_from"))
        with err.status(f"writing {s.name} {fmt.upper()} to {output}"):
            r = write_synthetic_gguf(s, fmt.upper(), output, tok, vocab=vocab, seed=seed)
    except ConfigError as e:
        fail(f"--{e.field.replace('_', '-')}: {e.message}" if e.field != "shape" else f"SHAPE: {e.message}")
    types = ", ".join(f"{n} {k}" for k, n in sorted(r.tensor_types.items()))
    out.print(soft_wrap=True, *[f"wrote {r.path} ({r.n_bytes / 1e6:.1f} MB; {r.shape} {r.format}: {types}; "
              f"vocabulary {r.vocab}, tokenizer {r.tokenizer_tokens} tokens from {tok}); random weights, "
              "for benchmarks only"])
