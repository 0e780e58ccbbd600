"""Loading a head checks that it was trained for this target, and refuses damaged checkpoints."""
from __future__ import annotations

import json
import shutil

import pytest

from leaplm import Engine
from leaplm.config import ConfigError


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


@pytest.mark.parametrize("field,value", [("hidden_size", 64), ("vocab_size", 99), ("num_hidden_layers", 3),
                                         ("weights_sha256", "0" * 64)])
def test_head_for_another_target_is_refused(eagle16, tmp_path, field, value):
    d = _copy(eagle16["head"], tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    cfg["target"][field] = value
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        Engine(eagle16["target"], method="eagle", head=d)
    assert e.value.field == "head" and field in e.value.message and "another target" in e.value.message


def test_corrupt_checkpoint_is_refused(eagle16, tmp_path):
    d = _copy(eagle16["head"], tmp_path / "h")
    w = tmp_path / "h" / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(ConfigError, match="corrupt or truncated") as e:
        Engine(eagle16["target"], method="eagle", head=d)
    assert e.value.field == "head"
    (tmp_path / "h" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Engine(eagle16["target"], method="eagle", head=d)


def test_missing_head_is_refused(eagle16, tmp_path):
    with pytest.raises(ConfigError) as e:
        Engine(eagle16["target"], method="eagle", head=str(tmp_path / "none"))
    assert e.value.field == "head"
    with pytest.raises(ConfigError, match="no eagle head ships"):
        Engine(eagle16["target"], method="eagle")
