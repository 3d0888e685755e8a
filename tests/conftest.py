"""Shared test set-up: a persistent JAX compilation cache so repeated runs skip recompiles."""

from pathlib import Path

import jax

jax.config.update("jax_compilation_cache_dir", str(Path(__file__).resolve().parent.parent / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
