"""hybrid-jax: a JAX/Pallas inference engine for the Qwen3.5 dense hybrid model family.

The public names import their modules on first use: ``import hybrid_jax`` (and the command line's argument
parsing, and the server's gunicorn arbiter) loads neither JAX nor flax, so a server's worker can start JAX's
backend beside its own imports (`server.launcher`).
"""

import importlib

_EXPORTS = {  # public name -> the module that defines it
    "LLM": "hybrid_jax.engine.llm",
    "CheckpointError": "hybrid_jax.weights",
    "ConfigError": "hybrid_jax.config",
    "Qwen35Config": "hybrid_jax.config",
    "Qwen35ForCausalLM": "hybrid_jax.model",
    "SamplingParams": "hybrid_jax.engine.sampling_params",
    "StructuredOutputsParams": "hybrid_jax.engine.sampling_params",
    "load_pretrained": "hybrid_jax.loader",
    "load_tokenizer": "hybrid_jax.tokenizer",
    "preset": "hybrid_jax.config",
    "random_model": "hybrid_jax.loader",
    "save_pretrained": "hybrid_jax.weights",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hybrid_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
