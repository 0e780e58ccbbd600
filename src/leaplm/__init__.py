"""leaplm: lossless speculative decoding for Hugging Face causal language models."""

from .config import ConfigError, EngineConfig, SamplingParams, SpecConfig, StructuredOutput
from .engine.engine import Engine, GenerationOutput, StreamChunk
from .engine.prepare import PreparedRequest

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "SamplingParams", "SpecConfig", "StructuredOutput", "ConfigError",
           "GenerationOutput", "StreamChunk", "PreparedRequest"]
