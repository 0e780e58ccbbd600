"""The grammar state under speculation: masks along drafts, cuts, tree pruning, forced tokens, and rollback (a state
that planned over drafts and then committed some equals a fresh one fed the committed tokens alone)."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from leaplm.config import StructuredOutput
from leaplm.structured.state import GrammarState, GrammarVocab, fill_mask, unpack_bitmask

A, B, C, D, E, F, G = range(7)
ALTERNATE = StructuredOutput(regex="((a|b)(c|d|e))+f?")       # letters from {a, b}, then from {c, d, e}, ...


@pytest.fixture(scope="module")
def vocab():
    from letters import letter_tokenizer

    return GrammarVocab(letter_tokenizer(), 8, eos_token_ids=[])


def fresh_mask(vocab, spec, tokens) -> torch.Tensor:
    s = vocab.state(spec)
    s.advance(tokens)
    return s.allowed()


def ids(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().view(-1).tolist()


def test_unpack_bitmask_matches_bit_arithmetic():
    bm = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 5), dtype=torch.int32)
    ref = ((bm.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(3, -1)[:, :150].bool()
    assert torch.equal(unpack_bitmask(bm, 150), ref)


def test_fill_mask_writes_the_row_llguidance_torch_writes(vocab):
    """fill_mask against llguidance.torch's fill_next_token_bitmask (the reference), in the middle row of three;
    the other rows untouched."""
    import llguidance.torch as lt

    s = vocab.state(ALTERNATE)
    for tokens in ([], [A], [C]):
        s.advance(tokens)
        ours = torch.full((3, 1), 7, dtype=torch.int32)                            # [3, words]
        ref = torch.full((3, 1), 7, dtype=torch.int32)
        fill_mask(s.m, ours, 1)
        lt.fill_next_token_bitmask(s.m, ref, 1)
        assert torch.equal(ours, ref) and ours[1, 0] != 7 and ours[0, 0] == ours[2, 0] == 7


def test_grammar_masks_never_import_llguidance_torch():
    """Its import compiles a kernel with torch.compile, about a second holding the GIL, which would stall every
    request running beside the first constrained one; masks are computed without it (a fresh process)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from letters import letter_tokenizer\n"
            "from leaplm.config import StructuredOutput\n"
            "from leaplm.structured.state import GrammarVocab\n"
            "s = GrammarVocab(letter_tokenizer(), 8, eos_token_ids=[]).state(StructuredOutput(regex='(a|b)+'))\n"
            "assert s.allowed().any() and s.plan_chain([0, 1, 2])[0] == 2\n"
            "print(sorted(m for m in sys.modules if m.startswith(('llguidance.torch', 'torch._dynamo'))))\n")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_masks_follow_the_grammar_and_unknown_ids_are_never_allowed(vocab):
    s = vocab.state(ALTERNATE)
    assert ids(s.allowed()) == [A, B]
    s.advance([B])
    assert ids(s.allowed()) == [C, D, E]
    s.advance([D])
    assert ids(s.allowed()) == [A, B, F]          # <unk> (7) never


def test_a_chain_is_cut_at_its_first_forbidden_token(vocab):
    s = vocab.state(ALTERNATE)
    n, masks = s.plan_chain([A, C, B, A, D])      # the second A is forbidden after B
    assert n == 3 and masks.shape == (4, 8)
    for j in range(n + 1):
        assert torch.equal(masks[j], fresh_mask(vocab, ALTERNATE, [A, C, B][:j]))
    n, masks = s.plan_chain([C])                  # forbidden at once: nothing kept, the committed state's mask
    assert n == 0 and ids(masks[0]) == [A, B]


def test_a_complete_grammar_without_eos(vocab):
    """The tokenizer has no end-of-sequence token: llguidance's stand-in for one is never in a mask, so a complete
    grammar leaves an empty mask; the row after the completing draft allows anything (nothing sampled there is
    kept) and advancing stops at the grammar's end."""
    s = vocab.state(StructuredOutput(regex="ab"))
    n, masks = s.plan_chain([A, B, C])
    assert n == 2 and masks.shape[0] == 3 and bool(masks[2].all())
    assert s.advance([A, B, C]) == 2
    assert s.stopped and not s.allowed().any()


def test_sampled_drafts_keep_their_first_forbidden_token(vocab):
    """Rejection sampling rejects a forbidden sampled draft for sure and samples the residual there: kept as the
    last draft (a chain) or a leaf (a tree), with a row after it that is never read."""
    s = vocab.state(ALTERNATE)
    n, masks = s.plan_chain([A, C, B, A, D], keep_forbidden=True)
    assert n == 4 and masks.shape == (5, 8) and bool(masks[4].all())
    assert ids(masks[3]) == [C, D, E]              # where the forbidden A sits: the verifier's mask excludes it
    plan = s.plan_tree([A, C, B, D, E, A], [-1, -1, -1, 0, 1, 2], keep_forbidden=True)
    assert plan.kept == [0, 1, 2, 3, 5]            # C (1) and A (5) kept as leaves; E under C pruned
    assert bool(plan.masks[2].all()) and bool(plan.masks[5].all())
    assert ids(s.allowed()) == [A, B]


def test_an_end_of_sequence_token_ends_a_chain():
    from letters import letter_tokenizer

    v = GrammarVocab(letter_tokenizer(), 8, eos_token_ids=[G])
    s = v.state(StructuredOutput(regex="(a|b)+"))
    assert ids(s.allowed()) == [A, B]             # EOS only once the grammar accepts
    n, masks = s.plan_chain([A, G, B])
    assert n == 2 and ids(masks[1]) == [A, B, G] and ids(masks[2]) == [G]
    assert ids(s.allowed()) == [A, B]             # nothing consumed


def test_forced_tokens(vocab):
    s = vocab.state(StructuredOutput(regex="abc(d|e)"))
    assert s.forced(8) == [A, B, C]
    assert s.forced(2) == [A, B]
    s.advance([A, B, C])
    assert s.forced(8) == []
    assert vocab.state(ALTERNATE).forced(8) == []


def test_forced_tokens_off_for_a_grammar_whose_forced_tokens_took_over_budget(monkeypatch):
    """llguidance holds the GIL while it computes forced tokens: a grammar for which that took more than
    FORCED_BUDGET_S, when it was built or at a step, offers none from then on (each grammar built anew here, in a
    vocabulary of its own: the built ones are kept with their timing)."""
    from letters import letter_tokenizer

    from leaplm.structured.state import GrammarState

    spec = StructuredOutput(regex="abc(d|e)")
    monkeypatch.setattr(GrammarState, "FORCED_BUDGET_S", -1.0)         # any time is over it
    slow_at_build = GrammarVocab(letter_tokenizer(), 8, eos_token_ids=[])
    assert slow_at_build.state(spec).forced(8) == []
    assert slow_at_build.state(spec).forced(8) == []                    # the kept grammar keeps its timing
    monkeypatch.setattr(GrammarState, "FORCED_BUDGET_S", 10.0)
    assert slow_at_build.state(spec).forced(8) == []
    fast = GrammarVocab(letter_tokenizer(), 8, eos_token_ids=[])
    s = fast.state(spec)
    monkeypatch.setattr(GrammarState, "FORCED_BUDGET_S", -1.0)
    assert s.forced(8) == [A, B, C]          # computed, and over the budget: the last
    assert s.forced(8) == [] and s.forced(1) == []
    assert fast.state(spec).forced(8) == [A, B, C]      # a state of its own: timed at its own steps


def test_tree_pruning(vocab):
    s = vocab.state(ALTERNATE)
    #        root
    #   A(0)   C(1)x   B(2)
    #   D(3)  E(4)<-1  A(5)x  C(6)
    #   B(7)
    tokens = [A, C, B, D, E, A, C, B]
    parents = [-1, -1, -1, 0, 1, 2, 2, 3]
    plan = s.plan_tree(tokens, parents)
    assert plan.kept == [0, 2, 3, 6, 7]
    paths = {0: [A], 2: [B], 3: [A, D], 6: [B, C], 7: [A, D, B]}
    assert torch.equal(plan.masks[0], fresh_mask(vocab, ALTERNATE, []))
    for j, node in enumerate(plan.kept):
        assert torch.equal(plan.masks[j + 1], fresh_mask(vocab, ALTERNATE, paths[node])), node
    assert ids(s.allowed()) == [A, B]


def test_rollback_with_the_cache_equals_a_fresh_state(vocab):
    """Random steps: plan over random drafts (chains and trees), commit a random allowed prefix plus one allowed
    token, as a step does; the state then equals a fresh one fed every committed token."""
    rng = random.Random(0)
    spec = StructuredOutput(regex="((a|b)(c|d|e)){1,40}f")
    s = vocab.state(spec)
    committed: list[int] = []
    for step in range(30):
        drafts = [rng.randrange(7) for _ in range(rng.randrange(6))]
        if step % 3 == 2:
            s.plan_tree(drafts, [-1] + [rng.randrange(-1, j) for j in range(1, len(drafts))] if drafts else [])
            n = 0
        else:
            n, masks = s.plan_chain(drafts)
        keep = drafts[: rng.randint(0, n)]
        after = fresh_mask(vocab, spec, committed + keep)
        if not after.any():
            break
        bonus = rng.choice(ids(after))
        s.advance(keep + [bonus])
        committed += keep + [bonus]
        assert torch.equal(s.allowed(), fresh_mask(vocab, spec, committed)), committed
        assert s.committed == len(committed)


def test_the_first_mask_is_the_grammars_own_and_computed_once(vocab, monkeypatch):
    """The mask before any output token is computed when the grammar is built; a state copied from the kept one
    reads it (no mask computed) and it equals the mask llguidance computes for that state. Once a token is in
    (committed, or along a plan's drafts and tree paths) masks are computed."""
    import leaplm.structured.state as state_mod

    spec = StructuredOutput(regex="((a|b)(c|d|e)){1,3}f")
    vocab.state(spec)                                                   # built and kept
    computed = []
    real = state_mod.fill_mask
    monkeypatch.setattr(state_mod, "fill_mask", lambda m, bm, j: (computed.append(j), real(m, bm, j)))
    s = vocab.state(spec)
    first = s.allowed()
    assert computed == []
    live = torch.full((1, 1), -1, dtype=torch.int32)                    # [1, words]
    real(s.m.deep_copy(), live, 0)
    assert torch.equal(first, unpack_bitmask(live, 8)[0]) and ids(first) == [A, B]
    n, masks = s.plan_chain([A, C])
    assert n == 2 and len(computed) == 2 and torch.equal(masks[0], first)
    assert ids(masks[1]) == [C, D, E] and ids(masks[2]) == [A, B, F]
    s.advance([A])
    assert ids(s.allowed()) == [C, D, E]
    # llguidance's own bitmask has a word more when the vocabulary is a multiple of 32 tokens (SmolLM2's 49,152):
    # the state reads the words it has
    longer = torch.cat([vocab.state(spec).first_mask, torch.zeros(1, dtype=torch.int32)])        # [words + 1]
    t = GrammarState(vocab.state(spec).m, 8, first_mask=longer)
    assert t.first_mask.shape == (1,) and ids(t.allowed()) == [A, B] and len(computed) == 3   # none more
