"""Bad input at load: a missing file, a directory without config, a file that is not GGUF, an
unsupported GGUF architecture or tensor type, a draft whose tokenizer disagrees: one line naming the file and the
field, exit code 2, never a traceback, from generate and from serve (which checks before it starts)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from leaplm.cli import app
from leaplm.models.llamacpp.binding import available

runner = CliRunner()


def unsupported_tensor_type_gguf(path) -> str:
    """A llama GGUF whose one tensor is TQ1_0 (ternary), a type leaplm does not dequantize."""
    import gguf
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list(["a", "b"])
    t = gguf.GGMLQuantizationType.TQ1_0
    w.add_tensor("token_embd.weight", quantize(np.random.rand(4, 256).astype(np.float32), t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def not_gguf(path) -> str:
    path.write_bytes(b"PK\x03\x04 not a model")
    return str(path)


def swapped_tokenizer_draft(src: str, dst) -> str:
    shutil.copytree(src, dst)
    tj = json.loads((dst / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(tj))
    return str(dst)


CASES = {   # name -> (builder(tmp_path, checkpoint) -> (option, value), words the one line must contain)
    "missing gguf": (lambda t, c: ("--model", str(t / "nope.gguf")), ["--model", "nope.gguf", "does not exist"]),
    "missing dir": (lambda t, c: ("--model", str(t / "nodir")), ["--model", "nodir", "does not exist"]),
    "dir without config": (lambda t, c: ("--model", str(t)), ["--model", "without config.json"]),
    "not gguf": (lambda t, c: ("--model", not_gguf(t / "m.gguf")), ["--model", "m.gguf", "not a GGUF file"]),
    "tensor type": (lambda t, c: ("--model", unsupported_tensor_type_gguf(t / "tq.gguf")),
                    ["--model", "tq.gguf", "TQ1_0", "token_embd.weight"]),
    "draft tokenizer": (lambda t, c: ("--draft", swapped_tokenizer_draft(c("llama_draft"), t / "swapped")),
                        ["--draft", "swapped", "disagrees"]),
}


def one_line_error(res, words: list[str]) -> None:
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    text = " ".join(res.output.split())            # rich wraps long lines; the message is one line
    assert text.startswith("error:") and all(w in text for w in words), text


# leaplm's own GGUF reader refuses tensor types it cannot dequantize (the torch backend); libllama computes on them
TORCH = {"tensor type": ["--backend", "torch"]}


@pytest.mark.parametrize("case", sorted(CASES))
def test_generate_refuses(case, tmp_path, checkpoint):
    build, words = CASES[case]
    opt, value = build(tmp_path, checkpoint)
    args = ["--model", checkpoint("llama_tied"), "--method", "draft"] if opt == "--draft" else ["--method", "none"]
    res = runner.invoke(app, ["generate", "hello", *args, opt, value, "--max-new-tokens", "2", *TORCH.get(case, [])])
    one_line_error(res, words)
    if case == "tensor type" and available():       # libllama reads TQ1_0 and refuses the file for its own reason
        res = runner.invoke(app, ["generate", "hello", *args, opt, value, "--backend", "llamacpp"])
        one_line_error(res, ["--model", "tq.gguf", "libllama cannot load", "context_length"])


@pytest.mark.parametrize("case", ["missing gguf", "dir without config", "not gguf", "tensor type"])
def test_serve_refuses_before_starting(case, tmp_path, checkpoint, monkeypatch):
    from leaplm.cli import serve as cli_serve

    monkeypatch.setattr(cli_serve, "run_server", lambda *a, **k: pytest.fail("the server started"))
    build, words = CASES[case]
    opt, value = build(tmp_path, checkpoint)
    one_line_error(runner.invoke(app, ["serve", value, *TORCH.get(case, [])]), words)
