"""The persistent compilation cache: set once per process, at the given directory (one of the user's own, that
group and others cannot write), and filled by a compile."""

import stat
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
    assert out.returncode != 0 and "CacheDirError: compilation_cache_dir: cannot create" in out.stderr


def test_a_directory_others_can_write_is_refused_and_a_new_one_is_private(tmp_path):
    script = ("import os, sys; os.umask(0o002); from hybrid_jax.compilation_cache import enable_compilation_cache; "
              "enable_compilation_cache(sys.argv[1])")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    for directory, refused in ((shared, True), (tmp_path / "new" / "xla", False)):
        out = subprocess.run([sys.executable, "-c", script, str(directory)], capture_output=True, text=True,
                             env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
        assert (out.returncode != 0) == refused, out.stderr[-2000:]
        assert ("writable by group or others" in out.stderr) == refused
    assert stat.S_IMODE((tmp_path / "new" / "xla").stat().st_mode) == 0o700  # despite the umask
