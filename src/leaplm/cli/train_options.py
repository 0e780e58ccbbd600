"""The training commands' shared options, declared once: the training loop's (learning rate, schedule, clipping,
seed, checkpoints, evaluation; every trainer), a corpus run's (pretrain, distill) and a head run's (eagle,
medusa). A command takes a group with @group.options(ConfigClass, into="name"): its command line gets the group's
options, each with the default the config dataclass declares, and their values arrive in one argument, a dict
named `into` whose keys are the config's field names."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import typer


def check_corpus(value: str) -> str:
    if value != "stdlib" and not Path(value).exists():
        raise typer.BadParameter(f"{value!r} is neither 'stdlib' nor an existing directory or file")
    return value


@dataclass(frozen=True)
class Opt:
    annotation: Any
    help: str
    kw: dict = dataclasses.field(default_factory=dict)      # typer.Option's other arguments (min, callback, ...)


@dataclass(frozen=True)
class OptionGroup:
    opts: dict[str, Opt]

    def options(self, config_cls: type, into: str) -> Callable:
        """Decorate a command that takes `into: dict`: add the group's options (defaults from config_cls)."""
        defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
        missing = set(self.opts) - set(defaults)
        if missing:
            raise ValueError(f"{config_cls.__name__} has no field {sorted(missing)}")
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=o.annotation,
                                   default=typer.Option(defaults[name], help=o.help, **o.kw))
                 for name, o in self.opts.items()]

        def wrap(fn: Callable) -> Callable:
            sig = inspect.signature(fn, eval_str=True)
            if into not in sig.parameters:
                raise TypeError(f"{fn.__name__}: takes no `{into}` argument for its shared options")
            own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in sig.parameters.values() if p.name != into]
            clash = set(self.opts) & {p.name for p in own}
            if clash:
                raise TypeError(f"{fn.__name__}: declares {sorted(clash)}, which the shared group declares")

            @functools.wraps(fn)
            def command(*args, **kwargs):
                return fn(*args, **{into: {name: kwargs.pop(name) for name in self.opts}}, **kwargs)

            params = own + added
            command.__signature__ = sig.replace(parameters=params)
            command.__annotations__ = {p.name: p.annotation for p in params if p.annotation is not p.empty}
            return command

        return wrap


# The training loop's options (training/loop.py), taken by every trainer.
LOOP = OptionGroup({
    "lr": Opt(float, "Peak learning rate.", dict(min=0.0)),
    "min_lr": Opt(float, "Final learning rate of the cosine decay.", dict(min=0.0)),
    "warmup_steps": Opt(int, "Linear warm-up steps.", dict(min=1)),
    "weight_decay": Opt(float, "AdamW weight decay.", dict(min=0.0)),
    "grad_clip": Opt(float, "Gradient-norm clip.", dict(min=0.0)),
    "seed": Opt(int, "Random seed."),
    "save_every": Opt(int, "Steps between resumable checkpoints.", dict(min=1)),
    "eval_every": Opt(int, "Steps between held-out evaluations (when the run has held-out data).", dict(min=1)),
})

# A run over a text corpus (pretrain, distill).
CORPUS_RUN = OptionGroup({
    "corpus": Opt(str, "'stdlib', a directory of .py files, or a .jsonl file.", dict(callback=check_corpus)),
    "tokens": Opt(int, "Training budget in tokens.", dict(min=1)),
    "batch_size": Opt(int, "Sequences per step.", dict(min=1)),
    "seq_len": Opt(int, "Tokens per sequence.", dict(min=2)),
    "long_seq_len": Opt(int, "Sequence length of the final long-context phase.", dict(min=2)),
    "long_fraction": Opt(float, "Fraction of steps in the long-context phase.", dict(min=0.0, max=0.99)),
    "eval_batches": Opt(int, "Batches per held-out evaluation.", dict(min=1)),
    "max_files": Opt(Optional[int], "Use only the first N files of each split (tests).", dict(min=1)),
    "bf16": Opt(bool, "bf16 autocast (fp32 master weights; a distillation's target runs in bf16)."),
})

# A head trained on the frozen target's own text (eagle, medusa); temperatures arrive as the typed string.
HEAD_RUN = OptionGroup({
    "corpus": Opt(str, "Prompts: 'stdlib', a directory of .py files, or a .jsonl file.", dict(callback=check_corpus)),
    "steps": Opt(int, "Optimizer steps.", dict(min=1)),
    "batch_size": Opt(int, "Sequences per step.", dict(min=1)),
    "prompt_tokens": Opt(int, "Corpus tokens per prompt.", dict(min=1)),
    "new_tokens": Opt(int, "Tokens the target generates per prompt.", dict(min=1)),
    "corpus_fraction": Opt(float, "Share of batches that are corpus windows (no generation).",
                           dict(min=0.0, max=1.0)),
    "reuse": Opt(int, "Optimizer steps per generated batch (others replay recent batches).", dict(min=1)),
    "max_minutes": Opt(Optional[float], "Stop (and save) after this wall time.", dict(min=0.0)),
    "max_files": Opt(Optional[int], "Use only the first N corpus files (tests).", dict(min=1)),
})
