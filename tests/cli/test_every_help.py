"""Every command's --help renders: option help is rich markup, so a bracket pair in it must be escaped."""
from __future__ import annotations

import typer
from typer.testing import CliRunner

from leaplm.cli import app


def command_paths() -> list[list[str]]:
    """Every command of the leaplm command line, as the words that name it."""
    out: list[list[str]] = []

    def walk(cmd, path: list[str]) -> None:          # typer's own click: a group has .commands
        out.append(path)
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                walk(sub, path + [name])

    app.registered_commands          # the commands are added on first read (cli/__init__.App)
    walk(typer.main.get_command(app), [])
    return out


def test_every_command_prints_its_help():
    paths = command_paths()
    assert ["bench", "project"] in paths and ["train", "distill"] in paths and len(paths) > 20
    runner = CliRunner()
    bad = {}
    for path in paths:
        res = runner.invoke(app, path + ["--help"], env={"COLUMNS": "120"})
        if res.exit_code != 0 or "Usage" not in res.output:
            bad[" ".join(path)] = repr(res.exception) or res.output[-300:]
    assert not bad, bad
