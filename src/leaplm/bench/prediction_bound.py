"""How fast a prediction could make a given greedy output, whatever the K policy: the ceiling its speedups are
measured against (docs/predicted-outputs.md).

  draft_runs       replays the output through the prediction's aligner (propose/prediction.py): at each output
                   position, the draft of up to k tokens the prediction offers there and how many of them the
                   output goes on with
  oracle_speedup   the cheapest way to emit the output with those drafts when every block's outcome is known in
                   advance (dynamic programming over the block length at each step), as tokens per one-token
                   forward: no policy that chooses K from the past does better
  perfect_speedup  the same for an output that follows its prediction to the last token, blocks of k + 1 tokens

cost(T) is a forward over T tokens relative to one token (a block-cost curve, e.g. `leaplm bench --roofline`'s).
"""
from __future__ import annotations

from typing import Callable

from ..propose.prediction import PREDICTION_K, Aligner, Prediction, prediction_ids


def draft_runs(tokenizer, prediction: str, output_ids: list[int], k: int = PREDICTION_K) -> tuple[list[int],
                                                                                                     list[int]]:
    """(right, lengths): at output position j (its first j tokens committed), the prediction's draft is
    lengths[j] tokens long and the output's next right[j] tokens are its first ones."""
    aligner = Aligner(Prediction.build(tokenizer, prediction_ids(tokenizer, prediction)), tokenizer)
    right, lengths = [], []
    for j in range(len(output_ids)):
        aligner.sync(output_ids[:j])
        draft = aligner.draft(k)
        n = 0
        while n < len(draft) and j + n < len(output_ids) and draft[n] == output_ids[j + n]:
            n += 1
        right.append(n)
        lengths.append(len(draft))
    return right, lengths


def oracle_speedup(right: list[int], lengths: list[int], cost: Callable[[int], float]) -> float:
    """Tokens per one-token forward of the best block lengths in hindsight: at position j a block drafting
    k <= lengths[j] tokens costs cost(k + 1) and emits min(right[j], k) + 1 tokens."""
    n = len(right)
    best = [0.0] * (n + 1)                  # best[j]: the cheapest emission of tokens j..n-1
    for j in range(n - 1, -1, -1):
        b = cost(1) + best[j + 1]
        for k in range(1, lengths[j] + 1):
            b = min(b, cost(k + 1) + best[min(n, j + min(right[j], k) + 1)])
        best[j] = b
    return n / best[0] if n else 1.0


def perfect_speedup(n: int, cost: Callable[[int], float], k: int = PREDICTION_K) -> float:
    """An output of n tokens that its prediction carries throughout, in blocks of k drafts."""
    j = spent = 0
    while j < n:
        d = min(k, n - j - 1)
        spent += cost(d + 1)
        j += d + 1
    return n / spent if n else 1.0
