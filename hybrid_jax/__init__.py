"""hybrid-jax: a JAX/Pallas inference engine for the Qwen3.5 dense hybrid model family."""

from hybrid_jax.config import ConfigError, Qwen35Config, preset
from hybrid_jax.engine.sampling_params import SamplingParams, StructuredOutputsParams
from hybrid_jax.loader import load_pretrained, random_model
from hybrid_jax.model import Qwen35ForCausalLM
from hybrid_jax.tokenizer import load_tokenizer
from hybrid_jax.weights import CheckpointError, save_pretrained

__all__ = [
    "LLM",
    "CheckpointError",
    "ConfigError",
    "Qwen35Config",
    "Qwen35ForCausalLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "load_pretrained",
    "load_tokenizer",
    "preset",
    "random_model",
    "save_pretrained",
]


def __getattr__(name: str):
    if name == "LLM":  # the engine pulls in the Pallas kernels; load it on first use
        from hybrid_jax.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'hybrid_jax' has no attribute {name!r}")
