"""Shared test set-up: eight fake CPU devices and a persistent JAX compilation cache."""

import os
from pathlib import Path

# Eight fake CPU devices for the tensor-parallel tests (must be set before JAX starts its backend).
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", str(Path(__file__).resolve().parent.parent / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
