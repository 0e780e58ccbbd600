"""The int8 kernel's entry points (a quantized linear, the C++ layer loop) run without the GIL, so the server's
event loop thread runs while the scheduler thread is inside a forward. Checked by a thread that stamps the clock
the moment it gets the GIL, with forced switching turned off: where a call keeps the GIL, the stamp can only come
after the call returned; the negative control (a call that keeps it) shows that. The results are kept until the
end: freeing a tensor lets the GIL go too (torch's deallocation), which would let the thread in between calls."""
from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from leaplm.kernels.build import load, unavailable_reason
from leaplm.quant.formats import quantize
from leaplm.quant.linear import pack

needs_ext = pytest.mark.skipif(unavailable_reason() is not None,
                               reason=f"C++ extension cannot be built here: {unavailable_reason()}")


def another_thread_ran_inside(call, tries: int = 5) -> bool:
    """Whether a thread waiting for the GIL ran while `call()` was running, in any of `tries` calls."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)                   # no forced switch: the GIL changes hands only where it is let go
    stamp: list[float] = []
    go = threading.Event()
    t = threading.Thread(target=lambda: (go.wait(), stamp.append(time.perf_counter())))
    t.start()
    spans, kept = [], []
    try:
        go.set()
        for _ in range(tries):
            t0 = time.perf_counter()
            kept.append(call())
            spans.append((t0, time.perf_counter()))
            if stamp:
                break
    finally:
        t.join()
        sys.setswitchinterval(old)
    return any(a <= stamp[0] <= b for a, b in spans)


@needs_ext
def test_a_quantized_linear_lets_other_threads_run():
    ext = load()
    g = torch.Generator().manual_seed(0)
    p = pack(quantize(torch.randn(2048, 2048, generator=g), "int8"))      # ~100 M multiply-adds a call
    x = torch.randn(24, 2048, generator=g)
    # ten calls a try (each well under a millisecond), so the waiting thread is scheduled on a busy machine
    assert another_thread_ran_inside(
        lambda: [ext.module.qlinear(x, p.q, p.scale, p.minv, None, p.rows, ext.path) for _ in range(10)], tries=20)


@needs_ext
def test_the_layer_loop_lets_other_threads_run(tmp_path):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_fused import write_tiny_llama
    from leaplm.models import load_model

    path = write_tiny_llama(tmp_path, vocab=40, layers=4, hidden=256, heads=4, kv_heads=2, seed=5)
    m = load_model(path, quantization="int8").model
    fused = m.fused_layers()
    assert fused is not None
    B, T, S = 1, 32, 32
    cache = m.new_cache(B, S)
    x = torch.randn(B * T, m.args.hidden_size)                                 # [B * T, hid]
    pos = torch.arange(T).view(1, T)                                           # [B, T]
    args = (x, B, T, cache.k, cache.v, cache.lengths[:B], pos, torch.empty(0, dtype=torch.bool), fused.cis,
            list(range(m.args.num_hidden_layers)), T)
    assert another_thread_ran_inside(lambda: [fused.decoder.forward(*args) for _ in range(20)])


def test_negative_control_a_call_that_keeps_the_gil():
    data = list(range(2_000_000, 0, -1))
    assert not another_thread_ran_inside(lambda: sorted(data))               # C code that never lets the GIL go
