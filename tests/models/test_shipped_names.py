"""A shipped draft or head is named by its name (`--draft smollm2-draft`, `--head eagle-smollm2`) wherever a
path is taken: the CLI's generate, bench and serve, the Python API (Engine, SpecConfig). A misspelt name is refused
naming its field and listing the shipped names; a local path of the same name wins."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from leaplm.cli import app
from leaplm.config import ConfigError, SpecConfig
from leaplm.engine.engine import Engine
from leaplm.heads.loader import head_dir, shipped_heads
from leaplm.models import catalog, embedded

runner = CliRunner()
SHIPPED_DRAFTS = ("draft-1m", "draft-3m", "smollm2-draft")


def test_every_shipped_draft_is_listed_and_nothing_else():
    drafts = embedded.shipped_drafts()
    assert set(drafts) == set(SHIPPED_DRAFTS)
    assert embedded.TARGET not in drafts and not set(drafts) & set(shipped_heads())
    for path in drafts.values():
        assert "architectures" in json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("name", SHIPPED_DRAFTS)
def test_a_shipped_draft_name_resolves_to_its_directory(name):
    assert catalog.resolve_model_name(name, "draft") == str(embedded.embedded_path(name))
    assert catalog.resolve_model_name(name, "model") == name        # only where a draft is taken


def test_an_unknown_draft_name_is_refused_naming_the_field_and_the_shipped_drafts():
    with pytest.raises(ConfigError) as e:
        catalog.resolve_model_name("smollm2-drft", "draft")
    assert e.value.field == "draft"
    assert all(n in e.value.message for n in SHIPPED_DRAFTS)
    assert catalog.resolve_model_name("owner/some-draft", "draft") == "owner/some-draft"   # a hub id passes


def test_a_local_path_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "draft-1m").mkdir()
    assert catalog.resolve_model_name("draft-1m", "draft") == "draft-1m"
    (tmp_path / "eagle-target").mkdir()
    assert head_dir("eagle-target").resolve() == tmp_path / "eagle-target"


def test_a_shipped_head_name_resolves_and_an_unknown_one_is_refused():
    assert head_dir("eagle-smollm2") == embedded.embedded_path("eagle-smollm2")
    with pytest.raises(ConfigError) as e:
        head_dir("eagle-smolm2")
    assert e.value.field == "head" and all(n in e.value.message for n in shipped_heads())


def test_spec_config_takes_a_head_name_and_still_refuses_a_missing_path(tmp_path):
    assert SpecConfig(method="eagle", head="eagle-target").head == "eagle-target"
    with pytest.raises(ConfigError, match="no such head directory") as e:
        SpecConfig(method="eagle", head=str(tmp_path / "nope"))
    assert e.value.field == "head"
    with pytest.raises(ConfigError) as e:
        SpecConfig(method="eagle", head=" ")
    assert e.value.field == "head"


def test_engine_loads_the_named_draft():
    want = embedded.embedded_path("draft-3m").resolve()
    eng = Engine(draft="draft-3m", method="draft", adaptive_k=False)
    assert eng.draft is not None and Path(eng.draft.path).resolve() == want
    eng = Engine(spec=SpecConfig(method="draft", draft="draft-3m", adaptive_k=False))
    assert Path(eng.draft.path).resolve() == want
    assert eng.generate([1, 2, 3]).stats.new_tokens > 0


def test_engine_loads_the_named_head():
    eng = Engine(method="eagle", head="eagle-target", adaptive_k=False)
    assert eng.generate([1, 2, 3]).stats.new_tokens > 0


@pytest.mark.parametrize("kwargs, field", [(dict(draft="nope", method="draft"), "draft"),
                                           (dict(method="eagle", head="nope"), "head")])
def test_engine_refuses_an_unknown_name_before_loading_the_target(kwargs, field, monkeypatch):
    import leaplm.engine.engine as engine_module

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the name was checked")

    monkeypatch.setattr(engine_module, "load_model", no_load)
    with pytest.raises(ConfigError) as e:
        Engine(**kwargs)
    assert e.value.field == field


def test_generate_takes_a_shipped_draft_name_and_refuses_an_unknown_one():
    r = runner.invoke(app, ["generate", "def f(x):", "--draft", "draft-3m", "--max-new-tokens", "4", "--json"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["generate", "def f(x):", "--draft", "smollm2-drft", "--max-new-tokens", "4"])
    assert r.exit_code == 2 and "--draft" in r.output and "smollm2-draft" in r.output


def test_generate_refuses_an_unknown_head_name():
    r = runner.invoke(app, ["generate", "def f(x):", "--method", "eagle", "--head", "eagle-tgt"])
    assert r.exit_code == 2 and "--head" in r.output and "eagle-smollm2" in r.output


def test_bench_refuses_an_unknown_draft_name():
    r = runner.invoke(app, ["bench", "--draft", "nope", "--methods", "draft", "--max-new-tokens", "4"])
    assert r.exit_code == 2 and "--draft" in r.output and "draft-1m" in r.output


@pytest.mark.parametrize("args", [["--draft", "nope"], ["--speculative-config", '{"model": "nope"}']])
def test_serve_refuses_an_unknown_draft_name_before_starting(args):
    r = runner.invoke(app, ["serve", *args, "--port", "0"])
    assert r.exit_code == 2 and "--draft" in r.output and "smollm2-draft" in r.output



@pytest.mark.parametrize("name", ["x" * 5000, "dr\0aft"])
def test_a_name_no_file_can_have_is_refused_as_an_unknown_name(name):
    with pytest.raises(ConfigError) as e:
        catalog.resolve_model_name(name, "draft")
    assert e.value.field == "draft"
    with pytest.raises(ConfigError) as e:
        head_dir(name)
    assert e.value.field == "head"


@pytest.mark.parametrize("name", SHIPPED_DRAFTS)
def test_serve_checks_a_shipped_draft_name_as_it_loads_it(name):
    """serve refuses bad sources before starting with check_source; a shipped name passes it."""
    from leaplm.models.loading import check_source

    check_source(name, "draft")
    with pytest.raises(ConfigError):
        check_source(name + "-x", "draft")
