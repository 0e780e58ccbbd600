"""Build the quantized-linear extension on first use, cache it, and pick its SIMD path by trying it.

The build runs once per source version, torch version and flags (under TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions); later processes import the built library directly. Without a compiler, or with LEAPLM_NO_EXTENSION=1, `load()` returns None and
callers use the pure-PyTorch path, saying so in the log.

The SIMD path (AMX, else AVX-512 VNNI, else AVX2, else scalar) is chosen by running each once in a forked child on small
problems, compared bit for bit with the scalar path: cpuid flags alone are not trusted (some VMs advertise
instructions that raise SIGILL).
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
# the kernel's parts (one job each: activations, each instruction set's block products, the driver, the layer
# loop, ...), included by SOURCE as one translation unit and copied beside it for the build; every byte of them is
# in the build's tag, so an edit to any part builds again
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
CFLAGS = ["-O3"]


PATHS = {0: "scalar", 1: "AVX2", 2: "AVX-512 VNNI", 3: "AMX"}   # the kernel's `path` argument -> name
SIMD_PATHS = (3, 2, 1)                                       # tried in this order; the first that passes runs


@dataclass
class Extension:
    module: object          # the compiled module: module.qlinear(x, qp, sp, mp, bias, n, path) over PackedWeights
    path: int               # the fastest path that ran correctly here (a key of PATHS)
    why: str                # how the path was chosen, for logs and `leaplm bench --roofline`
    amx_tokens: dict[str, list[int]] | None = None   # AMX path: the block sizes run as tile products (tune_amx)

    @property
    def path_name(self) -> str:
        return PATHS[self.path]


_lock = threading.Lock()
_state: dict[str, Extension | None | str] = {}


def unavailable_reason() -> str | None:
    """Why the extension cannot be had here, or None when it can be tried. A library built before needs neither
    the compiler nor ninja (nor torch's build tools, whose import costs a tenth of a second)."""
    if os.environ.get("LEAPLM_NO_EXTENSION") == "1":
        return "LEAPLM_NO_EXTENSION=1"
    if built_library().done.exists():
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler found (set CXX or install g++)"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja not found (pip install 'leaplm[kernels]')"
    return None


@dataclass(frozen=True)
class BuiltLibrary:
    """Where this source's build lives (one per source, torch version and flags)."""
    tag: str                # hash of the source, torch's version and the flags
    name: str               # the module's name, leaplm_qlinear_<tag>
    build_dir: Path
    lib: Path               # the compiled module
    done: Path              # written after a build completed: the library is whole


def built_library() -> BuiltLibrary:
    import hashlib
    import sys
    import sysconfig

    import torch
    from torch._appdirs import user_cache_dir

    src = b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in (SOURCE, *HEADERS))
    tag = hashlib.sha1(src + torch.__version__.encode() + " ".join(CFLAGS).encode()).hexdigest()[:10]
    name = f"leaplm_qlinear_{tag}"
    # torch.utils.cpp_extension's build directory (its _get_build_directory), without importing the build tools
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        acc = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None else
               f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(user_cache_dir(appname="torch_extensions")),
                            f"{py}_{acc}")
    build_dir = Path(root) / name
    return BuiltLibrary(tag, name, build_dir, build_dir / f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}",
                        build_dir / "leaplm-built")


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
    """The compiled module: imported directly when this source was built before (by any process, from any
    checkout), else built by torch.utils.cpp_extension from a copy of the source kept beside the build, so the
    build's inputs do not depend on where the package lives."""
    import importlib.util

    b = built_library()
    tag, name, build_dir, lib, done = b.tag, b.name, b.build_dir, b.lib, b.done
    module = None
    if done.exists() and lib.exists():
        try:
            spec = importlib.util.spec_from_file_location(name, lib)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except (ImportError, OSError) as e:
            log.info("quantized linear: the built library %s does not load (%s); building it again", lib, e)
            module = None
    if module is None:
        from torch.utils.cpp_extension import load as cpp_load

        build_dir.mkdir(parents=True, exist_ok=True)
        for f in (*HEADERS, SOURCE):
            copy, text = build_dir / f.name, f.read_bytes()
            if not copy.exists() or copy.read_bytes() != text:
                tmp = build_dir / f".{f.name}.{os.getpid()}"
                tmp.write_bytes(text)
                os.replace(tmp, copy)
        module = cpp_load(name=name, sources=[str(build_dir / SOURCE.name)], extra_cflags=CFLAGS, build_directory=str(build_dir),
                          verbose=False)
        done.write_text(tag)
    path, why = cached_path(module, tag)
    if path == 0:
        log.warning("quantized linear: %s", why)
    amx_tokens = None
    if path == 3:
        amx_tokens = cached_amx_tuning(module, tag)
        for fmt, tokens in amx_tokens.items():
            module.set_amx_tokens(fmt == "int4", tokens)
        why += "; tile products for blocks of " + "; ".join(f"{spans(t) or 'none'} tokens ({fmt})"
                                                            for fmt, t in amx_tokens.items())
    return Extension(module, path, why, amx_tokens)


def spans(tokens: list[int]) -> str:
    """[2, 3, 4, 8, 16, 17] -> '2-4, 8, 16-17'"""
    out, run = [], []
    for t in sorted(tokens):
        if run and t != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(t)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def cached_path(module, tag: str) -> tuple[int, str]:
    """choose_path's answer, probed once per machine and build (startup_cache.py; --recalibrate probes again)."""
    from .. import startup_cache

    k = startup_cache.key("simd-path", tag)
    hit = startup_cache.read_json("simd-path", k)
    if hit is not None and hit.get("path") in PATHS:
        return hit["path"], f"{hit['why']} (cached for this CPU)"
    path, why = choose_path(module)
    startup_cache.write_json("simd-path", k, {"path": path, "why": why})
    return path, why


def choose_path(module, paths=SIMD_PATHS) -> tuple[int, str]:
    """The first SIMD path that runs in a forked child and matches the scalar path bit for bit, else scalar."""
    failures = []
    for path in paths:
        verdict = probe_path(module, path)
        if verdict is None:
            return path, f"{PATHS[path]} path (probed: runs and matches the scalar path bit for bit)"
        failures.append(f"{PATHS[path]} {verdict}")
    return 0, "scalar path (no SIMD path passed its start-up check: " + "; ".join(failures) + ")"


# Block sizes tune_amx times. Below 8 tokens the tiles' fixed cost per block (unpacking, a tile store and its reload
# per 32 weights) was never repaid in a whole forward (SmolLM2 Q4_1, Xeon, 2 threads), though a weight held in
# the caches sometimes measured faster there.
AMX_TOKENS = tuple(range(8, 33))


def cached_amx_tuning(module, tag: str) -> dict[str, list[int]]:
    """tune_amx's answer, measured once per machine, build and thread count (startup_cache.py)."""
    import torch

    from .. import startup_cache

    k = startup_cache.key("amx-tokens", tag, torch.get_num_threads(), startup_cache.code_identity(__file__))
    hit = startup_cache.read_json("amx-tokens", k)
    if hit is not None and all(isinstance(hit.get(f), list) for f in ("int8", "int4")):
        return {"int8": hit["int8"], "int4": hit["int4"]}
    tuned = tune_amx(module)
    module.profile_reset()                         # its calls are not the user's (LEAPLM_KERNEL_PROFILE=1)
    startup_cache.write_json("amx-tokens", k, tuned)
    return tuned


def tune_amx(module, reps: int = 5, timer=None) -> dict[str, list[int]]:
    """The block sizes whose linears run faster as AMX tile products than as AVX-512 VNNI instructions, per
    weight format: both timed on a small model's layer (weights of 960, 576, 3072 and 576 rows) at every size of
    AMX_TOKENS, interleaved, medians of `reps` after a warm-up round. Both give the same bits, so only the speed
    depends on the answer. `timer(fn) -> seconds` replaces the clock (tests)."""
    import statistics
    import time

    import torch

    def clock(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    timer = timer or clock
    g = torch.Generator().manual_seed(0)
    shapes = ((960, 576), (576, 576), (3072, 576), (576, 1536))          # q/k/v, o, gate/up, down: [N, K]
    out = {}
    for fmt, width in (("int8", 256), ("int4", 128)):
        int4 = fmt == "int4"
        layer = []
        for N, K in shapes:
            q = torch.randint(0, 256, (N // 8, K // 32, width), dtype=torch.uint8, generator=g)
            s = torch.rand(N // 8, K // 32, 8, generator=g)
            m = torch.randn(N // 8, K // 32, 8, generator=g) if int4 else None
            layer.append((q, s, m, N, {T: torch.randn(T, K, generator=g) for T in AMX_TOKENS}))

        def run(T: int) -> None:
            for q, s, m, N, xs in layer:
                module.qlinear(xs[T], q, s, m, None, N, 3)

        times: dict[tuple[int, bool], list[float]] = {(T, amx): [] for T in AMX_TOKENS for amx in (False, True)}
        for rep in range(reps + 1):
            for T in AMX_TOKENS:
                for amx in (False, True):
                    module.set_amx_tokens(int4, [T] if amx else [])
                    took = timer(lambda: run(T))
                    if rep:
                        times[(T, amx)].append(took)
        out[fmt] = [T for T in AMX_TOKENS
                    if statistics.median(times[(T, True)]) < statistics.median(times[(T, False)])]
        module.set_amx_tokens(int4, out[fmt])
    return out


@dataclass
class ProbeWeight:
    """A weight in the kernel's row-group layout (quant/linear.py PackedWeight): what the probe passes it."""
    q: object               # uint8 [groups, blocks, 256] (int8) | [groups, blocks, 128] (int4 nibbles) | 192 (int6)
    scale: object           # fp32 or fp16 [groups, blocks, 8] | int6: fp32 [groups, blocks, 16] (a scale per half block)
    minv: object            # [groups, blocks, 8] in scale's type for int4, None for int8
    rows: int


def probe_problems() -> list[tuple[object, ProbeWeight]]:
    """Small problems covering every format and token-tile width: (x [T, 96], a weight of 13 rows in 2 groups of
    8, 3 blocks of 32). Its bytes are random: the probe compares the paths, whatever the weights say."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for T in (1, 2, 3, 5, 9, 16, 32):
        x = torch.randn(T, 96, generator=g)
        for width, int4, scales in ((256, False, 8), (128, True, 8), (192, False, 16)):   # int8, int4, int6
            q = torch.randint(0, 256, (2, 3, width), dtype=torch.uint8, generator=g)
            scale, minv = torch.rand(2, 3, scales, generator=g), torch.randn(2, 3, 8, generator=g)
            out.append((x, ProbeWeight(q, scale, minv if int4 else None, 13)))
            if scales == 8:                    # fp16 scales and minimums, as GGUF Q8_0 / Q4_0 / Q4_1 hold them
                out.append((x, ProbeWeight(q, scale.half(), minv.half() if int4 else None, 13)))
    return out


def probe_path(module, path: int) -> str | None:
    """Run `path` in a forked child (a SIGILL kills only the child): None if it matches the scalar path bit for
    bit on probe_problems(), else what went wrong."""
    import torch

    if not hasattr(os, "fork"):
        return "not probed (no fork to run it safely)"
    pid = os.fork()
    if pid == 0:                                   # child: single-threaded, the exit code says the result
        code = 1
        try:
            import faulthandler

            faulthandler.disable()                 # a fault is an answer here, not a crash to report
            torch.set_num_threads(1)
            if path == 3:                          # tile products at every block size: every tile width runs
                module.set_amx_tokens(True, list(range(1, 33)))
                module.set_amx_tokens(False, list(range(1, 33)))
            run = lambda x, p, path: module.qlinear(x, p.q, p.scale, p.minv, None, p.rows, path)
            ok = all(torch.equal(run(x, p, path), run(x, p, 0)) for x, p in probe_problems())
            code = 0 if ok else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"died with {signal.Signals(os.WTERMSIG(status)).name}"
    code = os.WEXITSTATUS(status)
    return None if code == 0 else ("disagreed with the scalar path" if code == 3 else "failed")
