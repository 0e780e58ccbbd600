"""The start-up cache: keys change with the file, the CPU, the thread count and the version; --recalibrate and
LEAPLM_NO_STARTUP_CACHE skip entries; a broken entry reads as missing."""
from __future__ import annotations

import os

import pytest

from leaplm import startup_cache as sc


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LEAPLM_RECALIBRATE", raising=False)
    monkeypatch.delenv("LEAPLM_NO_STARTUP_CACHE", raising=False)


def test_key_changes_with_the_file_cpu_threads_and_version(tmp_path, monkeypatch):
    f = tmp_path / "m.bin"
    f.write_bytes(b"x" * 5000)
    base = sc.key("calibration", sc.file_identity(f), 2)
    assert sc.key("calibration", sc.file_identity(f), 2) == base            # stable
    assert sc.key("calibration", sc.file_identity(f), 1) != base            # thread count
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert sc.key("calibration", sc.file_identity(f), 2) != base            # the file
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert sc.key("calibration", sc.file_identity(f), 2) == base
    sc._cpuinfo.cache_clear()
    monkeypatch.setattr(sc, "_cpuinfo", lambda: ("Some Other CPU", "fpu sse2"))
    assert sc.key("calibration", sc.file_identity(f), 2) != base            # the CPU
    monkeypatch.undo()
    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sc, "VERSION", "9.9.9")
    assert sc.key("calibration", sc.file_identity(f), 2) != base            # leaplm's version


def test_the_code_identity_changes_with_the_measuring_source(tmp_path):
    """A calibration's key carries a hash of the code that measured it: the same file with other source is
    another identity (so a changed measuring loop measures again), the same source the same one."""
    a, b = tmp_path / "calibrate.py", tmp_path / "costs.py"
    a.write_text("def calibrate(): return 1\n")
    b.write_text("SHAPE = 1\n")
    first = sc.code_identity(str(a), str(b))
    assert sc.code_identity(str(a), str(b)) == first
    a2 = tmp_path / "v2"
    a2.mkdir()
    (a2 / "calibrate.py").write_text("def calibrate(): return 2\n")
    assert sc.code_identity(str(a2 / "calibrate.py"), str(b)) != first
    assert sc.key("calibration", 2, first) != sc.key("calibration", 2, sc.code_identity(str(a2 / "calibrate.py"),
                                                                                      str(b)))


def test_the_calibration_key_reads_the_code_identity(monkeypatch):
    """The engine's calibration and thread-check keys include the measuring code's identity."""
    from leaplm.engine import startup_checks

    ids = iter(["one", "two"])
    monkeypatch.setattr(startup_checks.startup_cache, "code_identity", lambda *paths: next(ids))
    monkeypatch.setattr(startup_checks, "_identity", lambda engine: ["t", "d", "torch", "float32", [], 1, "draft",
                                                                     5, 512])
    assert startup_checks._calibration_key(None, 1, 256, 2) != startup_checks._calibration_key(None, 1, 256, 2)


def test_entries_round_trip_and_recalibrate_skips_them(monkeypatch):
    sc.write_json("x", "k", {"a": 1})
    assert sc.read_json("x", "k") == {"a": 1}
    sc.set_recalibrate(True)
    try:
        assert sc.read_json("x", "k") is None
    finally:
        sc.set_recalibrate(False)
    monkeypatch.setenv("LEAPLM_NO_STARTUP_CACHE", "1")
    assert sc.read_json("x", "k") is None


def test_a_broken_entry_reads_as_missing():
    sc.write_json("x", "k", {"a": 1})
    (sc.entry_dir("x", "k") / "entry.json").write_text("{not json")
    assert sc.read_json("x", "k") is None


def test_the_calibration_key_follows_the_int8_kernels_build(checkpoint, monkeypatch):
    """Costs measured with one build of the int8 kernel are not another's: an engine whose linears run on it keys
    its calibration by the build (and its path and tile sizes); an engine off the kernel does not depend on it."""
    from types import SimpleNamespace

    from leaplm.engine import startup_checks
    from leaplm.engine.engine import Engine
    from leaplm.kernels import build

    if build.load() is None:
        pytest.skip("the int8 kernel's C++ extension is unavailable here")
    on = Engine(checkpoint("llama3_rope"), method="ngram", k=4, quantization="int8")
    off = Engine(checkpoint("llama3_rope"), method="ngram", k=4)
    keys = (startup_checks._calibration_key(on, 1, 256, 2), startup_checks._calibration_key(off, 1, 256, 2))
    assert startup_checks._kernel(off) == "-" and build.built_library().tag in startup_checks._kernel(on)
    monkeypatch.setattr(build, "built_library", lambda: SimpleNamespace(tag="another build"))
    assert startup_checks._calibration_key(on, 1, 256, 2) != keys[0]
    assert startup_checks._calibration_key(off, 1, 256, 2) == keys[1]
