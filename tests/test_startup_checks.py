"""Start-up on a tiny GGUF file: a second start reads every check from the start-up cache (no timing of the
engines, no calibration, no packing of the file's blocks) and produces the same tokens; a file with more layers
than the timing takes is timed on two subsets of its layers, on both engines (libllama on copies of the file cut
to them), and its whole forward estimated from the two; a cut file holds exactly the layers asked."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "models"))
from gguf_writer import write_tiny_gguf  # noqa: E402

from leaplm.models import backend_costs  # noqa: E402
from leaplm.models.gguf import parse_gguf  # noqa: E402
from leaplm.models.gguf_truncate import layer_of, truncate_gguf  # noqa: E402


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    from leaplm.models import gguf as gguf_mod

    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LEAPLM_NO_STARTUP_CACHE", raising=False)
    monkeypatch.delenv("LEAPLM_NO_PACKED_CACHE", raising=False)
    monkeypatch.delenv("LEAPLM_RECALIBRATE", raising=False)
    gguf_mod._tokenizers.clear()


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A 4-layer Q8_0 file."""
    return write_tiny_gguf(tmp_path_factory.mktemp("deep_q8"), "Q8_0", seed=4, layers=4)[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Q8_0 file (the kernel packs its blocks directly)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny_q8"), "Q8_0", seed=3)[0]


def kernel_or_skip():
    from leaplm.kernels.build import load
    from leaplm.models.llamacpp.binding import available

    if load() is None or not available():
        pytest.skip("needs the int8 kernel's extension and libllama")


def test_the_cut_file_holds_the_first_layers_byte_for_byte(tiny, tmp_path):
    g = parse_gguf(tiny)
    whole = {n: bytes(g.raw(n).reshape(-1).view(np.uint8)) for n in g.tensors}
    fields = dict(g.fields)
    cut = parse_gguf(truncate_gguf(tiny, 1, tmp_path / "cut.gguf"))
    arch = fields["general.architecture"]
    assert cut.fields[f"{arch}.block_count"] == 1 and fields[f"{arch}.block_count"] == 2
    assert cut.fields.keys() == fields.keys()
    assert list(cut.tensors) == [n for n in g.tensors if (layer_of(n) or 0) < 1]
    assert any(layer_of(n) == 1 for n in g.tensors)
    for n in cut.tensors:
        assert bytes(cut.raw(n).reshape(-1).view(np.uint8)) == whole[n], n
    with pytest.raises(ValueError, match="has 2 layers"):
        truncate_gguf(tiny, 2, tmp_path / "none.gguf")


def test_a_cut_file_holds_the_layers_asked_renumbered_in_order(deep, tmp_path):
    g = parse_gguf(deep)
    whole = {n: bytes(g.raw(n).reshape(-1).view(np.uint8)) for n in g.tensors}
    cut = parse_gguf(truncate_gguf(deep, [3, 1], tmp_path / "cut.gguf"))
    assert cut.fields[f"{cut.fields['general.architecture']}.block_count"] == 2
    renamed = {"blk.0.": "blk.3.", "blk.1.": "blk.1."}
    for n in cut.tensors:
        src = n if layer_of(n) is None else renamed[n[:6]] + n[6:]
        assert bytes(cut.raw(n).reshape(-1).view(np.uint8)) == whole[src], n
    assert sorted(cut.tensors) == sorted(n.replace("blk.3.", "blk.0.") for n in g.tensors
                                         if layer_of(n) in (None, 1, 3))
    for bad in ([1, 1], [4], [-1]):
        with pytest.raises(ValueError, match="distinct indices"):
            truncate_gguf(deep, bad, tmp_path / "bad.gguf")


def test_the_whole_forward_is_the_larger_subset_plus_the_slope_per_layer_left_out(monkeypatch):
    monkeypatch.setattr(backend_costs, "TIMED_LAYERS", 4)
    subsets = backend_costs.timed_subsets(32)
    assert subsets == [[0, 16], [0, 8, 16, 24]]
    # head and fixed costs 10 ms, 3 ms a layer: 2 layers 16 ms, 4 layers 22 ms -> 32 layers 106 ms
    assert backend_costs.whole_ms([16.0, 22.0], subsets, 32) == pytest.approx(10 + 3 * 32)
    assert backend_costs.whole_ms([16.0, 15.0], subsets, 32) == 15.0       # noise below the slope: no layers
    assert backend_costs.whole_ms([7.0], [None], 32) == 7.0                 # timed whole
    monkeypatch.setattr(backend_costs, "TIMED_LAYERS", 1)
    with pytest.raises(ValueError, match="at least 2"):
        backend_costs.timed_subsets(32)


class Timed:
    """forward_ms, recording what each call ran: (engine, layers argument, layers in the model)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, object, int]] = []
        real = backend_costs.forward_ms

        def forward_ms(model, *a, layers=None, **kw):
            self.calls.append((type(model).__name__, layers, model.num_layers))
            return real(model, *a, layers=layers, **{**kw, "repeats": 1})
        monkeypatch.setattr(backend_costs, "forward_ms", forward_ms)


def load_kernel(p):
    from leaplm.models import load_model

    return load_model(p, quantization="gguf", backend="torch").model


def test_a_big_files_first_start_times_two_subsets_of_its_layers(deep, monkeypatch):
    kernel_or_skip()
    monkeypatch.setattr(backend_costs, "TIMED_LAYERS", 2)
    monkeypatch.setattr(backend_costs, "TIMED_BYTES", 0)          # the tiny file stands for a big one
    timed = Timed(monkeypatch)
    c = backend_costs.measure(deep, load_kernel, check_invariance=False)
    # the kernel runs layers {0, 2} (untimed: the first forwards after a load), then {0} and {0, 2} of four;
    # libllama files of one and of two layers
    assert timed.calls == [("LlamaForCausalLM", [0, 2], 4), ("LlamaForCausalLM", [0], 4),
                           ("LlamaForCausalLM", [0, 2], 4),
                           ("LlamaCppLM", None, 1), ("LlamaCppLM", None, 2)]
    assert c.layers_timed == 2 and c.layers_total == 4 and c.kernel_one_ms > 0 and c.llamacpp_one_ms > 0
    assert "estimated for 4 layers from 1 and 2 of them and the head" in \
        backend_costs.choose_by_costs("none", c).reason


def test_a_file_within_the_bound_is_timed_whole(tiny, monkeypatch):
    """Control: with the bound at the file's own 2 layers, both engines run the whole model; and a file of more
    layers than the bound but within TIMED_BYTES (the default: every file of the test) is timed whole too."""
    kernel_or_skip()
    monkeypatch.setattr(backend_costs, "TIMED_BYTES", 0)
    monkeypatch.setattr(backend_costs, "TIMED_LAYERS", 2)
    timed = Timed(monkeypatch)
    c = backend_costs.measure(tiny, load_kernel, check_invariance=False)
    assert timed.calls == [("LlamaForCausalLM", None, 2), ("LlamaCppLM", None, 2)] and c.layers_timed == 0
    monkeypatch.setattr(backend_costs, "TIMED_BYTES", 1 << 30)
    monkeypatch.setattr(backend_costs, "TIMED_LAYERS", 1)
    timed.calls.clear()
    c = backend_costs.measure(tiny, load_kernel, check_invariance=False)
    assert timed.calls == [("LlamaForCausalLM", None, 2), ("LlamaCppLM", None, 2)] and c.layers_timed == 0


def test_a_second_start_measures_nothing_and_packs_nothing(tiny, monkeypatch):
    """Two engines in turn, as two starts would build them (backend auto, an adaptive K that calibrates): the
    second times neither engine, calibrates nothing and packs no block, and its greedy tokens are the first's."""
    kernel_or_skip()
    from leaplm.config import SamplingParams
    from leaplm.engine import startup_checks
    from leaplm.engine.engine import Engine
    from leaplm.models import gguf as gguf_mod
    from leaplm.quant import linear

    counts = {"measure": 0, "calibrate": 0, "pack": 0}

    def counting(name, fn):
        def wrapped(*a, **kw):
            counts[name] += 1
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(backend_costs, "measure", counting("measure", backend_costs.measure))
    monkeypatch.setattr(startup_checks, "calibrate", counting("calibrate", startup_checks.calibrate))
    monkeypatch.setattr(linear, "pack_gguf", counting("pack", linear.pack_gguf))
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    outs = []
    for start in (1, 2):
        before = dict(counts)
        gguf_mod._tokenizers.clear()
        e = Engine(tiny, method="ngram", k=3)
        outs.append(e.generate("abc abc abc", params).token_ids)
        if start == 1:
            assert counts["measure"] == 1 and counts["calibrate"] == 1 and counts["pack"] > 0
        else:
            assert counts == before, counts
        del e
    assert outs[0] == outs[1]


def test_the_calibration_of_a_big_model_runs_its_first_layers(tiny, monkeypatch):
    """The cost calibration and the thread check time the first TIMED_LAYERS layers of a deeper quantized model
    larger than TIMED_BYTES, their times scaled by the weight bytes; with the bound at the model's depth (the
    control) they run it whole, as they do a model within TIMED_BYTES."""
    kernel_or_skip()
    import torch

    from leaplm.engine.engine import Engine
    from leaplm.engine import startup_checks
    from leaplm.engine.kpolicy import calibrate as cal

    monkeypatch.setenv("LEAPLM_NO_STARTUP_CACHE", "1")
    e = Engine(tiny, method="ngram", k=3, backend="torch", quantization="gguf")
    m = e.model
    seen: list = []
    real = m.forward
    monkeypatch.setattr(m, "forward", lambda *a, **kw: seen.append(kw.get("layers")) or real(*a, **kw))
    q = m.quantized
    run = sum(lin.nbytes for n, lin in q.items() if not n.startswith("layers.1."))
    for bound, want, scale in ((1, range(1), sum(lin.nbytes for lin in q.values()) / run), (2, None, 1.0)):
        monkeypatch.setattr(backend_costs, "TIMED_LAYERS", bound)
        monkeypatch.setattr(backend_costs, "TIMED_BYTES", 0)                # the tiny model stands for a big one
        assert cal.layer_subset(m).scale == pytest.approx(scale, rel=1e-12)
        seen.clear()
        e.estimates.calibrated_rows.clear()
        cal.calibrate(e, max_rows=1, ctx=8, repeats=2)
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            check = startup_checks.check_threads(e, tries=2)
        finally:
            torch.set_num_threads(threads)
        assert check is not None and seen and all(s == want for s in seen), (bound, seen)
    assert scale == 1.0 < sum(lin.nbytes for lin in q.values()) / run
    monkeypatch.setattr(backend_costs, "TIMED_LAYERS", 1)
    monkeypatch.setattr(backend_costs, "TIMED_BYTES", 1 << 30)
    assert cal.layer_subset(m).layers is None and cal.layer_subset(m).scale == 1.0
