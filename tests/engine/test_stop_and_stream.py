"""Where generation ends and what a stream shows: stop strings, EOS and stop tokens inside an accepted block,
max_new_tokens exact when a step accepts several tokens, streamed text that is always final (never half a
UTF-8 character, never part of a stop string), and logprobs that do not depend on speculation."""
from __future__ import annotations

import json
import random
import shutil
import sys

import pytest
import torch

from leaplm.config import SamplingParams
from leaplm.engine.detok import IncrementalDetokenizer
from leaplm.engine.engine import Engine
from leaplm.models import load_model

PROMPT = "the quick brown fox"
NEW = 40


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **{"max_new_tokens": NEW, "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def target(loaded):
    return loaded("llama_tied")


@pytest.fixture(scope="module")
def plain(target):
    """Plain greedy decoding of PROMPT: the reference every speculative run below is cut from."""
    return Engine(target, method="none").generate(PROMPT, greedy())


@pytest.fixture(scope="module")
def spec(target):
    """Draft = target with K = 8: nearly every step accepts a long block, so cuts fall inside blocks."""
    return Engine(target, draft=target, method="draft", k=8, adaptive_k=False)


@pytest.fixture
def record_verifications(monkeypatch):
    """Wrap the verifiers wherever the engine looks them up; returns the list of VerifyResults they produce."""
    results = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("leaplm.engine"):
            continue
        for fn in ("verify_greedy", "verify_rejection", "verify_coupled"):
            real = getattr(mod, fn, None)
            if real is not None:
                def wrapped(*a, _real=real, **kw):
                    res = _real(*a, **kw)
                    results.append(res)
                    return res
                monkeypatch.setattr(mod, fn, wrapped)
    return results


# --- IncrementalDetokenizer ------------------------------------------------------------------------------------
def feed(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    out, i = [], 0
    for n in sizes:
        out.append(detok.add(ids[i : i + n]))
        i += n
    out.append(detok.flush())
    return out


def test_multibyte_character_is_released_whole(byte_tokenizer):
    ids = byte_tokenizer("a 🙂", add_special_tokens=False)["input_ids"]
    assert byte_tokenizer.decode(ids[:-1]).endswith("\ufffd")           # the emoji spans tokens
    detok = IncrementalDetokenizer(byte_tokenizer)
    chunks = feed(detok, ids, [1] * len(ids))
    assert "".join(chunks) == "a 🙂"
    assert all("\ufffd" not in c for c in chunks)
    assert chunks[-2].endswith("🙂")                                      # released with its last byte


def test_stop_string_is_held_back_and_cut(byte_tokenizer):
    ids = byte_tokenizer("the quick brown fox jumps", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(byte_tokenizer, stop=["brown f", "zzz"])
    chunks = feed(detok, ids, [1] * len(ids))
    assert "".join(chunks) == "the quick "
    assert detok.stopped
    seen = ""
    for c in chunks:                                                      # never a prefix of "brown f" shown
        seen += c
        assert "the quick ".startswith(seen)


def test_partial_stop_string_is_released_when_it_does_not_complete(byte_tokenizer):
    ids = byte_tokenizer("the quick brown", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(byte_tokenizer, stop=["brownie"])
    text = "".join(detok.add([t]) for t in ids)
    assert text == "the quick " and not detok.stopped                    # "brown" could still become "brownie"
    assert detok.flush() == "brown"


def test_stop_string_inside_a_multibyte_run(byte_tokenizer):
    ids = byte_tokenizer("un café crème", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(byte_tokenizer, stop=["é c"])
    assert "".join(feed(detok, ids, [1] * len(ids))) == "un caf"


CHARS = list("abc xyz") + ["é", "ü", "東", "🙂", "\n"]


@pytest.fixture(scope="module")
def broken_byte_ids(byte_tokenizer) -> list[int]:
    """Token ids of bytes that are never valid UTF-8 on their own (lone continuation or start bytes)."""
    return [i for i in range(len(byte_tokenizer)) if byte_tokenizer.decode([i]) == "\ufffd"][:20]


@pytest.mark.parametrize("seed", range(30))
def test_random_texts_chunkings_and_stops(seed, byte_tokenizer, broken_byte_ids):
    """Any text, any split into steps, any stop strings: the concatenated stream is the decoded text up to the
    first stop string, and every prefix shown so far is a prefix of that, so nothing shown is ever taken back
    (a half character shown early would be a U+FFFD where the final text has the character). Every third
    seed mixes in bytes that are invalid UTF-8 for good, whose U+FFFD is final text."""
    rng = random.Random(seed)
    pieces = []
    for _ in range(rng.randint(3, 20)):
        if seed % 3 == 2 and rng.random() < 0.25:
            pieces.append([rng.choice(broken_byte_ids)])
        else:
            pieces.append(byte_tokenizer("".join(rng.choice(CHARS) for _ in range(rng.randint(1, 4))),
                                         add_special_tokens=False)["input_ids"])
    ids = [t for piece in pieces for t in piece]
    text = byte_tokenizer.decode(ids)
    assert ("\ufffd" in text) == (seed % 3 == 2 and any(len(p) == 1 and p[0] in broken_byte_ids for p in pieces))
    stops = []
    for _ in range(rng.randint(0, 3)):
        a = rng.randrange(len(text))
        stops.append(text[a : a + rng.randint(1, 4)] if rng.random() < 0.7 else "qq")
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    final = text[: min(hits)] if hits else text
    sizes, left = [], len(ids)
    while left:
        sizes.append(min(left, rng.randint(1, 4)))
        left -= sizes[-1]
    detok = IncrementalDetokenizer(byte_tokenizer, stop=stops)
    shown = ""
    for chunk in feed(detok, ids, sizes):
        shown += chunk
        assert final.startswith(shown), (text, stops, shown)
    assert shown == final
    assert detok.stopped == bool(hits)


# --- the engine: where generation ends ---------------------------------------------------------------------------
def first_clean_substring(text: str, start: int, n: int = 3) -> int:
    """The first index i >= start where text[i:i+n] occurs for the first time and holds no U+FFFD."""
    for i in range(start, len(text) - n):
        s = text[i : i + n]
        if "\ufffd" not in s and text.find(s) == i:
            return i
    raise AssertionError("no usable stop string in the reference text")


@pytest.mark.parametrize("method", ["none", "draft"])
def test_stop_string_cuts_the_text_in_generate_and_stream(method, target, plain, spec):
    i = first_clean_substring(plain.text, 8)
    stop = plain.text[i : i + 3]
    eng = spec if method == "draft" else Engine(target, method="none")
    out = eng.generate(PROMPT, greedy(stop=[stop]))
    assert out.text == plain.text[:i] and out.finish_reason == "stop"
    chunks = list(eng.stream(PROMPT, greedy(stop=[stop])))
    assert "".join(c.text for c in chunks) == plain.text[:i]
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert chunks[-1].stats is not None


@pytest.mark.parametrize("sampled", [False, True])
def test_stop_string_mid_block_keeps_plain_decodings_tokens_logprobs_and_usage(sampled, target, plain, spec,
                                                                             record_verifications):
    """Tokens accepted after the one that completed a stop string are not returned, not counted and not cached:
    token ids, logprobs and usage equal plain decoding's, through generate and through the scheduler."""
    from leaplm.engine.scheduler import BatchScheduler, SeqRequest

    extra = dict(temperature=0.7, seed=4) if sampled else {}
    base = SamplingParams(**{**greedy().__dict__, **extra})
    full = Engine(target, method="none").generate(PROMPT, base) if sampled else plain
    i = first_clean_substring(full.text, 8)
    params = SamplingParams(**{**base.__dict__, "stop": [full.text[i: i + 3]], "logprobs": 2})
    ref = Engine(target, method="none").generate(PROMPT, params)
    assert ref.finish_reason == "stop"
    record_verifications.clear()
    for out in (spec.generate(PROMPT, params), None):
        if out is None:                                   # the same request as a row of the server's batch
            sched = BatchScheduler(spec, max_batch=2, calibrate=False)
            got = []
            sched.submit([SeqRequest(list(ref.prompt_ids), params, got.append)])
            sched.run_until_idle()
            chunks = [o.chunk for o in got if o.chunk is not None]
            ids = [t for c in chunks for t in c.token_ids]
            lps = [lp for c in chunks for lp in (c.logprobs or [])]
            stats, text = chunks[-1].stats, "".join(c.text for c in chunks)
            assert sched.cached_tokens == 0
        else:
            ids, lps, stats, text = out.token_ids, out.logprobs, out.stats, out.text
        assert ids == ref.token_ids and text == ref.text
        assert stats.new_tokens == len(ref.token_ids) == ref.stats.new_tokens
        assert [lp.token_id for lp in lps] == [lp.token_id for lp in ref.logprobs]
        assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)
    # the stop string really completed inside a block with accepted tokens after it
    assert any(len(r.tokens) > 1 for r in record_verifications)
    assert sum(len(r.tokens) for r in record_verifications) > 2 * len(ref.token_ids)


def test_the_cache_keeps_only_the_tokens_kept_when_a_stop_string_fires(target, plain, spec):
    """After the cut, the row's cache holds the prompt and the kept tokens but the last: what plain decoding holds."""
    i = first_clean_substring(plain.text, 8)
    params = greedy(stop=[plain.text[i: i + 3]])
    from leaplm.engine.step import Batch

    batch = Batch(spec, 1)
    row, _ = batch.join(spec.encode(PROMPT, params), params)
    lengths = []
    while batch.rows:
        batch.step()
        lengths.append((batch.cache.lengths[0], len(row.req.tokens)))
    n_prompt = len(row.req.prompt_ids)
    assert row.req.finish_reason == "stop"
    assert len(row.req.output_ids) == len(Engine(target, method="none").generate(PROMPT, params).token_ids)
    # the last step's commit left the cache at tokens - 1 before the row was freed (freed rows read 0)
    assert all(c == t - 1 for c, t in lengths[:-1]) and lengths[-1] == (0, n_prompt + len(row.req.output_ids))


def test_stream_text_is_final_and_equals_generate(target, spec):
    """Random-model output is full of multi-byte fragments: each chunk is released only once final, so the
    chunks add up to the decoded tokens exactly (a half character shown early would read as U+FFFD here)."""
    for prompt in (PROMPT, "un café crème 🙂", "größer über 東京"):
        for params in (greedy(), SamplingParams(seed=3, max_new_tokens=NEW, ignore_eos=True)):
            chunks = list(spec.stream(prompt, params))
            ids = [t for c in chunks for t in c.token_ids]
            assert "".join(c.text for c in chunks) == target.tokenizer.decode(ids, skip_special_tokens=True)
            assert len(ids) == NEW


@pytest.mark.parametrize("how", ["stop_token_ids", "eos"])
def test_stop_token_inside_an_accepted_block(how, target, plain, spec, checkpoint, tmp_path, record_verifications):
    ref = plain.token_ids
    j = next(i for i in range(4, NEW) if ref[i] not in ref[:i])            # first occurrence, a few tokens in
    tok = ref[j]
    if how == "stop_token_ids":
        eng, params = spec, greedy(stop_token_ids=[tok])
    else:                                                                  # the checkpoint's own EOS is `tok`
        d = tmp_path / "eos"
        shutil.copytree(checkpoint("llama_tied"), d)
        for f in ("config.json", "generation_config.json"):
            cfg = json.loads((d / f).read_text())
            cfg["eos_token_id"] = tok
            (d / f).write_text(json.dumps(cfg))
        lm = load_model(str(d))
        assert lm.eos_token_ids == [tok]
        eng, params = Engine(lm, draft=lm, method="draft", k=8, adaptive_k=False), greedy(ignore_eos=False)
    out = eng.generate(PROMPT, params)
    assert out.token_ids == ref[:j] and out.finish_reason == "stop"
    assert out.stats.new_tokens == j
    # the stop token was an accepted draft with more tokens after it in the same step
    assert any(tok in r.tokens[: r.accepted] and r.tokens.index(tok) < len(r.tokens) - 1
               for r in record_verifications)
    if how == "eos":                                                       # ignore_eos generates past it
        assert eng.generate(PROMPT, greedy(ignore_eos=True)).token_ids == ref


@pytest.mark.parametrize("m", [1, 2, 5, 13, NEW])
def test_max_new_tokens_is_exact_when_a_step_accepts_several(m, plain, spec, record_verifications):
    out = spec.generate(PROMPT, greedy(max_new_tokens=m))
    assert out.token_ids == plain.token_ids[:m]
    assert out.finish_reason == "length" and out.stats.new_tokens == m
    if m >= 5:            # several tokens per step, and no step drafts past what max_new_tokens leaves
        assert len(record_verifications) < m
        assert sum(len(r.tokens) for r in record_verifications) == m


@pytest.mark.parametrize("m", [1, 4, 11])
def test_max_new_tokens_is_exact_when_sampling(m, target, loaded):
    for draft in (target, loaded("llama_draft")):
        eng = Engine(target, draft=draft, method="draft", k=6, adaptive_k=False)
        for seed in range(3):
            out = eng.generate(PROMPT, SamplingParams(max_new_tokens=m, seed=seed, ignore_eos=True))
            assert len(out.token_ids) == m and out.finish_reason == "length"


# --- logprobs ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft", ["self", "other"])
def test_logprobs_under_speculation_equal_logprobs_under_none(draft, target, loaded):
    params = greedy(logprobs=3)
    ref = Engine(target, method="none").generate(PROMPT, params)
    eng = Engine(target, draft=target if draft == "self" else loaded("llama_draft"), method="draft", k=5,
                 adaptive_k=False)
    out = eng.generate(PROMPT, params)
    assert out.token_ids == ref.token_ids
    assert len(out.logprobs) == len(ref.logprobs) == NEW
    for a, b in zip(out.logprobs, ref.logprobs):
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def test_sampled_logprobs_are_the_targets_raw_logprobs(target, loaded):
    """Under sampling, speculation and processors (temperature, top-k): each reported logprob is the target's
    raw log-softmax at that position, recomputed here by one forward over prompt + output."""
    eng = Engine(target, draft=loaded("llama_draft"), method="draft", k=4, adaptive_k=False)
    out = eng.generate(PROMPT, SamplingParams(temperature=0.7, top_k=20, seed=1, max_new_tokens=NEW,
                                              ignore_eos=True, logprobs=2))
    ids = out.prompt_ids + out.token_ids
    logits = target.model(torch.tensor([ids]), target.model.new_cache(1, 256))[0]           # [T, V]
    lp = torch.log_softmax(logits[len(out.prompt_ids) - 1 : -1], -1)                        # [NEW, V]
    expect = lp.gather(1, torch.tensor(out.token_ids).view(-1, 1)).view(-1)
    got = torch.tensor([x.logprob for x in out.logprobs])
    torch.testing.assert_close(got, expect, atol=1e-4, rtol=0)
    assert all(len(x.top) == 2 and x.top[0][1] >= x.top[1][1] for x in out.logprobs)
    assert out.stats.accepted_tokens < out.stats.draft_tokens                               # rejections happened
