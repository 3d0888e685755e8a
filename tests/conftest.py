"""Shared test set-up: eight fake CPU devices, XLA:CPU's quick compiles and a persistent JAX compilation cache."""

import logging
import os
from pathlib import Path

# Eight fake CPU devices for the tensor-parallel tests, and LLVM's costly optimizations off: the tests' tiny
# programs spend far longer compiling than running. Set before JAX starts its backend; the servers and engines
# the tests start as processes inherit them.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (" --xla_force_host_platform_device_count=8"
                                                             " --xla_backend_optimization_level=0"
                                                             " --xla_llvm_disable_expensive_passes=true")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", str(Path(__file__).resolve().parent.parent / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class CompileLog:
    """JAX compiles logged in any thread (a `jax.log_compiles()` context is thread-local: the engine's own
    thread would not see it)."""

    def __init__(self, caplog):
        self.caplog = caplog

    def clear(self) -> None:
        self.caplog.clear()

    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.caplog.records if r.getMessage().startswith("Compiling")]


@pytest.fixture
def compile_log(caplog):
    previous = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    caplog.set_level(logging.WARNING, logger="jax")
    log = CompileLog(caplog)
    try:
        jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(7))  # a fresh program: the log must see it
        assert log.messages(), "compiles are not reaching the log"
        log.clear()
        yield log
    finally:
        jax.config.update("jax_log_compiles", previous)
