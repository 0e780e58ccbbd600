"""Which kernel a draft model runs on beside a quantized target (engine.draft_quantization): a draft is
weight-streaming bound like the target, so beside a target on leaplm's int8 kernel it is packed into int8 blocks
too, reduced-vocabulary drafts included (their wrapper only maps token ids)."""
from __future__ import annotations

import pytest

from leaplm.engine.engine import draft_quantization
from leaplm.kernels.build import unavailable_reason
from leaplm.models import embedded
from leaplm.models.draft_vocab import VocabMappedDraft
from leaplm.models.loading import load_model


def test_the_draft_follows_the_targets_kernel(tmp_path):
    gguf = tmp_path / "draft.gguf"
    gguf.write_bytes(b"GGUF")                            # is_gguf reads the magic only
    hf = str(embedded.EMBEDDED_DIR / "draft-1m")
    assert draft_quantization("gguf", hf) == "int8"       # a Hugging Face draft: int8 blocks of its own weights
    assert draft_quantization("gguf", str(gguf)) == "gguf"  # a GGUF draft keeps its file's blocks
    assert draft_quantization("int4", hf) == "int4"
    assert draft_quantization(None, hf) is None


@pytest.mark.skipif(unavailable_reason() is not None, reason="leaplm's int8 kernel cannot be built here")
def test_a_reduced_vocabulary_draft_quantizes_its_inner_model():
    d = load_model(str(embedded.EMBEDDED_DIR / "smollm2-draft"), quantization="int8")
    assert isinstance(d.model, VocabMappedDraft)
    assert d.model.inner.quantized                        # its linears run on the int8 kernel
