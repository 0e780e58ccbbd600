"""`leaplm bench agree`: does leaplm's greedy decoding of a GGUF file agree with libllama's, and where it does not,
is the disagreement a near-tie?

Two backends computing the same model in different arithmetic (leaplm's int8 kernel or fp32 path, libllama's own
quantized matrix products) choose the same greedy token wherever the top two logits are further apart than their
rounding differences. Where they are not, the two greedy continuations part at that position and never meet again.
So each prompt is decoded greedily by both; at the first position where the tokens differ, both backends score the
common prefix and the report gives each one's logit gap between its own choice and the other's choice.

Their sum is how much the two backends disagree on that pair: d[a] - d[b] with d = ours - theirs over the vocabulary.
The backends' rounding differences are measured at the same position: NOISE_TOP tokens with the highest logits give
the spread sigma of d, so a pair's difference has spread sigma * sqrt(2), and `z` = (our gap + their gap) / that.
A disagreement with a small z (a near-tie) is what the two arithmetics' rounding explains; a large one is a bug.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

# logits of the prefix (prompt + common tokens) -> [V] fp32 of the next position
Scorer = Callable[[list[int]], torch.Tensor]
# prompt ids, n -> n greedy token ids
Decoder = Callable[[list[int], int], list[int]]


@dataclass
class Divergence:
    """The first position where the two greedy continuations differ."""
    position: int                # index into the new tokens
    ours: int                    # leaplm's token there
    theirs: int                  # libllama's token there
    our_gap: float               # leaplm's logit(ours) - logit(theirs) (>= 0 where its scoring matches its decoding)
    their_gap: float             # libllama's logit(theirs) - logit(ours)
    noise: float                 # spread of (ours - theirs) over the NOISE_TOP highest logits at this position

    @property
    def z(self) -> float:
        """The pair's disagreement in units of the backends' rounding spread for a difference of two logits."""
        return (self.our_gap + self.their_gap) / max(self.noise * 2 ** 0.5, 1e-9)


@dataclass
class PromptAgreement:
    prompt: str
    tokens: int                          # new tokens compared
    agreed: int                          # leading new tokens both chose alike
    divergence: Divergence | None = None

    @property
    def identical(self) -> bool:
        return self.divergence is None


@dataclass
class AgreementReport:
    model: str
    near_tie: float                      # a divergence with z at most this is a near-tie
    prompts: list[PromptAgreement] = field(default_factory=list)

    @property
    def identical_share(self) -> float:
        return sum(p.identical for p in self.prompts) / max(1, len(self.prompts))

    @property
    def unexplained(self) -> list[PromptAgreement]:
        """Disagreements that are not near-ties."""
        return [p for p in self.prompts if p.divergence is not None and p.divergence.z > self.near_tie]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["identical_share"] = self.identical_share
        d["unexplained"] = len(self.unexplained)
        for p, row in zip(self.prompts, d["prompts"]):
            if p.divergence is not None:
                row["divergence"]["z"] = p.divergence.z
        return d


NOISE_TOP = 64


def rounding_noise(ours: torch.Tensor, theirs: torch.Tensor, top: int = NOISE_TOP) -> float:
    """Standard deviation of ours - theirs ([V] each) over the `top` tokens ours ranks highest: the contenders."""
    idx = ours.topk(min(top, ours.numel())).indices
    return float((ours[idx] - theirs[idx]).std())


def compare(prompt: str, prompt_ids: list[int], n: int, ours: Decoder, theirs: Decoder, our_scorer: Scorer,
            their_scorer: Scorer) -> PromptAgreement:
    """Greedy n tokens from both backends; at their first difference, each backend's gap between the two choices."""
    a, b = ours(prompt_ids, n), theirs(prompt_ids, n)
    m = min(len(a), len(b))
    k = next((i for i in range(m) if a[i] != b[i]), m)
    if k == m:
        return PromptAgreement(prompt, m, m)
    prefix = prompt_ids + a[:k]
    la, lb = our_scorer(prefix), their_scorer(prefix)                      # [V], [V]
    div = Divergence(k, a[k], b[k], float(la[a[k]] - la[b[k]]), float(lb[b[k]] - lb[a[k]]), rounding_noise(la, lb))
    return PromptAgreement(prompt, m, k, div)


def agreement(model: str, prompts: Sequence[tuple[str, list[int]]], n: int, ours: Decoder, theirs: Decoder,
              our_scorer: Scorer, their_scorer: Scorer, near_tie: float) -> AgreementReport:
    rep = AgreementReport(model, near_tie)
    for text, ids in prompts:
        rep.prompts.append(compare(text, ids, n, ours, theirs, our_scorer, their_scorer))
    return rep


@dataclass
class Backend:
    """One side of the comparison: a loaded model's greedy decoder (the engine's plain decoding, the path every
    request takes), its scorer and its prompt encoding."""
    decode: Decoder
    score: Scorer
    encode: Callable[[str], list[int]]


def engine_backend(lm) -> Backend:
    from ..config import SamplingParams
    from ..engine.engine import Engine

    eng = Engine(lm, method="none")

    def decode(ids: list[int], n: int) -> list[int]:
        sp = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
        return list(eng.generate(list(ids), sp).token_ids)

    def score(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = lm.model.forward(torch.tensor([ids]), lm.model.new_cache(1, len(ids) + 1), last_only=True)
        return logits.reshape(-1).float()                                         # [V]

    def encode(text: str) -> list[int]:
        return eng.encode(text, SamplingParams(temperature=0, max_new_tokens=1))

    return Backend(decode, score, encode)
