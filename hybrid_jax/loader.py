"""Build a model: from a Hugging Face checkpoint directory, or with random weights at any config's shapes."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import Qwen35Config, preset
from hybrid_jax.model import Qwen35ForCausalLM
from hybrid_jax.weights import abstract_model, load_weights


def load_pretrained(path: str | Path, dtype="bfloat16") -> Qwen35ForCausalLM:
    """Load ``config.json`` + safetensors from a checkpoint directory into a Flax NNX model."""
    config = Qwen35Config.from_pretrained(path)
    model = abstract_model(config, jnp.dtype(dtype))
    load_weights(model, path)
    return model


def random_model(config: Qwen35Config | str, dtype="bfloat16", seed: int = 0) -> Qwen35ForCausalLM:
    """A model with random weights at ``config``'s shapes (a preset name or a config); for tests and benchmarks.

    Initialized as HF's ``_init_weights`` initializes Qwen3.5: linear, conv and embedding weights from
    normal(0, ``config.initializer_range``), RMSNorm offsets 0 (a gain of 1), the gated norm's weight 1,
    ``exp(A_log)`` uniform in [0.01, 16] and ``dt_bias`` 1."""
    if isinstance(config, str):
        config = preset(config)
    return Qwen35ForCausalLM(config, jnp.dtype(dtype), rngs=nnx.Rngs(seed))


def random_weights(config: Qwen35Config, dtype) -> jax.stages.Wrapped:
    """`random_model`'s initializers as one jitted program, seed (int32) -> the model's state (the same values:
    bitwise on the CPU). One compile instead of one per initializer op and shape, for an executable cache to
    keep; on a GPU it compiles for minutes (95 s at 0.8B), where the eager ops take ~1 s."""
    dtype = jnp.dtype(dtype)
    return jax.jit(lambda seed: nnx.state(Qwen35ForCausalLM(config, dtype, rngs=nnx.Rngs(jax.random.key(seed)))))
