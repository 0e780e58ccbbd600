"""The libllama backend (models/llamacpp.py) on tiny random GGUF files.

Against the torch path on the same f32 file (logits within a tolerance from float32's rounding and the forward's
reduction length; greedy tokens equal); rollback (a block scored, part rejected, the rest re-scored equals a fresh
prefill, bit for bit on Q8_0); batch invariance per weight type, measured and compared with the start-up check
the engine relies on; every method's greedy output token-identical to plain decoding on the same backend; sizes
llama.cpp would assert on refused as errors; the backend choice and its refusals.

Tests that need libllama skip only when the `llamacpp` extra is not installed (CI installs it).
"""
from __future__ import annotations

import sys

import pytest
import torch

from leaplm.config import ConfigError, SamplingParams
from leaplm.engine.engine import Engine
from leaplm.models.gguf_export import export_gguf
from leaplm.models.llamacpp.binding import available
from leaplm.models.loading import load_model
from leaplm.numerics import forward_reduction_length, sum_tolerance

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from gguf_writer import _root_conftest  # noqa: E402  (tests/conftest.py by path: other folders have a conftest)

BPE_CORPUS, write_family_checkpoint = _root_conftest().BPE_CORPUS, _root_conftest().write_family_checkpoint
needs_libllama = pytest.mark.skipif(not available(), reason="the llamacpp extra (llama-cpp-python) is not installed")
PROMPTS = [[1, 2, 3, 4, 5] * 3, [7, 3, 9, 3, 7, 1], [4]]
NEW = 40


def write_eot_tokenizer(path):
    """The byte-level BPE of tests/conftest.py with "<|endoftext|>" as its special token: transformers' GGUF
    tokenizer for a gpt2-type vocabulary adds that token when the vocabulary lacks it, and a draft check then
    sees one token more than the model has rows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(BPE_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(str(path))
    return fast


def write_heads(target, d) -> dict[str, str]:
    """An untrained EAGLE head and Medusa heads for the loaded `target` (Medusa's heads start as the identity, so
    they guess what the target's last hidden state says: some tokens are accepted)."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "heads"))
    from head_helpers import random_head
    from leaplm.heads.checkpoint import identity_of, save_head
    from leaplm.heads.medusa_net import MedusaConfig, MedusaNet

    net = MedusaNet(MedusaConfig(target.model.hidden_size, target.model.vocab_size, 3))
    return {"eagle": random_head(target, d / "eagle"),
            "medusa": str(save_head(d / "medusa", "medusa", net.config.to_dict(), identity_of(target),
                                    net.state_dict()))}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> path: HF directories 'target' and 'draft', and their GGUF exports 'target-f32', 'target-q8_0',
    'draft-q8_0'."""
    d = tmp_path_factory.mktemp("llamacpp")
    tok = write_eot_tokenizer(d / "tok")
    out = {"target": write_family_checkpoint(d / "target", "llama_tied", tok),
           "draft": write_family_checkpoint(d / "draft", "llama_draft", tok)}
    for name, kinds in (("target", ("f32", "q8_0")), ("draft", ("q8_0",))):
        for kind in kinds:
            out[f"{name}-{kind}"] = str(export_gguf(out[name], str(d / f"{name}-{kind}.gguf"), kind).path)
    return out


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


# --- against the torch path -------------------------------------------------------------------------------------
@needs_libllama
def test_f32_logits_and_greedy_tokens_match_the_torch_path(files):
    from leaplm.models.llamacpp.model import LlamaCppLM

    ref = load_model(files["target-f32"], backend="torch")
    # attention in f32 with an f32 KV cache: then the only differences are summation orders
    lm = LlamaCppLM(files["target-f32"], kv_cache_dtype="float32", flash_attn=False)
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])                                      # [1, 21]
    with torch.inference_mode():
        a = ref.model(ids, ref.model.new_cache(1, 64))                                 # [1, 21, V]
    b = lm.forward_hidden(ids, lm.new_cache(1, 64))
    tol = sum_tolerance(torch.float32, forward_reduction_length(ref.model), float(a.abs().max()))
    assert a.shape == b.logits.shape
    assert (a - b.logits).abs().max() <= tol
    with torch.inference_mode():                       # the hidden state heads read: after the final norm
        h = ref.model.forward_hidden(ids, ref.model.new_cache(1, 64)).hidden                 # [1, 21, hid]
    assert (h - b.hidden).abs().max() <= sum_tolerance(torch.float32, forward_reduction_length(ref.model),
                                                        float(h.abs().max()))
    for prompt in PROMPTS:
        want = Engine(ref, method="none").generate(prompt, greedy()).token_ids
        assert Engine(files["target-f32"], method="none", backend="llamacpp").generate(prompt, greedy()).token_ids \
            == want


# --- rollback and invariance -------------------------------------------------------------------------------------
@needs_libllama
def test_rollback_then_rescore_equals_a_fresh_prefill(files):
    from leaplm.models.llamacpp.model import LlamaCppLM

    lm = LlamaCppLM(files["target-q8_0"])
    ctx, block, again = [5, 9, 13, 2, 7, 7, 1], [30, 31, 32, 33, 34], [40, 41, 42]
    cache = lm.new_cache(1, 64)
    lm(torch.tensor([ctx]), cache, last_only=True)
    cache.advance(len(ctx))
    lm(torch.tensor([block]), cache)                   # score 5, keep 2: the other 3 are rejected
    cache.advance(2)
    got = lm(torch.tensor([again]), cache)             # [1, 3, V]
    fresh_cache = lm.new_cache(1, 64)
    lm(torch.tensor([ctx + block[:2]]), fresh_cache, last_only=True)
    fresh_cache.advance(len(ctx) + 2)
    assert torch.equal(got, lm(torch.tensor([again]), fresh_cache))
    # truncating below what was committed, and moving a row, leave the same state
    cache.truncate(len(ctx) + 1)
    cache2 = lm.new_cache(2, 64)
    lm(torch.tensor([ctx + block[:1], [3] * 8]), cache2, last_only=True)
    cache2.advance(8, 0)
    cache2.advance(8, 1)
    cache2.move_row(0, 1)
    cache2.truncate(0, 0)
    view = cache2.row_view(1)
    assert torch.equal(lm(torch.tensor([again]), cache)[0], lm(torch.tensor([again]), view)[0])


@needs_libllama
def test_a_tree_block_scores_each_branch_as_its_own_chain(files):
    """Tree verification through sequences: every node's logits equal those of its root-to-node path scored as a
    chain, and after compacting a path the row continues as if that path had been decoded."""
    from leaplm.cache.tree import tree_layout
    from leaplm.models.llamacpp.model import LlamaCppLM

    lm = LlamaCppLM(files["target-q8_0"])
    ctx = [5, 9, 13, 2, 7]
    parents = [-1, -1, 0, 0, 1, 2]                     # two branches, then a fork under node 0
    nodes = [50, 60, 51, 52, 61, 53]
    lay = tree_layout(parents)
    block = torch.tensor([[ctx[-1]] + nodes])
    cache = lm.new_cache(1, 64)
    lm(torch.tensor([ctx[:-1]]), cache, last_only=True)
    cache.advance(len(ctx) - 1)
    tree = lm(block, cache, tree_mask=lay.mask, position_offsets=lay.depths)[0]       # [7, V]

    def path(i):                                       # block rows root .. node i
        rows = [i + 1]
        while parents[rows[-1] - 1] != -1:
            rows.append(parents[rows[-1] - 1] + 1)
        return [0] + rows[::-1]

    for i in range(len(nodes)):
        rows = path(i)
        c = lm.new_cache(1, 64)
        lm(torch.tensor([ctx[:-1]]), c, last_only=True)
        c.advance(len(ctx) - 1)
        chain = lm(block[:, rows], c)[0]
        assert torch.equal(tree[rows[-1]], chain[-1]), f"node {i}"
    keep = path(5)                                     # root, node 0, node 2, node 5
    cache.compact(keep)
    cache.advance(len(keep))
    nxt = lm(torch.tensor([[70]]), cache)[0, 0]
    c = lm.new_cache(1, 64)
    lm(torch.tensor([ctx + [nodes[0], nodes[2], nodes[5]]]), c, last_only=True)
    c.advance(len(ctx) + 3)
    assert torch.equal(nxt, lm(torch.tensor([[70]]), c)[0, 0])


@needs_libllama
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_0", "F32"])
def test_batch_invariance_per_weight_type_agrees_with_the_start_up_check(qtype, tmp_path):
    """Q8_0 and Q4_1: a row's logits are the same alone, inside a block, beside one and beside 7 other rows
    (llama.cpp's block and one-token kernels agree there), and the start-up check (LlamaCppLM.batch_invariant)
    the engine's exactness rests on says so. Q4_0 and F32 are measured, not assumed (on this class of CPU F32
    differs by rounding, Q4_0 on some batches of 2 entries): where this test sees a difference, the start-up
    check must have seen one too."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from gguf_writer import write_tiny_gguf
    from leaplm.models.llamacpp.model import LlamaCppLM

    path, _ = write_tiny_gguf(tmp_path, qtype)
    lm = LlamaCppLM(path)
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, lm.vocab_size, (8, 20), generator=g)                       # [8, 20]
    block = torch.randint(0, lm.vocab_size, (8, 9), generator=g)                      # [8, 9]
    one = lm.new_cache(1, 64)
    lm(ctx[:1], one, last_only=True)
    one.advance(20)
    alone = []
    for t in range(9):
        alone.append(lm(block[:1, t: t + 1], one)[0, 0])
        one.advance(1)
    alone = torch.stack(alone)                                                         # [9, V]
    same = True
    for rows, T in ((1, 9), (2, 1), (2, 9), (8, 9), (1, 3)):
        cache = lm.new_cache(rows, 64)
        lm(ctx[:rows], cache, last_only=True)
        for b in range(rows):
            cache.advance(20, b)
        same &= torch.equal(lm(block[:rows, :T], cache)[0], alone[:T])
    if qtype in ("Q8_0", "Q4_1"):
        assert same and lm.batch_invariant
    if not same:                                       # the check never claims an invariance this test refutes
        assert not lm.batch_invariant


# --- every method: greedy output identical to plain decoding -------------------------------------------------------
METHODS = {
    "draft_gguf": lambda f: dict(method="draft", draft=f["draft-q8_0"], k=4),
    "draft_self": lambda f: dict(method="draft", draft=f["target-q8_0"], k=4),     # accepts everything
    "draft_torch": lambda f: dict(method="draft", draft=f["draft"], k=3),          # a PyTorch draft
    "ngram": lambda f: dict(method="ngram", k=4),
    "suffix": lambda f: dict(method="suffix", k=6),
    "suffix_big": lambda f: dict(method="suffix", k=16, ngram_min=1, ngram_max=6),
    "lookahead": lambda f: dict(method="lookahead", k=6, window=3, ngram_size=3, guess_set=3),
    "eagle": lambda f: dict(method="eagle", k=6, head=f["heads"]["eagle"]),            # trees over hidden states
    "medusa": lambda f: dict(method="medusa", k=4, head=f["heads"]["medusa"]),
}


@pytest.fixture(scope="module")
def loaded_q8(files, tmp_path_factory):
    """The Q8_0 target on libllama, with heads written for it (files["heads"])."""
    lm = load_model(files["target-q8_0"], backend="llamacpp")
    files["heads"] = write_heads(lm, tmp_path_factory.mktemp("heads"))
    return lm


@needs_libllama
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed_k", "adaptive_k"])
@pytest.mark.parametrize("name", METHODS)
def test_every_method_greedy_equals_none_on_libllama(name, adaptive, files, loaded_q8):
    target = files["target-q8_0"]
    # explicit: under auto a Q8_0 file runs on leaplm's int8 kernel (test_llamacpp_backend.py)
    none = Engine(target, method="none", backend="llamacpp")
    assert none.backend == "llamacpp" and none.exactness == "identical"
    eng = Engine(target, adaptive_k=adaptive, backend="llamacpp", **METHODS[name](files))
    assert eng.backend == "llamacpp"
    for prompt in PROMPTS:
        assert eng.generate(prompt, greedy()).token_ids == none.generate(prompt, greedy()).token_ids, prompt


@needs_libllama
def test_two_interleaved_streams_on_one_engine(files):
    eng = Engine(files["target-q8_0"], method="ngram", k=4, backend="llamacpp")
    assert eng.backend == "llamacpp"
    want = [eng.generate(p, greedy(24)).token_ids for p in PROMPTS[:2]]
    a, b = eng.stream(PROMPTS[0], greedy(24)), eng.stream(PROMPTS[1], greedy(24))
    got, live = [[], []], [a, b]
    while any(live):                                   # one chunk of each in turn until both end
        for i, s in enumerate(live):
            if s is not None:
                c = next(s, None)
                if c is None:
                    live[i] = None
                else:
                    got[i] += c.token_ids
    assert got == want


def scramble_then_score(lm, cache, rows: int, seed: int = 3) -> torch.Tensor:
    """Row 0 of `cache` through a server's worst day, with `rows` rows of tokens drawn for 3: every row prefills,
    decodes blocks of which 3 of 5 tokens are rolled back, the other rows finish (freeing cells in the middle of
    the KV buffer) and row 0 decodes on into whatever cells are free. rows == 1: row 0's same tokens and
    rollbacks alone. Returns row 0's logits of its last 6 one-token forwards, [6, V]."""
    g = torch.Generator().manual_seed(seed)
    V = lm.vocab_size
    ctx = torch.randint(0, V, (3, 12), generator=g)[:rows]                               # [rows, 12]
    blocks = torch.randint(0, V, (4, 3, 5), generator=g)[:, :rows]                       # [4, rows, 5]
    tail = torch.randint(0, V, (6,), generator=g)                                         # [6]
    lm(ctx, cache, last_only=True)
    for b in range(rows):
        cache.advance(12, b)
    for blk in blocks:                                  # 2 tokens of 5 kept; the rest dropped at the next forward
        lm(blk, cache)
        for b in range(rows):
            cache.advance(2, b)
    for b in range(1, rows):                            # the other requests end: their cells are freed
        cache.truncate(0, b)
    out = []
    for t in range(6):
        out.append(lm(tail[t: t + 1].unsqueeze(0), cache.row_view(0))[0, 0])
        cache.advance(1, 0)
    return torch.stack(out)                                                               # [6, V]


@needs_libllama
def test_a_row_beside_others_that_free_cells_equals_it_alone(files):
    """Where llama.cpp is batch-invariant (Q8_0), rows live in contexts of their own (LlamaCppRows), so a row's
    logits are bit for bit those it gets alone even after other rows rolled back and finished around it (in one
    shared context their freed cells are refilled out of position order and attention rounds differently)."""
    from leaplm.models.llamacpp.model import LlamaCppLM
    from leaplm.models.llamacpp.caches import LlamaCppRows

    lm = LlamaCppLM(files["target-q8_0"])
    assert lm.batch_invariant
    many = lm.new_cache(3, 64)
    assert isinstance(many, LlamaCppRows)
    assert torch.equal(scramble_then_score(lm, many, 3), scramble_then_score(lm, lm.new_cache(1, 64), 1))
    # moving a row moves its context: the moved row decodes on exactly as before, the source is left empty
    ctx = torch.randint(0, lm.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    many.truncate(0, 0)
    lm(ctx, many, last_only=True)
    many.advance(12, 0)
    many.advance(12, 1)
    before = lm(ctx[:1, :1], many.row_view(1))[0, 0]
    many.move_row(1, 0)
    assert many.lengths[:2] == [12, 0]
    assert torch.equal(lm(ctx[:1, :1], many.row_view(0))[0, 0], before)


# --- bad input: errors, never an abort -----------------------------------------------------------------------------
@needs_libllama
def test_sizes_llama_cpp_asserts_on_are_refused_first(files):
    from leaplm.models.llamacpp.model import LlamaCppLM
    from leaplm.models.llamacpp.caches import tree_parents

    lm = LlamaCppLM(files["target-q8_0"])
    cache = lm.new_cache(1, 16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm(torch.tensor([[1, lm.vocab_size]]), cache)
    with pytest.raises(ValueError, match="KV cache full"):
        lm(torch.tensor([[1] * 17]), cache)
    with pytest.raises(ValueError, match="layerskip"):
        lm(torch.tensor([[1]]), cache, layers=[0])
    long = lm.new_cache(1, 2000)
    out = lm(torch.tensor([[3] * 1200]), long, last_only=True)     # longer than one decode: split, same result
    assert out.shape == (1, 1, lm.vocab_size)
    bad = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    assert tree_parents(bad, [0, 1, 1]) == [-1, 0, 0]
    bad[2, 1] = True                                   # row 2 sees row 1 but sits at depth 1: not a tree
    with pytest.raises(ValueError, match="not a tree"):
        tree_parents(bad, [0, 1, 1])


def test_backend_choice_and_its_refusals(files, monkeypatch):
    with pytest.raises(ConfigError) as e:
        load_model(files["target"], backend="bogus")
    assert e.value.field == "backend"
    with pytest.raises(ConfigError) as e:
        load_model(files["target"], backend="llamacpp")              # not a GGUF file
    assert e.value.field == "model" and "--backend torch" in e.value.message
    with pytest.raises(ConfigError) as e:
        load_model(files["target-q8_0"], backend="llamacpp", quantization="int8")
    assert e.value.field == "quantization"
    assert load_model(files["target-q8_0"], backend="torch").backend == "torch"
    # without the extra: auto runs torch, an explicit llamacpp fails naming the extra
    import leaplm.models.llamacpp.binding as lcmod

    monkeypatch.setattr(lcmod, "_lib", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setattr(lcmod, "available", lambda: False)
    assert load_model(files["target-q8_0"]).backend == "torch"
    with pytest.raises(ConfigError, match=r"leaplm\[llamacpp\]") as e:
        load_model(files["target-q8_0"], backend="llamacpp")
    assert e.value.field == "backend"


@needs_libllama
def test_a_libllama_target_takes_a_hugging_face_draft_on_torch(files):
    eng = Engine(files["target-q8_0"], draft=files["draft"], method="draft", k=3, backend="llamacpp")
    assert (eng.backend, eng.draft.backend) == ("llamacpp", "torch")
    want = Engine(files["target-q8_0"], method="none", backend="llamacpp").generate(PROMPTS[1], greedy())
    assert eng.generate(PROMPTS[1], greedy()).token_ids == want.token_ids


@needs_libllama
def test_layerskip_is_refused_naming_the_torch_backend(files):
    with pytest.raises(ConfigError, match="--backend torch") as e:
        Engine(files["target-q8_0"], method="layerskip", k=3, backend="llamacpp")
    assert e.value.field == "method"
    assert Engine(files["target-q8_0"], method="layerskip", k=3, skip_layers=[1], backend="torch").backend == "torch"


# --- the server's path: continuous batching with chunked prefill -----------------------------------------------
@needs_libllama
@pytest.mark.parametrize("params", [greedy(24), SamplingParams(max_new_tokens=24, temperature=0.9, seed=5,
                                                               ignore_eos=True)], ids=["greedy", "seeded"])
def test_continuous_batching_with_chunked_prefill_equals_each_request_alone(files, params):
    """Rows of several methods (chains, trees, a draft model) join and leave one batch whose long prompts are
    prefilled in chunks; each request's tokens equal what it gets alone on the same backend (a seeded request's
    draws are fixed by its seed and positions, so sampled output compares token for token too)."""
    from leaplm.engine.scheduler import BatchScheduler, SeqRequest
    from leaplm.engine.table import MIN_CHUNK

    target = files["target-q8_0"]
    eng = Engine(target, draft=files["draft-q8_0"], method="draft", k=3, max_num_batched_tokens=MIN_CHUNK,
                 backend="llamacpp")
    assert eng.backend == "llamacpp"
    long = [3 + (i * 7) % 200 for i in range(90)]
    jobs = [(PROMPTS[0], "ngram"), (long, "draft"), (PROMPTS[1], "suffix"), (long[:50], "none"), (PROMPTS[2], "draft"),
            (PROMPTS[1] * 3, "lookahead")]
    outs: dict[int, list[int]] = {}
    sched = BatchScheduler(eng, max_batch=3, calibrate=False)
    sched.submit([SeqRequest(list(p), params, lambda o, i=i: outs.setdefault(i, []).extend(
        o.chunk.token_ids if o.chunk is not None else []), method=m) for i, (p, m) in enumerate(jobs)])
    sched.run_until_idle()
    for i, (p, m) in enumerate(jobs):
        alone = Engine(target, draft=files["draft-q8_0"] if m == "draft" else None, method=m, k=3, backend="llamacpp")
        assert outs[i] == alone.generate(list(p), params).token_ids, (i, m)


# --- the command line ------------------------------------------------------------------------------------------
@needs_libllama
def test_generate_names_the_backend_and_what_speculation_promises(files):
    import json

    from typer.testing import CliRunner

    from leaplm.cli import app

    runner = CliRunner()
    got = {}
    for backend in ("llamacpp", "torch"):
        res = runner.invoke(app, ["generate", "hello", "--model", files["target-q8_0"], "--backend", backend,
                                  "--method", "ngram", "--max-new-tokens", "6", "--ignore-eos", "--json"])
        assert res.exit_code == 0, res.output
        stats = json.loads(res.stdout)["stats"]
        assert stats["backend"] == backend and stats["exactness"] == "identical"
        got[backend] = json.loads(res.stdout)["samples"][0]["token_ids"]
    assert len(got["llamacpp"]) == 6
    res = runner.invoke(app, ["generate", "hello", "--model", files["target-q8_0"], "--backend", "vulkan"])
    assert res.exit_code != 0 and "--backend" in res.output


@needs_libllama
def test_head_training_loads_a_gguf_target_on_torch_whatever_auto_serves_it_on(files):
    """`train eagle --target FILE.gguf` needs the target's features and weights in torch; `auto` serves this f32
    file on libllama, which has neither."""
    from leaplm.models.llamacpp.model import LlamaCppLM
    from leaplm.training.eagle import _load_target

    assert isinstance(load_model(files["target-f32"]).model, LlamaCppLM)
    loaded = _load_target(files["target-f32"])
    assert hasattr(loaded.model, "forward_hidden") and hasattr(loaded.model, "embed_tokens")


@needs_libllama
def test_a_context_s_threads_are_set_and_the_engine_s_thread_check_times_them(files, loaded_q8):
    lm = loaded_q8.model
    cache = lm.new_cache(1, 32)
    for n in (1, 2):
        cache.set_threads(n)
        assert lm.lc.llama_n_threads(cache.ctx) == n and lm.lc.llama_n_threads_batch(cache.ctx) == n
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = Engine(loaded_q8, method="none")
        check = engine.thread_check
    finally:
        torch.set_num_threads(before)
    assert check is not None and check.threads == 2 and check.s_threads > 0 and check.s_one > 0


def test_repacked_layouts_stay_off_where_libllama_would_run_its_amx_layout(files, monkeypatch):
    """libllama's AMX weight layout (an extra buffer type, on a CPU with AMX) crashes llama_decode; where its
    system info reports AMX_INT8 = 1 the model loads without the extra buffer types and still decodes."""
    import llama_cpp

    from leaplm.models.llamacpp.model import LlamaCppLM, repack_runs_here

    real = llama_cpp.llama_print_system_info()
    amx = real.replace(b"AMX_INT8 = 1 | ", b"") + b"AMX_INT8 = 1 | "
    plain = real.replace(b"AMX_INT8 = 1 | ", b"")
    from leaplm.models.llamacpp.caches import LlamaCppCache

    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: plain)
    assert repack_runs_here(llama_cpp)
    assert LlamaCppLM(files["target-q8_0"], threads=1).repack
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: amx)
    assert not repack_runs_here(llama_cpp)
    lm = LlamaCppLM(files["target-q8_0"], threads=1)
    assert not lm.repack
    ids = torch.arange(3, 12).reshape(1, 9)                              # [1, 9]
    logits = lm(ids, LlamaCppCache(lm, 1, 16))[0]
    assert logits.shape[-1] == lm.vocab_size and torch.isfinite(logits).all()
