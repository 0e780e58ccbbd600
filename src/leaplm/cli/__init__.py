"""leaplm's command line (the only package that imports typer): one module per command group.

generate.py        leaplm generate
serve.py           leaplm serve (and python -m leaplm.server)
bench.py           leaplm bench, bench memory; bench_serve.py, bench_roofline.py and bench_llamacpp.py: bench serve,
                   bench --roofline, bench --baselines llamacpp
tune.py            leaplm tune
train.py           leaplm train tokenizer|pretrain|distill|ondata|card; heads.py: train eagle|medusa|export-head|
                   ship-head; train_chat.py: train chatdata|distill-chat
evaluate.py        leaplm eval perplexity|acceptance
models.py          leaplm models, models fetch, models export-gguf
aliases.py         the spellings vLLM and llama.cpp users type, mapped onto leaplm's options
common.py          consoles, errors, progress bars, torch threads
"""
from __future__ import annotations

import typer

# heads and train_chat add their commands to train's group when imported
from . import bench, bench_serve, evaluate, generate, heads, models, serve, train, train_chat, tune  # noqa: F401

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Lossless speculative decoding for Hugging Face causal LMs.")
app.command("generate")(generate.generate)
app.command("serve")(serve.serve)
bench.bench_app.command("serve")(bench_serve.bench_serve)
app.add_typer(bench.bench_app, name="bench")
app.command("tune")(tune.tune)
app.add_typer(models.models_app, name="models")
app.add_typer(train.train_app, name="train", help="Train the tokenizer, pretrain and distill models.")
app.add_typer(evaluate.eval_app, name="eval", help="Evaluate perplexity and draft acceptance.")
