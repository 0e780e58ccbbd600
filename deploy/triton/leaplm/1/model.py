"""Triton Inference Server Python-backend model wrapping leaplm's Engine (see deploy/triton/README.md).

Inputs: text_input (string), optional max_tokens (int32), temperature (fp32), seed (int64).
Outputs: text_output (string), speculative_stats (JSON string: method, k, draft_tokens, accepted_tokens,
acceptance_rate, mean_accepted_length, new_tokens). Bad input answers that request with a TritonError naming the
field; the other requests of the same execute() call are unaffected.
"""
from __future__ import annotations

import json
import logging

import numpy as np
import triton_python_backend_utils as pb_utils

log = logging.getLogger("leaplm.triton")


def _param(params: dict, key: str, default: str = "") -> str:
    v = params.get(key, {})
    return (v.get("string_value") if isinstance(v, dict) else v) or default


def _scalar(request, name: str):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    arr = t.as_numpy().reshape(-1)
    if arr.size != 1:
        raise ValueError(f"{name}: expected one value, got {arr.size}")
    return arr[0]


class TritonPythonModel:
    def initialize(self, args):
        from leaplm.engine.engine import Engine

        cfg = json.loads(args["model_config"])
        params = cfg.get("parameters", {})
        threads = int(_param(params, "threads", "0"))
        if threads > 0:
            import torch

            torch.set_num_threads(threads)
        self.max_tokens_default = int(_param(params, "max_tokens_default", "128"))
        self.engine = Engine(_param(params, "model") or None, draft=_param(params, "draft") or None,
                             method=_param(params, "method") or None, k=int(_param(params, "k", "4")))
        log.info("leaplm engine ready: %s k=%d", self.engine.spec.method, self.engine.spec.k)

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        from leaplm.config import ConfigError, SamplingParams

        try:
            raw = _scalar(request, "text_input")
            if raw is None:
                raise ConfigError("text_input", "is required")
            prompt = raw.decode("utf-8") if isinstance(raw, (bytes, np.bytes_)) else str(raw)
            max_tokens = _scalar(request, "max_tokens")
            temperature = _scalar(request, "temperature")
            seed = _scalar(request, "seed")
            params = SamplingParams(
                max_new_tokens=int(max_tokens) if max_tokens is not None else self.max_tokens_default,
                temperature=float(temperature) if temperature is not None else 0.0,
                seed=int(seed) if seed is not None else None)
            out = self.engine.generate(prompt, params)
        except (ConfigError, ValueError, UnicodeDecodeError) as e:
            msg = f"{e.field}: {e.message}" if isinstance(e, ConfigError) else str(e)
            return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(msg))
        s = out.stats
        stats = {"method": s.method, "k": s.k, "new_tokens": s.new_tokens, "draft_tokens": s.draft_tokens,
                 "accepted_tokens": s.accepted_tokens, "acceptance_rate": s.acceptance_rate,
                 "mean_accepted_length": s.mean_accepted_length, "finish_reason": out.finish_reason}
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.array([out.text.encode("utf-8")], dtype=np.object_)),
            pb_utils.Tensor("speculative_stats", np.array([json.dumps(stats).encode()], dtype=np.object_))])

    def finalize(self):
        self.engine = None
