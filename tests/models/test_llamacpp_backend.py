"""`--backend auto` for GGUF targets (models/loading.auto_backend): a file of the kernel's types runs on the engine
the start-up measurement says is faster for the method (models/backend_costs.py; the timings are injected here, so
the choice is tested against known costs; one test times the real engines), on leaplm's int8 kernel (torch,
quantization 'gguf') when libllama is not installed, unless the file would take more than half the memory
available; other weight types on libllama; the choice and its reason reach the engine, `generate --json` and
/metrics."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from leaplm.config import SamplingParams
from leaplm.engine.engine import Engine
from leaplm.models.gguf_export import export_gguf
from leaplm.models.llamacpp.binding import available
from leaplm.models import backend_costs
from leaplm.models.backend_costs import BackendCosts, choose_by_costs
from leaplm.models.loading import BackendChoice, auto_backend, choose_target_backend, kernel_weight_type

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_writer import _root_conftest  # noqa: E402
from test_llamacpp import write_eot_tokenizer  # noqa: E402

needs_libllama = pytest.mark.skipif(not available(), reason="the llamacpp extra (llama-cpp-python) is not installed")

Q4_1_FILE = {"token_embd.weight": "Q8_0", "output_norm.weight": "F32", "blk.0.attn_norm.weight": "F32",
             "blk.0.attn_q.weight": "Q4_1", "blk.0.ffn_down.weight": "Q4_1", "blk.0.attn_v.weight": "Q8_0"}


def test_kernel_weight_type_reads_the_decoder_matrices():
    assert kernel_weight_type(Q4_1_FILE) == "Q4_1"                     # the most common; Q8_0 beside it is fine
    assert kernel_weight_type({**Q4_1_FILE, "blk.1.ffn_up.weight": "Q5_1"}) is None
    # a Q4_K_M file: Q5_0 where a row is not a multiple of 256, Q4_K / Q6_K ffn_down, Q8_0 attn_v
    q4_k_m = {"blk.0.attn_q.weight": "Q5_0", "blk.0.attn_k.weight": "Q5_0", "blk.0.attn_v.weight": "Q8_0",
              "blk.0.ffn_gate.weight": "Q5_0", "blk.0.ffn_up.weight": "Q5_0", "blk.0.ffn_down.weight": "Q6_K",
              "blk.1.attn_q.weight": "Q5_0", "blk.1.ffn_down.weight": "Q4_K"}
    assert kernel_weight_type(q4_k_m) == "Q5_0"
    # q/k/v in the kernel's int4 and int6 formats (two row blocks of one linear) still go to the kernel
    assert kernel_weight_type({**q4_k_m, "blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q4_K",
                               "blk.0.attn_v.weight": "Q6_K"}) in ("Q4_K", "Q5_0")
    assert kernel_weight_type({**Q4_1_FILE, "blk.0.attn_q.weight": "F16"}) is None
    assert kernel_weight_type({"token_embd.weight": "F32", "blk.0.attn_q.weight": "F32"}) is None    # an f32 file
    assert kernel_weight_type({"token_embd.weight": "Q4_1"}) is None                                 # no decoder


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix", "lookahead", "eagle", "medusa"])
def test_auto_puts_speculation_on_quantized_blocks_on_the_kernel(method):
    got = auto_backend(method, "Q4_1", None, 10 * 2**20, 2**30)
    assert (got.backend, got.quantization) == ("torch", "gguf")
    assert method in got.reason and "Q4_1" in got.reason and "int8 kernel" in got.reason


def test_auto_puts_plain_decoding_there_too_unless_memory_is_short():
    none = auto_backend("none", "Q4_1", None, 10 * 2**20, None)
    assert (none.backend, none.quantization) == ("torch", "gguf") and "plain decoding" in none.reason
    q4_7b = auto_backend("ngram", "Q4_1", None, 4 * 2**30, 24 * 2**30)          # a 7B Q4_1 file: about 4 GiB
    assert (q4_7b.backend, q4_7b.quantization) == ("torch", "gguf")             # held as stored, never dequantized
    big = auto_backend("ngram", "Q4_1", None, 16 * 2**30, 24 * 2**30)
    assert (big.backend, big.quantization) == ("auto", None) and "more than half the memory" in big.reason


def test_auto_leaves_the_rest_to_libllama():
    other = auto_backend("ngram", None, None)
    assert (other.backend, other.quantization) == ("auto", None) and "Q4_0/Q4_1/Q4_K" in other.reason
    nokernel = auto_backend("ngram", "Q8_0", "no C++ compiler found")
    assert (nokernel.backend, nokernel.quantization) == ("auto", None) and "no C++ compiler" in nokernel.reason


KERNEL_FASTER = BackendCosts(kernel_one_ms=6.0, kernel_block_ms=17.0, llamacpp_one_ms=9.0, llamacpp_block_ms=37.0,
                             llamacpp_invariant=True, threads=2)


@pytest.fixture(autouse=True)
def _injected_costs(monkeypatch):
    """The start-up timing returns KERNEL_FASTER unless a test injects other costs (a real timing of tiny models
    is noise: which engine wins would change from run to run)."""
    calls = []

    def fake(path, load_kernel, check_invariance=True):
        calls.append(path)
        return KERNEL_FASTER
    monkeypatch.setattr(backend_costs, "measure", fake)
    return calls


def test_the_choice_follows_the_measured_costs():
    mk = lambda **kw: BackendCosts(**{**KERNEL_FASTER.__dict__, **kw})   # noqa: E731
    assert choose_by_costs("none", KERNEL_FASTER).backend == "torch"
    assert choose_by_costs("ngram", KERNEL_FASTER).backend == "torch"
    slow_one = mk(kernel_one_ms=9.5)                  # libllama's one-token forward is faster: plain decoding there
    assert choose_by_costs("none", slow_one).backend == "llamacpp"
    assert choose_by_costs("ngram", slow_one).backend == "torch"         # the block still favours the kernel
    slow_block = mk(kernel_block_ms=40.0)
    assert choose_by_costs("ngram", slow_block).backend == "llamacpp"
    # where libllama's blocks round differently, a speculating method stays on the kernel (greedy identity)
    assert choose_by_costs("ngram", mk(kernel_block_ms=40.0, llamacpp_invariant=False)).backend == "torch"
    why = choose_by_costs("draft", slow_block).reason
    assert "40.00 ms" in why and "37.00 ms" in why and "draft" in why and "2 threads" in why
    got = auto_backend("none", "Q4_1", None, 10 * 2**20, 2**30, slow_one)
    assert (got.backend, got.quantization) == ("llamacpp", None) and "9.50 ms" in got.reason
    got = auto_backend("ngram", "Q4_1", None, 10 * 2**20, 2**30, slow_one)
    assert (got.backend, got.quantization) == ("torch", "gguf") and "Q4_1 blocks" in got.reason
    # memory comes first: a file too large for the kernel's copy is not timed there
    big = auto_backend("ngram", "Q4_1", None, 16 * 2**30, 24 * 2**30, KERNEL_FASTER)
    assert big.backend == "auto"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("backend_choice")
    tok = write_eot_tokenizer(d / "tok")
    hf = _root_conftest().write_family_checkpoint(d / "target", "llama_tied", tok)
    return {"hf": hf, "draft": _root_conftest().write_family_checkpoint(d / "draft", "llama_draft", tok),
            **{kind: str(export_gguf(hf, str(d / f"target-{kind}.gguf"), kind).path) for kind in ("f32", "q8_0")}}


@needs_libllama
def test_choose_target_backend_on_files(files):
    from leaplm.kernels.build import unavailable_reason

    kernel = unavailable_reason() is None
    assert choose_target_backend(files["q8_0"], "ngram") == (
        BackendChoice("torch", "gguf", auto_backend("ngram", "Q8_0", None, costs=KERNEL_FASTER).reason) if kernel
        else BackendChoice("llamacpp", None, auto_backend("ngram", "Q8_0", unavailable_reason()).reason
                           + "; GGUF files run on libllama"))
    assert choose_target_backend(files["q8_0"], "none").backend == ("torch" if kernel else "llamacpp")
    assert choose_target_backend(files["f32"], "ngram").backend == "llamacpp"
    assert choose_target_backend(files["q8_0"], "ngram", backend="llamacpp") == BackendChoice(
        "llamacpp", None, "--backend llamacpp")
    assert choose_target_backend(files["q8_0"], "ngram", quantization="int8").quantization is None
    assert choose_target_backend(files["hf"], "ngram").reason == "not a GGUF file"
    assert choose_target_backend(files["q8_0"], "ngram", dtype="bfloat16").backend == "auto"


@needs_libllama
def test_the_engine_follows_the_choice_and_stays_identical_to_plain_decoding_on_its_path(files):
    from leaplm.kernels.build import unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"leaplm's int8 kernel cannot be built here ({unavailable_reason()})")
    greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    spec = Engine(files["q8_0"], method="ngram", k=4)
    assert (spec.backend, spec.exactness) == ("torch", "identical") and "int8 kernel" in spec.backend_reason
    assert spec.target.model.quantized                               # the file's blocks on the kernel
    plain = Engine(files["q8_0"], method="none")                      # auto: the same path as speculation
    assert plain.backend == "torch" and plain.target.model.quantized and "plain decoding" in plain.backend_reason
    assert spec.generate([1, 2, 3, 1, 2], greedy).token_ids == plain.generate([1, 2, 3, 1, 2], greedy).token_ids
    f32 = Engine(files["f32"], method="none")
    assert f32.backend == "llamacpp" and "Q4_0/Q4_1/Q4_K" in f32.backend_reason


@needs_libllama
def test_a_draft_beside_the_kernel_is_packed_too_and_stays_identical_to_plain_decoding(files):
    from leaplm.kernels.build import unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"leaplm's int8 kernel cannot be built here ({unavailable_reason()})")
    greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    spec = Engine(files["q8_0"], draft=files["draft"], method="draft", k=4, adaptive_k=False)
    assert spec.backend == "torch" and spec.target.model.quantized
    assert spec.draft.model.quantized                                # the Hugging Face draft in int8 blocks too
    plain = Engine(files["q8_0"], method="none")
    for prompt in ([1, 2, 3, 1, 2], [7, 3, 9]):
        assert spec.generate(prompt, greedy).token_ids == plain.generate(prompt, greedy).token_ids


@needs_libllama
def test_generate_json_reports_the_reason(files):
    from typer.testing import CliRunner

    from leaplm.cli import app

    res = CliRunner().invoke(app, ["generate", "hello", "--model", files["f32"], "--method", "none",
                                   "--max-new-tokens", "4", "--ignore-eos", "--json"])
    assert res.exit_code == 0, res.output
    stats = json.loads(res.stdout)["stats"]
    assert stats["backend"] == "llamacpp" and "Q4_0/Q4_1/Q4_K" in stats["backend_reason"]


@needs_libllama
def test_serve_checks_a_catalog_name_as_its_fetched_file(files, monkeypatch):
    """`leaplm serve --model smollm2` checks the model before loading it in the background (check_source): the
    catalog name resolves to its fetched file there too, or is refused naming the command that fetches it."""
    from leaplm.config import ConfigError
    from leaplm.models import catalog
    from leaplm.models.loading import check_source

    monkeypatch.setattr(catalog, "fetched", lambda name: Path(files["q8_0"]))
    check_source("smollm2")
    monkeypatch.setattr(catalog, "fetched", lambda name: None)
    with pytest.raises(ConfigError, match="leaplm models fetch smollm2") as e:
        check_source("smollm2")
    assert e.value.field == "model"


@needs_libllama
def test_the_measurement_is_taken_once_per_file_and_machine(files, tmp_path, monkeypatch, _injected_costs):
    from leaplm.kernels.build import unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"leaplm's int8 kernel cannot be built here ({unavailable_reason()})")
    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LEAPLM_NO_STARTUP_CACHE", raising=False)
    slow_one = BackendCosts(**{**KERNEL_FASTER.__dict__, "kernel_one_ms": 12.0})
    monkeypatch.setattr(backend_costs, "measure", lambda path, load, check=True: _injected_costs.append(path) or slow_one)
    assert choose_target_backend(files["q8_0"], "none").backend == "llamacpp"      # follows the measurement
    assert choose_target_backend(files["q8_0"], "ngram").backend == "torch"
    assert len(_injected_costs) == 1                                             # the second start read the cache
    monkeypatch.setenv("LEAPLM_RECALIBRATE", "1")
    choose_target_backend(files["q8_0"], "none")
    assert len(_injected_costs) == 2


@needs_libllama
def test_both_engines_are_timed_for_real(files, monkeypatch):
    from leaplm.kernels.build import unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"leaplm's int8 kernel cannot be built here ({unavailable_reason()})")
    from leaplm.models import load_model

    monkeypatch.undo()                                   # the real measure()
    load = lambda p: load_model(p, quantization="gguf", backend="torch").model      # noqa: E731
    c = backend_costs.measure(files["q8_0"], load)
    assert min(c.kernel_one_ms, c.kernel_block_ms, c.llamacpp_one_ms, c.llamacpp_block_ms) > 0
    assert isinstance(c.llamacpp_invariant, bool) and c.threads >= 1
    plain = backend_costs.measure(files["q8_0"], load, check_invariance=False)
    assert plain.llamacpp_invariant is None and min(plain.llamacpp_one_ms, plain.llamacpp_block_ms) > 0


@needs_libllama
def test_plain_decoding_leaves_the_invariance_check_to_the_first_speculating_start(files, tmp_path, monkeypatch,
                                                                                  _injected_costs):
    from leaplm.kernels.build import unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(f"leaplm's int8 kernel cannot be built here ({unavailable_reason()})")
    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LEAPLM_NO_STARTUP_CACHE", raising=False)
    asked, checks = [], []
    block_on_libllama = {**KERNEL_FASTER.__dict__, "kernel_block_ms": 50.0}   # one token: kernel; blocks: libllama

    def measure(path, load, check=True):
        asked.append(check)
        return BackendCosts(**{**block_on_libllama, "llamacpp_invariant": True if check else None})

    monkeypatch.setattr(backend_costs, "measure", measure)
    monkeypatch.setattr(backend_costs, "llamacpp_invariant", lambda path: checks.append(path) or invariant)
    invariant = False
    assert choose_target_backend(files["q8_0"], "none").backend == "torch"
    assert asked == [False] and checks == []
    assert choose_target_backend(files["q8_0"], "ngram").backend == "torch"      # not invariant: the kernel
    assert asked == [False] and checks == [files["q8_0"]]                         # the check added, timings kept
    invariant = True
    assert choose_target_backend(files["q8_0"], "ngram").backend == "torch"      # the entry's answer, not asked again
    assert choose_target_backend(files["q8_0"], "none").backend == "torch"
    assert asked == [False] and len(checks) == 1
    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path / "other"))                 # a machine where it is invariant
    assert choose_target_backend(files["q8_0"], "none").backend == "torch"
    assert choose_target_backend(files["q8_0"], "ngram").backend == "llamacpp"
    assert asked == [False, False] and len(checks) == 2


def count_loads(monkeypatch) -> list[str]:
    """The backends of every model load the engine makes from here on."""
    import leaplm.engine.engine as engine_module

    loads, load = [], engine_module.load_model

    def counted(name, *args, **kw):
        got = load(name, *args, **kw)
        loads.append(got.backend)
        return got

    monkeypatch.setattr(engine_module, "load_model", counted)
    return loads


@needs_libllama
def test_auto_loads_the_target_once_from_the_cached_batch_variance_check(files, tmp_path, monkeypatch):
    """An f32 file (a type the int8 kernel does not take) goes to libllama, and a speculating method leaves it for
    torch where libllama is not batch-invariant. The first start on a machine measures the check on the loaded
    model (two loads when it fails); every later start reads it from the start-up cache and loads once, on the
    backend the first start ended on."""
    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path))
    monkeypatch.delenv("LEAPLM_NO_STARTUP_CACHE", raising=False)
    loads = count_loads(monkeypatch)
    first = Engine(files["f32"], method="ngram", k=4)
    invariant = first.backend == "llamacpp"
    assert loads == (["llamacpp"] if invariant else ["llamacpp", "torch"])
    loads.clear()
    again = Engine(files["f32"], method="ngram", k=4)
    assert loads == [first.backend] and again.backend == first.backend
    loads.clear()
    Engine(files["f32"], method="none")                    # plain decoding: libllama whatever the check says
    assert loads == ["llamacpp"]


@needs_libllama
@pytest.mark.parametrize("variance", [0.25, 0.0])
def test_a_cached_check_decides_the_backend_before_loading(files, tmp_path, monkeypatch, variance):
    """With the check's result in the start-up cache (as a start on this machine wrote it), the target loads once:
    on torch where libllama moved a logit, on libllama where it did not. A result kept for another thread count
    is not this one's: that start measures."""
    import torch

    from leaplm import startup_cache
    from leaplm.models.llamacpp.binding import libllama
    from leaplm.models.llamacpp.model import KV_TYPES, repack_runs_here, variance_key

    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path))
    monkeypatch.delenv("LEAPLM_NO_STARTUP_CACHE", raising=False)
    lc = libllama()
    n = torch.get_num_threads()
    key = variance_key(lc, files["f32"], n + 1, KV_TYPES["auto"], repack_runs_here(lc), True,
                       lc.LLAMA_FLASH_ATTN_TYPE_ENABLED)
    startup_cache.write_json("batch-variance", key, {"variance": variance, "flash_attn": 1})
    loads = count_loads(monkeypatch)
    Engine(files["f32"], method="ngram", k=4)
    assert loads[0] == "llamacpp"                           # another thread count's entry: measured here
    key = variance_key(lc, files["f32"], n, KV_TYPES["auto"], repack_runs_here(lc), True,
                       lc.LLAMA_FLASH_ATTN_TYPE_ENABLED)
    startup_cache.write_json("batch-variance", key, {"variance": variance, "flash_attn": 1})
    loads.clear()
    eng = Engine(files["f32"], method="ngram", k=4)
    assert loads == ["torch" if variance else "llamacpp"] and eng.backend == loads[0]
    if variance:
        assert "not batch-invariant" in eng.backend_reason and "cached" in eng.backend_reason
