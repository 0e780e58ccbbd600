"""The suffix proposer: frequency trees, the engine-lifetime history, the corpus."""
from __future__ import annotations

import pytest
import torch

from leaplm.cache.tree import check_parents
from leaplm.config import ConfigError, SamplingParams
from leaplm.engine.engine import Engine
from leaplm.propose.base import ProposeContext
from leaplm.propose.suffix import SuffixProposer, SuffixStore, frequency_tree, load_corpus
from leaplm.sampling import LogitsProcessor


def ctx(tokens: list[int], k: int) -> ProposeContext:
    params = SamplingParams(temperature=0)
    return ProposeContext(tokens, k, params, LogitsProcessor(params), None, None)


def test_frequency_tree_keeps_the_heaviest_nodes_parents_first():
    conts = [[1, 2, 3], [1, 2, 4], [1, 5], [6]]
    tree = frequency_tree(conts, [1.0, 1.0, 1.0, 1.0], budget=4, min_share=0.0)
    # weights: 1:3, 1-2:2, then 1-2-3, 1-2-4, 1-5, 6 all 1 (ties: the shallower, then the earlier-inserted)
    assert tree.tokens == [1, 2, 6, 5] and tree.parents == [-1, 0, -1, 0]
    check_parents(tree.parents)
    assert frequency_tree(conts, [1.0] * 4, budget=9, min_share=0.3).tokens == [1, 2]   # shares 3/4, 2/4
    assert frequency_tree(conts, [1.0, 1.0, 1.0, 9.0], budget=2, min_share=0.0).tokens == [6, 1]


def test_suffix_proposes_a_tree_from_the_request_itself():
    store = SuffixStore(1, 3, [])
    p = SuffixProposer(store, torch.device("cpu"))
    tokens = [8, 1, 2, 3, 8, 1, 2, 4, 8, 1, 2]          # "8 1 2" went on with 3, then with 4: equal weight
    prop = p.propose(ctx(tokens, 4))
    assert prop.q is None and prop.parents is not None
    check_parents(prop.parents)
    roots = [t for t, par in zip(prop.tokens.tolist(), prop.parents) if par == -1]
    assert roots == [4, 3]                               # both seen; on a tie, the most recent first
    assert prop.tokens.tolist() == [4, 3, 8, 8]          # then one level deeper under each


def test_a_longer_context_match_outweighs_a_more_recent_one():
    p = SuffixProposer(SuffixStore(1, 3, []), torch.device("cpu"))
    tokens = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2, 3, 9, 1, 2]
    # "9 1 2" -> 4 after a 6-token match, -> 3 after a 3-token one: the 4-branch outweighs 2:1
    assert p.propose(ctx(tokens, 4)).tokens.tolist() == [4, 9, 1, 2]


def test_suffix_with_nothing_to_match_proposes_an_empty_tree():
    p = SuffixProposer(SuffixStore(2, 3, []), torch.device("cpu"))
    prop = p.propose(ctx([1, 2, 3, 4], 4))
    assert prop.k == 0 and prop.parents == []


def test_earlier_requests_and_the_corpus_feed_later_ones():
    store = SuffixStore(1, 3, [[5, 6, 7, 8]])
    first = SuffixProposer(store, torch.device("cpu"))
    first.propose(ctx([1, 2, 3, 4, 10, 11], 2))                 # indexes the first request's tokens
    second = SuffixProposer(store, torch.device("cpu"))
    assert second.propose(ctx([0, 3, 4], 2)).tokens.tolist() == [10, 11]    # from the earlier request
    assert second.propose(ctx([0, 3, 4, 0, 6], 2)).tokens.tolist() == [7, 8]  # from the corpus


def test_load_corpus_reads_files_and_directories(tmp_path, tiny_llama):
    (tmp_path / "a.txt").write_text("t1 t2 t3")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("t4 t5")
    (tmp_path / ".hidden").write_text("t9")
    assert load_corpus(str(tmp_path), tiny_llama.tokenizer) == [[1, 2, 3], [4, 5]]
    assert load_corpus(str(tmp_path / "a.txt"), tiny_llama.tokenizer) == [[1, 2, 3]]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError) as e:
        load_corpus(str(empty), tiny_llama.tokenizer)
    assert e.value.field == "corpus"


def test_a_corpus_that_holds_the_continuation_is_accepted_and_lossless(tmp_path, tiny_llama):
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    prompt = [3, 1, 4]
    want = Engine(tiny_llama, method="none").generate(prompt, params).token_ids
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"t{t}" for t in prompt + want))
    eng = Engine(tiny_llama, method="suffix", k=8, corpus=str(corpus), adaptive_k=False)
    out = eng.generate(prompt, params)
    assert out.token_ids == want
    assert out.stats.mean_accepted_length > 3          # the corpus predicted the output


def test_forget_history_drops_earlier_answers_and_keeps_the_corpus(tmp_path, tiny_llama):
    # a repeated prompt copies the engine's own earlier answer unless the history is forgotten (what bench does)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    prompt = [7, 2, 9, 4]
    eng = Engine(tiny_llama, method="suffix", k=8, adaptive_k=False)
    first = eng.generate(prompt, params)
    again = eng.generate(prompt, params)
    assert again.token_ids == first.token_ids
    assert again.stats.accepted_tokens > first.stats.accepted_tokens          # it copied the first answer
    eng.forget_history()
    fresh = eng.generate(prompt, params)
    assert fresh.token_ids == first.token_ids
    assert (fresh.stats.draft_tokens, fresh.stats.accepted_tokens) == (first.stats.draft_tokens,
                                                                        first.stats.accepted_tokens)
    store = SuffixStore(1, 3, [[5, 6, 7, 8]])
    SuffixProposer(store, torch.device("cpu")).propose(ctx([1, 2, 3, 4, 10, 11], 2))
    store.forget()
    later = SuffixProposer(store, torch.device("cpu"))
    assert later.propose(ctx([0, 3, 4], 2)).tokens.tolist() == []             # the earlier request is gone
    assert later.propose(ctx([0, 3, 4, 0, 6], 2)).tokens.tolist() == [7, 8]   # the corpus stays
