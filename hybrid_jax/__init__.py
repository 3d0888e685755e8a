"""hybrid-jax: a JAX/Pallas inference engine for the Qwen3.5 dense hybrid model family."""

from hybrid_jax.config import ConfigError, Qwen35Config, preset
from hybrid_jax.loader import load_pretrained, random_model
from hybrid_jax.model import Qwen35ForCausalLM
from hybrid_jax.weights import CheckpointError, save_pretrained

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Qwen35Config",
    "Qwen35ForCausalLM",
    "load_pretrained",
    "preset",
    "random_model",
    "save_pretrained",
]
