"""The step under a constraint, on the 8-letter target: a proposer drafting tokens the grammar forbids (chains and
trees) never gets one scored or accepted, and the output equals plain constrained decoding; constrained and
unconstrained rows batched together each equal their solo run; the grammar's end and a dead end finish a request."""
from __future__ import annotations

import random
import re
import time

import pytest
import torch

from leaplm.config import SamplingParams, StructuredOutput
from leaplm.engine.engine import Engine
from leaplm.engine.scheduler import BatchScheduler, SeqRequest
from leaplm.propose import registry
from leaplm.propose.base import Proposal, ProposerBase, SimpleFactory
from leaplm.structured.state import GrammarState, GrammarVocab
from letters import letter_tokenizer, letters  # noqa: F401 - the fixture

ALTERNATE = StructuredOutput(regex="((a|b)(c|d|e)){1,20}f")
PROMPT = [0, 2, 1, 3, 0, 2, 1, 4]
NEW = 30


def greedy(spec=ALTERNATE, new=NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=new, structured=spec)


class Adversary(ProposerBase):
    """Drafts random letters (most of them forbidden), as a chain or a random tree, and records what reached the
    verifier (observe gets the proposal as scored, cut or pruned to the grammar)."""
    name, samples = "adversary", False

    def __init__(self, seed: int, tree: bool, log: list):
        self.rng, self.tree, self.log = random.Random(seed), tree, log

    def propose(self, ctx) -> Proposal:
        k = self.rng.randint(1, ctx.k)
        tokens = torch.tensor([self.rng.randrange(8) for _ in range(k)], dtype=torch.long)
        parents = [self.rng.randrange(-1, i) for i in range(k)] if self.tree else None
        self._context = list(ctx.tokens)
        return Proposal(tokens, parents=parents)

    def observe(self, proposal, result, extra_logits=None) -> None:
        self.log.append((self._context, proposal.tokens.tolist(), proposal.parents, result.accepted))


@pytest.fixture
def adversary(monkeypatch):
    registry._load_builtin()
    log: list = []

    def install(tree: bool):
        monkeypatch.setitem(registry.BUILDERS, "ngram",
                            lambda spec, target, draft: SimpleFactory(lambda max_len: Adversary(len(log) + 7, tree,
                                                                                                log)))
    return install, log


def allowed_along(vocab: GrammarVocab, committed: list[int], path: list[int]) -> bool:
    s = vocab.state(ALTERNATE)
    s.advance(committed)
    for t in path:
        if not bool(s.allowed()[t]):
            return False
        s.advance([t])
    return True


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_forbidden_drafts_are_never_scored_or_accepted(tree, letters, adversary):
    install, log = adversary
    install(tree)
    target = letters["target"]
    vocab = GrammarVocab(letter_tokenizer(), 8, [])
    plain = Engine(target, method="none").generate(PROMPT, greedy())
    assert re.fullmatch(ALTERNATE.regex, letter_tokenizer().decode(plain.token_ids))
    eng = Engine(target, method="ngram", k=6, adaptive_k=False)
    out = eng.generate(PROMPT, greedy())
    assert out.token_ids == plain.token_ids
    sampled = [eng.generate(PROMPT, SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=s, structured=ALTERNATE))
               for s in range(8)]
    for o in sampled:
        assert re.fullmatch(ALTERNATE.regex, letter_tokenizer().decode(o.token_ids)) or o.finish_reason == "length"
    assert len(log) > 10
    for context, tokens, parents, _ in log:
        committed = context[len(PROMPT):]
        if parents is None:
            assert allowed_along(vocab, committed, tokens)
        else:
            for i in range(len(tokens)):
                path, j = [], i
                while j >= 0:
                    path.insert(0, tokens[j])
                    j = parents[j]
                assert allowed_along(vocab, committed, path)


def test_constrained_and_unconstrained_rows_batched_equal_their_solo_runs(letters):
    target = letters["target"]
    eng = Engine(target, method="ngram", k=4, adaptive_k=False)
    requests = [(PROMPT, greedy()), (PROMPT, SamplingParams(temperature=0, max_new_tokens=NEW)),
                ([1, 3, 0], greedy(StructuredOutput(regex="(ab|cd|efg)+"))),
                ([4, 4, 2], SamplingParams(temperature=0, max_new_tokens=NEW, stop_token_ids=[7])),
                ([0], greedy(StructuredOutput(choice=["abc", "abd", "bbbbbbb"])))]
    alone = [eng.generate(p, sp).token_ids for p, sp in requests]
    outs: dict[int, list[int]] = {}
    sched = BatchScheduler(eng, max_batch=len(requests), calibrate=False)
    sched.submit([SeqRequest(list(p), sp, lambda o, i=i: outs.setdefault(i, []).extend(o.chunk.token_ids
                                                                                          if o.chunk else []))
                  for i, (p, sp) in enumerate(requests)])
    sched.run_until_idle()
    assert [outs[i] for i in range(len(requests))] == alone
    assert alone[0] != alone[1]                   # the constraint changed something


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_output_is_the_same_without_forced_tokens(letters, monkeypatch, method):
    """Forced tokens are drafts like any other: a grammar whose forced tokens are over their time budget (none
    drafted) gives the same greedy output; without a proposer it then takes more target forwards (the forced
    tokens were drafted before)."""
    spec = StructuredOutput(regex="abc(ab|cd|efg)+")             # forces a, b, c at the start
    eng = Engine(letters["target"], method=method, k=4, adaptive_k=False)
    forced = eng.generate(PROMPT, greedy(spec))
    monkeypatch.setattr(GrammarState, "FORCED_BUDGET_S", -1.0)
    fresh = Engine(letters["target"], method=method, k=4, adaptive_k=False)    # grammars built anew
    plain = fresh.generate(PROMPT, greedy(spec))
    assert plain.token_ids == forced.token_ids and plain.token_ids[:3] == [0, 1, 2]
    assert plain.stats.target_forwards >= forced.stats.target_forwards
    if method == "none":
        assert plain.stats.target_forwards > forced.stats.target_forwards


def test_a_complete_grammar_ends_the_request(letters):
    out = Engine(letters["target"], method="none").generate([0], greedy(StructuredOutput(regex="ab")))
    assert out.token_ids == [0, 1] and out.finish_reason == "stop"


def test_a_dead_end_ends_the_request_with_its_own_finish_reason(letters, monkeypatch):
    real = GrammarState._masks_along

    def masks_along(self, drafts, n):            # after three committed tokens nothing is allowed
        masks = real(self, drafts, n)
        if self.committed >= 3:
            masks[0] = False
        return masks

    monkeypatch.setattr(GrammarState, "_masks_along", masks_along)
    for method in ("none", "ngram"):
        out = Engine(letters["target"], method=method, k=1, adaptive_k=False).generate(PROMPT, greedy(
            StructuredOutput(regex="[a-e]+")))
        assert len(out.token_ids) == 3 and out.finish_reason == "constraint"


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_row_whose_masks_are_slow_sits_steps_out_and_the_others_go_on(letters, monkeypatch, method):
    """Every constrained row's grammar work takes 30 ms more (as a hostile regex's masks would): the rows beside it
    step on meanwhile (steps with a row sitting out still emit the others' tokens), and every row's output equals
    its solo run, the constrained ones' proposals used in a later step than they were made in. Alone, a row never
    sits a step out (there is nobody else to step)."""
    from leaplm.engine import constrain
    from leaplm.engine.step import Batch

    eng = Engine(letters["target"], letters["near"] if method == "draft" else None, method=method, k=4,
                 adaptive_k=False)
    requests = [(PROMPT, greedy()), (PROMPT, SamplingParams(temperature=0, max_new_tokens=NEW)),
                ([1, 3, 0], greedy(StructuredOutput(regex="(ab|cd|efg)+"))),
                ([4, 4, 2], SamplingParams(temperature=0, max_new_tokens=NEW, stop_token_ids=[7]))]
    alone = [eng.generate(p, sp).token_ids for p, sp in requests]
    real = constrain.constrain_proposal

    def slow(req, prop, forced=False):
        time.sleep(0.03)
        return real(req, prop, forced)

    monkeypatch.setattr(constrain, "constrain_proposal", slow)

    def run(reqs) -> tuple[list[list[int]], list]:
        batch, outs, reports = Batch(eng, len(reqs)), [[] for _ in reqs], []
        for i, (p, sp) in enumerate(reqs):
            batch.join(list(p), sp, tag=i)
        while batch.rows:
            outcome = batch.step()
            reports.append(outcome.report)
            for o in outcome.outputs:
                assert o.error is None, o.error
                outs[o.row.tag] += o.chunk.token_ids if o.chunk is not None else []
        return outs, [r for r in reports if r is not None]

    outs, reports = run(requests)
    assert outs == alone
    assert any(r.deferred and sum(r.emitted) for r in reports)       # others emitted while a row sat out
    solo, solo_reports = run(requests[:1])
    assert solo == alone[:1] and not any(r.deferred for r in solo_reports)
