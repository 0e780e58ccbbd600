"""EngineOptions: the options of every command that builds an engine, declared once (cli/common.py)."""
from __future__ import annotations

import dataclasses

import click
import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from leaplm.cli import app
from leaplm.cli.common import EngineOptions, engine_options

runner = CliRunner()
# what each engine command leaves out, and why it may: it does not implement that option
WITHOUT = {"generate": (), "serve": (), "bench": ("device", "kv_cache_dtype"), "tune": ("quantization", "kv_cache_dtype")}


def _options(command: click.Command) -> dict[str, click.Parameter]:
    return {p.name: p for p in command.params}


@pytest.mark.parametrize("name", sorted(WITHOUT))
def test_every_engine_command_offers_every_engine_option_it_implements(name):
    group = get_command(app)
    command = group.commands[name]
    params = _options(command)
    for f in dataclasses.fields(EngineOptions):
        declared = f.metadata["option"].param_decls
        if f.name in WITHOUT[name]:
            assert f.name not in params, f"{name} offers --{f.name} but lists it in without="
            continue
        assert f.name in params, f"{name} lacks {declared}"
        assert set(declared) <= set(params[f.name].opts + params[f.name].secondary_opts)
        assert params[f.name].default == f.default


def test_the_options_arrive_as_one_argument():
    seen = {}
    cli = typer.Typer()

    @cli.command()
    @engine_options(without=("device",))
    def cmd(word: str = typer.Option("x", "--word"), *, options: EngineOptions):
        seen["word"], seen["options"] = word, options

    res = runner.invoke(cli, ["--word", "y", "-m", "some/dir", "-c", "128", "--dtype", "bfloat16", "-t", "2"])
    assert res.exit_code == 0, res.output
    assert seen["word"] == "y"
    assert seen["options"] == EngineOptions(model="some/dir", max_model_len=128, dtype="bfloat16", threads=2)
    res = runner.invoke(cli, ["--device", "cuda"])
    assert res.exit_code == 2 and "--device" in res.output       # left out: refused, not ignored


def test_a_command_must_take_the_options_and_not_redeclare_them():
    with pytest.raises(TypeError, match="options: EngineOptions"):
        engine_options()(lambda word="x": None)
    with pytest.raises(TypeError, match="dtype"):
        engine_options()(lambda dtype="float32", *, options=None: None)
    with pytest.raises(ValueError, match="no EngineOptions field"):
        engine_options(without=("backend_of_the_future",))
