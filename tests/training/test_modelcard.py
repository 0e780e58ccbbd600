import json
import math

import pytest

from leaplm.training.distill import distill
from leaplm.training.modelcard import markdown_table, read_train_record, write_model_card
from leaplm.training.perplexity import perplexity, window_starts


def test_window_starts_spread_over_stream_without_overlap():
    assert window_starts(1000, 100, 10_000) == [i * 100 for i in range(10)]
    starts = window_starts(1000, 100, 300)  # 3 of the 10 windows, spread out
    assert starts == [0, 300, 600]
    with pytest.raises(ValueError, match="seq_len"):
        window_starts(50, 100, 300)


def test_perplexity_of_trained_tiny_model(tiny_target_dir):
    seen = []
    r = perplexity(str(tiny_target_dir), seq_len=64, batch_size=4, max_tokens=64 * 6, max_files=20,
                   on_batch=lambda d, n: seen.append((d, n)))
    assert r.tokens == 6 * 63 and seen == [(1, 2), (2, 2)]
    assert 1 < r.perplexity < 2 * 512 and math.isclose(r.perplexity, math.exp(r.loss))


def test_card_from_distill_run(tmp_path, tiny_target_dir, distill_config):
    out = tmp_path / "draft"
    distill(distill_config(out, tiny_target_dir, "tiny", steps=3, save_every=1))
    # a resumed run re-logs steps after its last save: the later row wins
    with (out / "train_log.jsonl").open("a") as f:
        f.write(json.dumps(json.loads((out / "train_log.jsonl").read_text().splitlines()[-1]) | {"loss": 9.5}) + "\n")
    record = read_train_record(out)
    assert [r["step"] for r in record.steps] == [1, 2, 3] and record.steps[-1]["loss"] == 9.5

    ppl = perplexity(str(out), seq_len=64, batch_size=4, max_tokens=256, max_files=20)
    rows = [{"method": "draft_model", "K": 4, "acceptance rate": 0.6123, "tau": 2.5},
            {"method": "ngram", "K": 4, "acceptance rate": 0.3}]
    path = write_model_card(out, name="leaplm-tiny-draft", perplexity=ppl, acceptance=rows)
    text = path.read_text()
    for needle in ("# leaplm-tiny-draft", "asyncio, email, json", "tokens seen", "wall time",
                   "final held-out CE", "final held-out KL", f"{ppl.perplexity:.3f}", "| draft_model | 4 | 0.6123 | 2.5 |",
                   "| ngram | 4 | 0.3 |  |", "loss_curve.png", "distill"):
        assert needle in text, needle
    png = out / "loss_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_card_from_pretrain_run(tiny_target_dir):
    text = write_model_card(tiny_target_dir).read_text()
    assert "preset tiny" in text and "next-token cross-entropy" in text and "KL" not in text
    assert "Speculative decoding acceptance" not in text


def test_markdown_table_columns_in_order_of_first_appearance():
    assert markdown_table([{"a": 1}, {"b": 2.0, "a": 3}]).splitlines() == ["| a | b |", "|---|---|", "| 1 |  |",
                                                                           "| 3 | 2 |"]


def test_card_needs_a_training_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_config.json"):
        write_model_card(tmp_path)
