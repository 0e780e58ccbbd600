"""Stage 1 of the step (engine/proposing.py): what a proposer is handed.

A row's batch-1 view of the target cache is a slice per layer, built only for a proposer that declares it reads
it (Proposer.reads_target_cache: layer-skip); an n-gram lookup at every step of every row would otherwise pay
for views it never reads.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from leaplm.engine.proposing import propose_row
from leaplm.propose.base import Proposal, ProposerBase
from leaplm.propose.layer_skip import LayerSkipProposer
from leaplm.propose.ngram import NgramProposer


class Recording(ProposerBase):
    name = "recording"

    def __init__(self, reads: bool):
        self.reads_target_cache = reads
        self.seen = []

    def propose(self, ctx) -> Proposal:
        self.seen.append(ctx.target_cache)
        return Proposal(torch.tensor([1, 2], dtype=torch.long))


def row(proposer) -> SimpleNamespace:
    stats = SimpleNamespace(propose_s=0.0, method=proposer.name)
    req = SimpleNamespace(tokens=[1, 2, 3], params=None, generator=None, presence=None, seed=None, stats=stats,
                          verifier="race")
    return SimpleNamespace(proposer=proposer, req=req, proc=None)


def test_the_row_view_is_built_only_for_a_proposer_that_reads_it():
    observer = SimpleNamespace(observe_propose=lambda *a, **k: None)
    built = []
    view = object()

    def cache_of():
        built.append(1)
        return view

    reader, other = Recording(True), Recording(False)
    propose_row(row(other), 2, cache_of, observer)
    assert other.seen == [None] and built == []
    propose_row(row(reader), 2, cache_of, observer)
    assert reader.seen == [view] and built == [1]


def test_layer_skip_declares_it_reads_the_target_cache_and_n_gram_does_not():
    assert LayerSkipProposer.reads_target_cache and not NgramProposer.reads_target_cache
