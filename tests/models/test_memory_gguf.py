"""What a GGUF file on the int8 kernel holds in memory: no fp32 copy of any quantized tensor (nothing dequantizes
a matrix at load or while generating: only the T embedding rows a forward looks up), each matrix once (the packed
form only, the token embedding read from the mapped file), and packing's temporaries bounded by a chunk of rows,
not by the matrix (a K-quant's integers widen to several times its blocks while they are converted)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gguf_writer import write_tiny_gguf
from leaplm.kernels.build import unavailable_reason
from leaplm.models import gguf as gguf_mod
from leaplm.models import load_model
from leaplm.quant import apply, formats, linear

needs_ext = pytest.mark.skipif(unavailable_reason() is not None,
                               reason=f"C++ extension cannot be built here: {unavailable_reason()}")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def dequantized(monkeypatch):
    """Rows of every dequantize call (quant/formats.py, wherever it was imported) while the test runs."""
    rows: list[int] = []
    real = formats.dequantize

    def counted(qw):
        rows.append(qw.q.shape[0] if qw.q.dim() == 2 else qw.q.numel() // qw.q.shape[-1])
        return real(qw)

    for mod in (formats, linear, apply):
        monkeypatch.setattr(mod, "dequantize", counted)
    return rows


@needs_ext
@pytest.mark.parametrize("qtype,tied", [("Q4_K_M", False), ("Q4_K_M", True), ("Q8_0", True), ("Q4_0", False)])
def test_no_fp32_copy_of_a_quantized_tensor_at_load_or_while_generating(tmp_path, qtype, tied, dequantized):
    from leaplm.config import SamplingParams
    from leaplm.engine.engine import Engine

    path = write_tiny_gguf(tmp_path, qtype, tied=tied)[0]
    before = gguf_mod.DEQUANTIZED_BYTES[0]
    lm = load_model(path, quantization="gguf")
    m = lm.model
    assert gguf_mod.DEQUANTIZED_BYTES[0] == before and dequantized == []
    # each matrix once: the packed form alone (no unpacked QuantizedWeight kept beside it), the embedding in the file
    lins = [p for lin in m.quantized.values() for p in lin.parts]
    assert lins and all(p.packed is not None and p._weight is None for p in lins)
    assert all(not isinstance(getattr(m.embed_quantized, f, None), torch.Tensor) for f in vars(m.embed_quantized))
    out = Engine(lm, method="ngram", k=3, adaptive_k=False).generate(
        "ab ab ab cd ab", SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    assert len(out.token_ids) == 12
    # while generating, only the looked-up embedding rows were dequantized: never a matrix's V or N rows
    assert gguf_mod.DEQUANTIZED_BYTES[0] == before
    assert dequantized and max(dequantized) <= len(out.prompt_ids) + 12
    # control: the counter sees a matrix dequantized (embed_weight: the whole embedding, for EAGLE heads)
    m.embed_weight()
    assert max(dequantized) == m.args.vocab_size


PEAK = textwrap.dedent("""
    import sys
    import numpy as np
    from leaplm.quant.formats import from_gguf_blocks
    from leaplm.quant.linear import PACK_CHUNK_WEIGHTS, QuantizedLinear, pack_gguf_chunked

    N, K = 8192, 4096                                 # 32M weights: Q6_K blocks of 27 MB
    # random Q6_K super-blocks (210 bytes: ql, qh, 16 int8 scales, an fp16 d), d a finite fp16
    raw = np.random.default_rng(0).integers(0, 256, (N, K // 256, 210), dtype=np.uint8)
    raw[..., 208:210] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    raw = raw.reshape(N, -1)

    def rss(field):
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))

    open("/proc/self/clear_refs", "w").write("5")     # the high-water mark restarts from here
    base = rss("VmRSS")
    if sys.argv[1] == "chunked":
        lin = QuantizedLinear.from_packed(pack_gguf_chunked([(raw, "Q6_K", None)], K))
    else:                                             # the whole matrix converted, then packed
        lin = QuantizedLinear(from_gguf_blocks(raw, "Q6_K", (N, K)), "extension")
    print(rss("VmHWM") - base, lin.nbytes, PACK_CHUNK_WEIGHTS)
""")


def peak(how: str) -> tuple[int, int, int]:
    """(bytes the high-water mark rose by while packing, bytes the packed weight holds, weights per chunk)."""
    run = subprocess.run([sys.executable, "-c", PEAK, how], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(Path(linear.__file__).parents[2])})
    assert run.returncode == 0, run.stderr[-2000:]
    return tuple(int(v) for v in run.stdout.split())


@needs_ext
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable VmHWM")
def test_packing_a_k_quant_peaks_at_its_packed_bytes_plus_a_chunk_s_temporaries():
    # a chunk's temporaries: Q6_K's conversion widens each weight through int16 arrays (at most ~16 bytes a
    # weight alive at once), then pack's padded and permuted copies (1-2 bytes a weight); 32 MB for the allocator
    rise, held, chunk = peak("chunked")
    bound = held + 16 * chunk + (32 << 20)
    assert rise <= bound, (rise, bound)
    # control: converting the whole matrix first exceeds the bound
    rise_whole, _, _ = peak("whole")
    assert rise_whole > bound, (rise_whole, bound)
