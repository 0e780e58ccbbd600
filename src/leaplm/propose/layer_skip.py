"""Self-speculation by layer skipping (as Draft & Verify, SWIFT): the target itself, run on a subset of its
layers, is the draft. No extra weights and no cache of its own.

The draft writes the K/V of its layers into the target's own cache slots past the committed length: for
draft pass i it moves the length to committed + i so pass i + 1 attends to it, and restores the committed
length before returning. By the KVCache rule those slots are dead once the length is back (nothing reads
at or past the length but the forward that writes there), and the verifying forward over
[last token, drafts] rewrites every slot the draft touched, in every layer.

Drafting stops early when the draft's top probability falls below skip_confidence (the first token is
always proposed). At temperature > 0 drafts are sampled from the draft's processed q, which is returned,
so rejection sampling keeps the output exact.

Which layers to skip: SpecConfig.skip_layers, or else a small engine-lifetime search: a few candidate sets
(every other middle layer, and variants) are tried in turn on live steps (A B C A B C ...), and after
TRIAL_STEPS steps each the one emitting the most tokens per unit of target compute is kept.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import ConfigError, SpecConfig
from ..verify import VerifyResult
from .base import Proposal, ProposeContext, ProposerBase, SimpleFactory
from .registry import register

log = logging.getLogger(__name__)

TRIAL_STEPS = 8


@dataclass
class SkipTrial:
    skipped: list[int]
    layers: list[int]              # the layers the draft runs
    steps: int = 0
    emitted: int = 0               # tokens emitted by the steps that used this set
    cost: float = 0.0              # in target forwards: 1 verify + draft passes * len(layers) / n_layers

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.cost if self.cost else 0.0


def candidate_skip_sets(n_layers: int) -> list[list[int]]:
    """Sets to try, first and last layers always kept: every other middle layer (odd, then even), every other
    layer of the second half, the middle half."""
    mid = list(range(1, n_layers - 1))
    q = len(mid) // 4
    sets = [mid[::2], mid[1::2], [i for i in mid if i >= n_layers // 2][::2], mid[q: len(mid) - q]]
    out: list[list[int]] = []
    for s in sets:
        if s and s not in out:
            out.append(s)
    return out


class SkipSearch:
    """Engine-lifetime choice of the skipped layers, shared by every request's proposer."""

    def __init__(self, n_layers: int, candidates: list[list[int]]):
        self.trials = [SkipTrial(s, [i for i in range(n_layers) if i not in s]) for s in candidates]
        self.n_layers = n_layers
        self.chosen: int | None = 0 if len(self.trials) == 1 else None
        self._turn = 0

    def pick(self) -> int:
        if self.chosen is not None:
            return self.chosen
        i = self._turn
        self._turn = (self._turn + 1) % len(self.trials)
        return i

    def record(self, trial: int, passes: int, emitted: int) -> None:
        if self.chosen is not None:
            return
        t = self.trials[trial]
        t.steps += 1
        t.emitted += emitted
        t.cost += 1.0 + passes * len(t.layers) / self.n_layers
        if all(t.steps >= TRIAL_STEPS for t in self.trials):
            self.chosen = max(range(len(self.trials)), key=lambda i: self.trials[i].tokens_per_forward)
            best = self.trials[self.chosen]
            log.info("layerskip: skipping layers %s (%.2f tokens per target forward; tried %s)", best.skipped,
                     best.tokens_per_forward, [(t.skipped, round(t.tokens_per_forward, 2)) for t in self.trials])


class LayerSkipProposer(ProposerBase):
    name = "layerskip"
    samples = True
    reads_target_cache = True              # drafts into the target cache's free slots

    def __init__(self, model, search: SkipSearch, confidence: float):
        self.model = model                      # the target's LlamaForCausalLM
        self.search = search
        self.confidence = confidence
        self._trial = 0
        self._passes = 0

    def propose(self, ctx: ProposeContext) -> Proposal:
        cache = ctx.target_cache
        self._trial = self.search.pick()
        layers = self.search.trials[self._trial].layers
        committed = cache.lengths[0]
        presence = ctx.presence.clone() if ctx.presence is not None else None      # [V]
        feed = torch.tensor([[ctx.tokens[-1]]], device=self.model.device)           # [1, 1]
        drafts: list[int] = []
        qs: list[torch.Tensor] = []
        passes = 0
        try:
            for i in range(ctx.k):
                logits = self.model(feed, cache, layers=layers)[0]                  # [1, V]
                cache.advance(1)                # the next pass attends to this one's K/V
                passes += 1
                pres = presence.unsqueeze(0) if presence is not None else None
                if ctx.generator is None:
                    conf = float(logits.float().softmax(-1).max())
                    if i and conf < self.confidence:
                        break
                    t = int(ctx.processor.greedy(logits, pres))
                else:
                    q = ctx.processor.probs(logits, pres)                           # [1, V]
                    if i and float(q.max()) < self.confidence:
                        break
                    t = ctx.sample_chain(q, i)
                    if ctx.wants_q:
                        qs.append(q[0])
                drafts.append(t)
                if presence is not None:
                    presence[t] = True
                feed = torch.tensor([[t]], device=self.model.device)
        finally:
            cache.truncate(committed)
        self._passes = passes
        q = torch.stack(qs) if qs else None                  # [K, V] when the verifier reads it
        return Proposal(torch.tensor(drafts, dtype=torch.long, device=self.model.device), q)

    def observe(self, proposal: Proposal, result: VerifyResult, extra_logits=None) -> None:
        self.search.record(self._trial, self._passes, result.accepted + 1)


@register("layerskip")
def _build(spec: SpecConfig, target, draft):
    from ..models.llama import LlamaForCausalLM

    model = target.model
    if not model.capabilities.layer_subsets and target.backend == "llamacpp":
        raise ConfigError("method", "layerskip runs the target on a subset of its layers, and libllama runs every "
                                    "layer: use the torch backend (--backend torch)")
    if not model.capabilities.layer_subsets or not isinstance(model, LlamaForCausalLM):
        raise ConfigError("method", "layerskip runs the target on a subset of its layers, which only the native "
                                    "model families (llama, mistral, qwen2, qwen3) support")
    n = model.num_layers
    if spec.skip_layers is not None:
        bad = [i for i in spec.skip_layers if i >= n]
        if bad:
            raise ConfigError("skip_layers", f"layer indices {bad} do not exist (the target has {n} layers)")
        if len(set(spec.skip_layers)) >= n:
            raise ConfigError("skip_layers", f"must leave at least one of the target's {n} layers to run")
        candidates = [sorted(set(spec.skip_layers))]
    else:
        candidates = candidate_skip_sets(n)
        if not candidates:
            raise ConfigError("method", f"layerskip needs a target with at least 3 layers to choose from "
                                        f"(it has {n}); give --skip-layers explicitly")
    search = SkipSearch(n, candidates)
    return SimpleFactory(lambda max_len: LayerSkipProposer(model, search, spec.skip_confidence))
