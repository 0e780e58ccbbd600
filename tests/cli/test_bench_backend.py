"""`leaplm bench` loads its target on the backend the engine would choose for its first speculating method."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

import leaplm.models as models
import leaplm.models.loading as loading
from leaplm.cli import app
from leaplm.models.loading import BackendChoice

runner = CliRunner()


class Loaded(Exception):
    """Stops the benchmark once its target would load."""


@pytest.mark.parametrize("methods, asked", [("none,suffix", "suffix"), ("none", "none"), ("ngram:k=4,none", "ngram")])
def test_the_backend_is_chosen_for_the_first_speculating_method(monkeypatch, methods, asked):
    seen = {}

    def choose(name, method, backend="auto", *args, **kwargs):
        seen["method"], seen["backend"] = method, backend
        return BackendChoice("torch", "gguf", "chosen in the test")

    def load(name, *args, **kwargs):
        seen["load"] = (kwargs.get("backend"), kwargs.get("quantization"))
        raise Loaded

    monkeypatch.setattr(loading, "choose_target_backend", choose)
    monkeypatch.setattr(models, "load_model", load)
    result = runner.invoke(app, ["bench", "--model", "some.gguf", "--methods", methods, "--workloads", "code"])
    assert isinstance(result.exception, Loaded), result.output
    assert seen == {"method": asked, "backend": "auto", "load": ("torch", "gguf")}
