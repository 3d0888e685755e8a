"""Where compiled programs persist across runs: JAX's compilation cache (XLA's compiled code) at the cache
directory, and the engine's serialized executables (`engine.programs`) in its ``executables`` folder, which
skip tracing and lowering as well."""

from __future__ import annotations

from pathlib import Path

DEFAULT_DIR = "~/.cache/hybrid_jax/xla"


def executable_dir(path: str | Path) -> Path:
    """The engine's serialized executables under the cache directory ``path``."""
    return Path(path).expanduser() / "executables"


def enable_compilation_cache(path: str | Path) -> Path | None:
    """Keep compiled programs under ``path`` across runs; returns the directory in use (None: none).

    A cache this process already configured (an earlier call, or the caller's own jax settings) is kept:
    JAX reads the setting once, at its first compile.
    """
    import jax  # here, not at the top: the command line reads DEFAULT_DIR before anything needs JAX

    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    directory = Path(path).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compilation_cache_dir: cannot create {directory}: {e}") from e
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # Every program, the many small eager ones too (building random weights compiles one per parameter shape).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return directory
