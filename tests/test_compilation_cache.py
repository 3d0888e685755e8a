"""The persistent compilation cache: set once per process, at the given directory, and filled by a compile."""

import subprocess
import sys

SCRIPT = """
import sys, jax, jax.numpy as jnp
from hybrid_jax.compilation_cache import enable_compilation_cache
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
first = enable_compilation_cache(sys.argv[1])
second = enable_compilation_cache(sys.argv[2])  # already configured: kept
jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).block_until_ready()
print(first, second)
"""


def test_cache_dir_is_set_once_and_filled(tmp_path):
    first, second = tmp_path / "a" / "xla", tmp_path / "b"
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(first), str(second)], capture_output=True, text=True,
                         check=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == [str(first), str(first)]
    assert any(first.iterdir()) and not second.exists()


def test_unusable_cache_dir_names_the_setting(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    script = "from hybrid_jax.compilation_cache import enable_compilation_cache as e; e(__import__('sys').argv[1])"
    out = subprocess.run([sys.executable, "-c", script, str(blocker / "xla")], capture_output=True, text=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and "ValueError: compilation_cache_dir: cannot create" in out.stderr
