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
