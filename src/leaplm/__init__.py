"""leaplm: lossless speculative decoding for Hugging Face causal language models."""
import os as _os

# torch's OpenMP threads spin for a long while after each parallel torch operation (libgomp's default), on the cores
# the int8 kernel's own threads (kernels/pool.h) compute on next: a forward of 16 tokens at 2 threads took 1.4x as
# long with the default spin as with 10000 rounds. libgomp reads this when torch loads, so it applies where leaplm
# is imported first (the CLI, the server); a policy the user set is kept.
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from .config import ConfigError, EngineConfig, SamplingParams, SpecConfig, StructuredOutput
from .engine.engine import Engine, GenerationOutput, StreamChunk
from .engine.prepare import PreparedRequest

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "SamplingParams", "SpecConfig", "StructuredOutput", "ConfigError",
           "GenerationOutput", "StreamChunk", "PreparedRequest"]
