"""Helpers for head tests: a word corpus for the tiny word-level targets, heads trained on them in seconds,
and random (untrained, so miscalibrated) heads."""
from __future__ import annotations

import json
import random


def write_word_corpus(path, vocab: int, n_docs: int = 40, words: int = 60, seed: int = 0) -> str:
    """A .jsonl corpus of texts 't3 t7 ...' for the tiny word-level targets of tests/conftest.py."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n_docs):
            f.write(json.dumps({"text": " ".join(f"t{rng.randrange(vocab)}" for _ in range(words))}) + "\n")
    return str(path)


def train_tiny_eagle(target_dir: str, corpus: str, out_dir, steps: int = 40, **kw):
    from leaplm.training.eagle import EagleTrainConfig, train_eagle

    opts = dict(batch_size=4, prompt_tokens=8, new_tokens=24, lr=1e-2, warmup_steps=2, save_every=10,
                eval_every=10, temperatures=(0.0, 1.0))
    opts.update(kw)
    cfg = EagleTrainConfig(target_dir=target_dir, out_dir=str(out_dir), corpus=corpus, steps=steps, **opts)
    logs = []
    train_eagle(cfg, logs.append)
    return logs


def random_head(target, out_dir, seed: int = 1, draft_vocab: int | None = None) -> str:
    """An untrained head; with draft_vocab, over that many target ids drawn at random (a random output layer)."""
    import torch

    from leaplm.heads.checkpoint import identity_of, save_head
    from leaplm.heads.eagle_net import EagleConfig, EagleNet
    from leaplm.heads.vocab import maps_of

    torch.manual_seed(seed)
    a = target.model.args
    net = EagleNet(EagleConfig.for_target(a, draft_vocab_size=draft_vocab))
    if draft_vocab is not None:
        net.d2t, net.t2d = maps_of(torch.randperm(a.vocab_size)[:draft_vocab].sort().values, a.vocab_size)
    save_head(out_dir, "eagle", net.config.to_dict(), identity_of(target), net.state_dict())
    return str(out_dir)


def chat_target(target_dir: str, out_dir) -> str:
    """A copy of a tiny word-level target with a chat template (user turn 't1 ... t2', assistant opened 't3')."""
    import json
    import shutil

    shutil.copytree(target_dir, out_dir)
    p = out_dir / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["chat_template"] = ("{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}"
                            "{% if add_generation_prompt %}t3{% endif %}")
    p.write_text(json.dumps(cfg))
    return str(out_dir)


def write_chat_prompts(path, vocab: int, n: int = 30, seed: int = 0) -> str:
    """A .jsonl of user messages 't5 t2 ...' of 2 to 8 words (so chat prompts differ in length)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = " ".join(f"t{rng.randrange(vocab)}" for _ in range(rng.randrange(2, 9)))
            f.write(json.dumps({"prompt": words}) + "\n")
    return str(path)
