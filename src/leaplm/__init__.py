"""leaplm: lossless speculative decoding for Hugging Face causal language models."""

from .config import ConfigError, SamplingParams, SpecConfig, StructuredOutput
from .engine.engine import Engine, GenerationOutput, StreamChunk

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "SpecConfig", "StructuredOutput", "ConfigError", "GenerationOutput",
           "StreamChunk"]
