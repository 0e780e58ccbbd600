"""The Monte Carlo lossless test through the server's path: rows of one batch (BatchScheduler over the one step)
mixing methods (draft, ngram, lookahead's trees, none), K per row, adaptive K, and greedy rows beside the sampled
ones. Same statistic and bound as test_lossless_sampling.py (positions 2 and 3, Weissman et al.'s L1 bound at
DELTA = 1e-6, mc_bounds.py), and the same negative control: a verifier that accepts every draft must fail it."""
from __future__ import annotations

import sys

import pytest
import torch

from leaplm import Engine, SamplingParams
from leaplm.engine.scheduler import BatchScheduler, SeqRequest
from mc_bounds import tv_and_bound
from test_lossless_sampling import PLAIN, PROCESSED, PROMPT, always_accept, exact_positions_2_3

N = 1200
ROW_KINDS = [("draft", 3), ("none", None), ("draft", 1), ("ngram", 2), ("draft", 4), ("lookahead", 3)]


def sample_in_batches(eng: Engine, params: dict, n: int = N, max_batch: int = 8, kinds=ROW_KINDS,
                      prompt: list[int] = PROMPT, tally: dict[str, int] | None = None):
    """Empirical joint [V, V] of positions 2 and 3 over seeds 0..n-1, each seed a row of a mixed batch; every
    fourth submission is also a greedy row, whose tokens must equal the greedy request alone. tally, when given,
    receives the sampled rows' "drafted" and "accepted" token counts."""
    V = eng.model.vocab_size
    greedy = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    greedy_ref = eng.generate(prompt, greedy).token_ids
    outs: dict[int, list[int]] = {}
    finals: dict[int, object] = {}                    # sampled row -> its GenerationStats (on its last chunk)

    def record(o, i):
        outs.setdefault(i, []).extend(o.chunk.token_ids if o.chunk else [])
        if o.chunk is not None and o.chunk.stats is not None:
            finals[i] = o.chunk.stats

    sched = BatchScheduler(eng, max_batch=max_batch)
    seqs, sampled = [], []
    for seed in range(n):
        method, k = kinds[seed % len(kinds)]
        i = len(seqs)
        seqs.append(SeqRequest(list(prompt), SamplingParams(max_new_tokens=3, seed=seed, ignore_eos=True, **params),
                               lambda o, i=i: record(o, i), method=method, k=k))
        sampled.append(i)
        if seed % 4 == 0:
            j = len(seqs)
            seqs.append(SeqRequest(list(prompt), greedy, lambda o, j=j: outs.setdefault(j, []).extend(
                o.chunk.token_ids if o.chunk else []), method=kinds[(seed + 1) % len(kinds)][0]))
    sched.max_queue = len(seqs)
    sched.submit(seqs)
    sched.run_until_idle()
    counts = torch.zeros(V, V, dtype=torch.float64)
    for i in sampled:
        assert len(outs[i]) == 3
        counts[outs[i][1], outs[i][2]] += 1
    assert all(outs[j] == greedy_ref for j in range(len(seqs)) if j not in set(sampled))
    if tally is not None:
        tally["drafted"] = sum(finals[i].draft_tokens for i in sampled)
        tally["accepted"] = sum(finals[i].accepted_tokens for i in sampled)
    return counts / n


@pytest.mark.parametrize("case", ["plain-far", "processed-near"])
def test_batched_rows_follow_the_target(case, tiny_vocab, ref_probs):
    params, draft = (PLAIN, "far") if case == "plain-far" else (PROCESSED, "near")
    exact = exact_positions_2_3(tiny_vocab["target"].path, SamplingParams(**params), ref_probs)
    eng = Engine(tiny_vocab["target"], draft=tiny_vocab[draft], method="draft", k=4, adaptive_k=True)
    got = sample_in_batches(eng, params)
    tv, bound = tv_and_bound(got, exact, N)
    assert tv < bound, f"TV {tv:.4f} >= bound {bound:.4f} ({case})"


def test_negative_control_in_batches(tiny_vocab, ref_probs, monkeypatch):
    patched = [m for name, m in list(sys.modules.items())
               if name.startswith("leaplm.engine") and hasattr(m, "verify_coupled")]
    assert patched
    for m in patched:
        monkeypatch.setattr(m, "verify_coupled", always_accept)
    always_accept.calls = 0
    exact = exact_positions_2_3(tiny_vocab["target"].path, SamplingParams(**PLAIN), ref_probs)
    eng = Engine(tiny_vocab["target"], draft=tiny_vocab["far"], method="draft", k=4, adaptive_k=False)
    got = sample_in_batches(eng, PLAIN, kinds=[("draft", 4), ("draft", 2), ("none", None), ("draft", 3)])
    tv, bound = tv_and_bound(got, exact, N)
    assert always_accept.calls >= N // 2
    assert tv > bound, f"the wrong verifier passed: TV {tv:.4f} < bound {bound:.4f}"
