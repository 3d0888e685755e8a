"""Where compiled programs persist across runs: JAX's compilation cache (XLA's compiled code) at the cache
directory, and the engine's serialized executables (`engine.programs`) in its ``executables`` folder, which
skip tracing and lowering as well.

The executables are keyed by this package's source among the rest, so every upgrade leaves a full set behind:
their folder is kept under a size (`ExecutableDir.max_bytes`), the least recently used removed first. JAX's
cache is keyed by the programs themselves and grows only as they change; JAX bounds it by its own setting
(``JAX_COMPILATION_CACHE_MAX_SIZE``, in bytes; it needs the ``filelock`` package).
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DIR = "~/.cache/hybrid_jax/xla"
DEFAULT_EXECUTABLES_GIB = 10.0


def size_limit(max_gib: float) -> int | None:
    """``max_gib`` GiB in bytes (0: None, no limit); ValueError naming executable_cache_size unless it is finite
    and >= 0."""
    if not 0 <= max_gib < math.inf:
        raise ValueError(f"executable_cache_size: must be a size in GiB >= 0, got {max_gib}")
    return int(max_gib * 2**30) if max_gib else None


@dataclass(frozen=True)
class ExecutableDir:
    """The folder of the engine's serialized executables and the most disk they may take (None: no limit)."""

    path: Path
    max_bytes: int | None = size_limit(DEFAULT_EXECUTABLES_GIB)


def executable_dir(path: str | Path, max_gib: float = DEFAULT_EXECUTABLES_GIB) -> ExecutableDir:
    """The engine's serialized executables under the cache directory ``path``, kept under ``max_gib`` GiB
    (`size_limit`)."""
    return ExecutableDir(Path(path).expanduser() / "executables", size_limit(max_gib))


class CacheDirError(ValueError):
    """A directory that cannot hold compiled programs safely: not creatable, another user's, or writable by
    group or others."""


def private_dir(directory: Path) -> Path:
    """``directory``, created (mode 0700) if missing. A compiled program is code that runs when loaded, so
    CacheDirError unless the directory is this user's own and neither group nor others can write it."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.stat()
    except OSError as e:
        raise CacheDirError(f"compilation_cache_dir: cannot create {directory}: {e}") from e
    if info.st_uid != os.getuid():
        raise CacheDirError(f"compilation_cache_dir: {directory} belongs to another user (uid {info.st_uid}); "
                            "compiled programs are code, so only a directory of your own is used")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheDirError(f"compilation_cache_dir: {directory} is writable by group or others "
                            f"(mode {stat.S_IMODE(info.st_mode):o}); compiled programs are code: "
                            f"`chmod go-w {directory}` or choose another directory")
    return directory


def enable_compilation_cache(path: str | Path) -> Path | None:
    """Keep compiled programs under ``path`` (a `private_dir`) across runs; returns the directory in use (None:
    none).

    A cache this process already configured (an earlier call, or the caller's own jax settings) is kept:
    JAX reads the setting once, at its first compile.
    """
    import jax  # here, not at the top: the command line reads DEFAULT_DIR before anything needs JAX

    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    directory = private_dir(Path(path).expanduser())
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # Every program, the many small eager ones too (building random weights compiles one per parameter shape).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return directory
