"""The Triton model directory: config.pbtxt parses with Triton's own protobuf schema, and model.py answers
requests through a real engine under a stand-in `triton_python_backend_utils` (no Triton server here)."""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "deploy" / "triton" / "leaplm"


def _config():
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse((MODEL_DIR / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def test_config_parses_with_tritons_schema():
    from tritonclient.grpc import model_config_pb2 as pb

    c = _config()
    assert c.name == MODEL_DIR.name and c.backend == "python" and c.max_batch_size == 0
    ins = {i.name: i for i in c.input}
    assert ins["text_input"].data_type == pb.TYPE_STRING and not ins["text_input"].optional
    assert all(ins[n].optional for n in ("max_tokens", "temperature", "seed"))
    assert {o.name for o in c.output} == {"text_output", "speculative_stats"}
    assert c.instance_group[0].kind == pb.ModelInstanceGroup.KIND_CPU
    assert set(c.parameters) >= {"model", "draft", "method", "k"}


def test_a_misspelt_field_does_not_parse():
    """Negative control: the parser checks field names against the schema."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    text = (MODEL_DIR / "config.pbtxt").read_text().replace("max_batch_size", "max_batch")
    with pytest.raises(text_format.ParseError):
        text_format.Parse(text, model_config_pb2.ModelConfig())


# --- a stand-in for the module Triton's Python backend stub provides ---------------------------------------------
class _Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, array

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class _TritonError(Exception):
    def __init__(self, msg):
        super().__init__(msg)
        self._msg = msg

    def message(self):
        return self._msg


class _Response:
    def __init__(self, output_tensors, error=None):
        self.output_tensors, self.error = output_tensors, error


class _Request:
    def __init__(self, **inputs):
        self.inputs = [_Tensor(k, v) for k, v in inputs.items()]


def _fake_pb_utils():
    m = types.ModuleType("triton_python_backend_utils")
    m.Tensor, m.TritonError, m.InferenceResponse = _Tensor, _TritonError, _Response
    m.get_input_tensor_by_name = lambda req, name: next((t for t in req.inputs if t.name() == name), None)
    m.get_output_tensor_by_name = lambda resp, name: next((t for t in resp.output_tensors if t.name() == name), None)
    return m


@pytest.fixture
def triton_model(monkeypatch, checkpoint):
    from google.protobuf import json_format

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    spec = importlib.util.spec_from_file_location("leaplm_triton_model", MODEL_DIR / "1" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = _config()
    cfg.parameters["model"].string_value = checkpoint("llama_tied")
    cfg.parameters["draft"].string_value = checkpoint("llama_draft")
    cfg.parameters["k"].string_value = "3"
    model = mod.TritonPythonModel()
    # Triton hands the backend its config as the proto's JSON form
    model.initialize({"model_config": json_format.MessageToJson(cfg, preserving_proto_field_name=True)})
    return model


def test_model_answers_through_the_engine(triton_model, checkpoint):
    from leaplm.config import SamplingParams
    from leaplm.engine.engine import Engine

    reqs = [_Request(text_input=np.array([b"the quick brown"], dtype=np.object_),
                     max_tokens=np.array([12], dtype=np.int32)),
            _Request(text_input=np.array([b"def add(a, b):"], dtype=np.object_),
                     max_tokens=np.array([0], dtype=np.int32)),                 # bad: answered with an error
            _Request(text_input=np.array(["speculative".encode()], dtype=np.object_),
                     max_tokens=np.array([8], dtype=np.int32), temperature=np.array([0.0], dtype=np.float32))]
    out = triton_model.execute(reqs)
    assert len(out) == 3
    plain = Engine(checkpoint("llama_tied"), method="none")
    for resp, prompt, n in ((out[0], "the quick brown", 12), (out[2], "speculative", 8)):
        assert resp.error is None
        text = resp.output_tensors[0].as_numpy()[0].decode()
        assert text == plain.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0.0)).text
        stats = json.loads(resp.output_tensors[1].as_numpy()[0])
        assert stats["method"] == "draft" and stats["k"] == 3 and stats["new_tokens"] >= 1
    assert out[1].error is not None and "max_new_tokens" in out[1].error.message()
    assert triton_model.engine.spec.method == "draft"
