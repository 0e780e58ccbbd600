"""Build the quantized-linear extension on first use, cache it, and pick its SIMD path by trying it.

The build runs once per source version (torch caches it under TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions). Without a compiler, or with LEAPLM_NO_EXTENSION=1, `load()` returns None and
callers use the pure-PyTorch path, saying so in the log.

The AVX2 path is chosen by running it once in a forked child on a small problem, compared with the scalar path:
cpuid flags alone are not trusted (this project's VM advertises AMX whose instructions raise SIGILL).
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qlinear.cpp")


@dataclass
class Extension:
    module: object          # the compiled module: module.qlinear(x, q, scale, minv, bias, int4, avx2)
    avx2: bool              # the AVX2 path ran correctly here
    why: str                # how the path was chosen, for logs and `leaplm bench --roofline`


_lock = threading.Lock()
_state: dict[str, Extension | None | str] = {}


def unavailable_reason() -> str | None:
    """Why the extension cannot be built here, or None when it can be tried."""
    if os.environ.get("LEAPLM_NO_EXTENSION") == "1":
        return "LEAPLM_NO_EXTENSION=1"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler found (set CXX or install g++)"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja not found (pip install 'leaplm[kernels]')"
    return None


def load() -> Extension | None:
    """The extension, built and probed once per process; None (logged once) when it cannot be had."""
    with _lock:
        if "ext" in _state:
            return _state["ext"]
        ext = None
        reason = unavailable_reason()
        if reason is None:
            try:
                ext = _build()
            except Exception as e:   # compiler errors come in many types; the fallback still runs
                reason = f"build failed: {type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}"
        if ext is None:
            log.warning("quantized linear: C++ extension unavailable (%s); using the pure-PyTorch path "
                        "(dequantize per call: slower, and a row's result may depend on the batch shape)", reason)
        else:
            log.info("quantized linear: C++ extension loaded (%s)", ext.why)
        _state["ext"] = ext
        return ext


def _build() -> Extension:
    import hashlib

    from torch.utils.cpp_extension import load as cpp_load

    tag = hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:10]
    module = cpp_load(name=f"leaplm_qlinear_{tag}", sources=[str(SOURCE)], extra_cflags=["-O3"], verbose=False)
    avx2, why = _probe_avx2(module)
    return Extension(module, avx2, why)


def _probe_avx2(module) -> tuple[bool, str]:
    """Run the AVX2 path in a forked child (a SIGILL kills only the child) and compare it with the scalar path."""
    import torch

    if not hasattr(os, "fork"):
        return False, "scalar path (no fork to probe AVX2 safely)"
    pid = os.fork()
    if pid == 0:                                   # child: tiny single-threaded problem, exit code says the result
        code = 1
        try:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(3, 64, generator=g)
            q8 = torch.randint(-127, 128, (5, 64), dtype=torch.int8, generator=g)
            q4 = torch.randint(0, 256, (5, 32), dtype=torch.uint8, generator=g)
            s, m = torch.rand(5, 2, generator=g), torch.randn(5, 2, generator=g)
            ok = all(torch.equal(module.qlinear(x, q, s, m, None, i4, True), module.qlinear(x, q, s, m, None, i4, False))
                     for q, i4 in ((q8, False), (q4, True)))
            code = 0 if ok else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return False, f"scalar path (the AVX2 probe died with {signal.Signals(sig).name})"
    code = os.WEXITSTATUS(status)
    if code == 0:
        return True, "AVX2+FMA path (probed: runs and matches the scalar path bit for bit)"
    return False, f"scalar path (the AVX2 probe {'disagreed with the scalar path' if code == 3 else 'failed'})"
