"""The package's public names, imported on first use: the command line and the server's arbiter load no JAX."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import hybrid_jax

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_is_its_module_s():
    for name in hybrid_jax.__all__:
        assert getattr(hybrid_jax, name) is getattr(importlib.import_module(hybrid_jax._EXPORTS[name]), name)
    assert set(hybrid_jax.__all__) <= set(dir(hybrid_jax))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        hybrid_jax.nothing  # noqa: B018


def test_the_command_line_and_the_arbiter_load_no_jax():
    """The server's worker starts JAX's backend before the heavy imports (`server.launcher`); anything the
    arbiter imports first would be paid before the worker exists."""
    probe = ("import sys, hybrid_jax, server.cli, server.launcher; "
             "print(sorted(m for m in ('jax', 'flax', 'numpy', 'tokenizers', 'flask') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
