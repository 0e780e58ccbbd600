"""The training commands' shared option groups (cli/train_options.py): every trainer takes the training loop's
options with its own config's defaults, and a group's values reach the command as one dict of config fields."""
from __future__ import annotations

import dataclasses

import pytest
import typer
from typer.testing import CliRunner

from leaplm.cli.train_options import CORPUS_RUN, HEAD_RUN, LOOP, Opt, OptionGroup


def _command(name: str):
    from leaplm.cli import app

    return typer.main.get_command(app).commands["train"].commands[name]


def _config_of(name: str):
    from leaplm.training.chat_distill import ChatDistillConfig
    from leaplm.training.distill import DistillConfig
    from leaplm.training.eagle import EagleTrainConfig
    from leaplm.training.pretrain import PretrainConfig

    return {"pretrain": PretrainConfig, "distill": DistillConfig, "distill-chat": ChatDistillConfig,
            "eagle": EagleTrainConfig, "medusa": EagleTrainConfig}[name]


@pytest.mark.parametrize("name,groups", [("pretrain", (LOOP, CORPUS_RUN)), ("distill", (LOOP, CORPUS_RUN)),
                                         ("distill-chat", (LOOP,)), ("eagle", (LOOP, HEAD_RUN)),
                                         ("medusa", (LOOP, HEAD_RUN))])
def test_every_trainer_takes_its_groups_with_its_configs_defaults(name, groups):
    params = {p.name: p for p in _command(name).params}
    defaults = {f.name: f.default for f in dataclasses.fields(_config_of(name))}
    for group in groups:
        for field in group.opts:
            assert field in params, f"train {name} lacks --{field.replace('_', '-')}"
            assert params[field].default == defaults[field], (name, field)


def test_group_values_arrive_as_one_dict_of_config_fields():
    @dataclasses.dataclass
    class Conf:
        lr: float = 0.5
        steps: int = 3

    group = OptionGroup({"lr": Opt(float, "Peak learning rate."), "steps": Opt(int, "Steps.", dict(min=1))})
    got = {}
    app = typer.Typer()

    @app.command()
    @group.options(Conf, into="loop")
    def cmd(name: str = typer.Option("x"), loop: dict = None) -> None:
        got.update(name=name, loop=loop)

    r = CliRunner().invoke(app, ["--steps", "7", "--name", "y"])
    assert r.exit_code == 0, r.output
    assert got == {"name": "y", "loop": {"lr": 0.5, "steps": 7}}
    r = CliRunner().invoke(app, ["--steps", "0"])
    assert r.exit_code == 2 and "--steps" in r.output            # the group's bounds hold


def test_a_group_refuses_a_clash_or_a_field_its_config_lacks():
    @dataclasses.dataclass
    class Conf:
        lr: float = 0.5

    group = OptionGroup({"lr": Opt(float, "Peak learning rate.")})
    with pytest.raises(TypeError, match="lr"):
        @group.options(Conf, into="loop")
        def clash(lr: float = 1.0, loop: dict = None) -> None: ...
    with pytest.raises(TypeError, match="loop"):
        @group.options(Conf, into="loop")
        def no_argument(x: int = 1) -> None: ...
    with pytest.raises(ValueError, match="steps"):
        OptionGroup({"steps": Opt(int, "Steps.")}).options(Conf, into="loop")
