"""Run the app under gunicorn from Python: one worker process (it owns the engine), many request threads.

The worker is gthread with requests read whole in its event loop (server.worker), so slow or idle sockets
hold no request thread; it may keep as many connections open as the process may open files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import resource
import threading

from gunicorn.app.base import BaseApplication

from server.settings import LOOPBACK_BINDS, Settings
from server.worker import worker_class

log = logging.getLogger("hybrid_jax.server")

SPARE_FILES = 256  # file descriptors kept for the model, logs and the engine, beyond client connections


def max_connections() -> int:
    """Raise the open-files limit to its hard cap (at most 65536); the connections that leaves room for."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return max(soft - SPARE_FILES, 64)


class GunicornServer(BaseApplication):
    """gunicorn with fixed options; the app factory runs in the worker process (no preload)."""

    def __init__(self, settings: Settings, host: str, port: int, threads: int):
        self.settings = settings
        self.backend = None  # the worker's, once `load` built it
        self.options = {
            "bind": f"{host}:{port}",
            "workers": 1,
            "worker_class": worker_class(settings.request_read_timeout, settings.max_body_bytes),
            "threads": threads,
            "worker_connections": max_connections(),
            "timeout": 120,  # worker heartbeat; gthread beats while requests run
            "graceful_timeout": 10,
            "keepalive": 5,
            "errorlog": "-",
            "loglevel": "info",
            "control_socket_disable": True,  # gunicorn >= 24: one fixed path per user would clash between servers
            "worker_exit": self.worker_exit,
        }
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            if key in self.cfg.settings:  # older gunicorn lacks some settings
                self.cfg.set(key, value)

    def load(self):
        # Imported in the worker, so JAX never starts in the arbiter.
        start_backend_client()
        from server.app import create_app
        from server.backend import Backend

        self.backend = Backend(self.settings)
        return create_app(self.settings, self.backend)

    def worker_exit(self, server, worker) -> None:
        """gunicorn's hook in the worker as it exits: stop the engine and its background compiles before the
        interpreter shuts down (JAX's exit handlers would fail a compile under way, and a stop that waited for
        every remaining program would outlast the graceful timeout)."""
        if self.backend is not None:
            self.backend.shutdown()


def start_backend_client() -> threading.Thread:
    """Import JAX, then start its backend's client on a thread, beside the app's remaining imports (flax, the
    engine, flask: about a second). The client's start (CUDA's: 0.3-0.6 s on an H100) runs outside the GIL, so
    it overlaps them; the engine's own ``jax.devices()`` then finds the client up, or raises its error there."""
    import jax

    def start() -> None:
        with contextlib.suppress(Exception):  # raised again, and reported, by the engine's own call
            jax.devices()

    thread = threading.Thread(target=start, name="hybrid-jax-client", daemon=True)
    thread.start()
    return thread


def auth_warning(settings: Settings, host: str) -> str | None:
    """The warning for a server that anyone who can reach it may use, or None."""
    if settings.api_key is None and host not in (*LOOPBACK_BINDS, "::1"):
        return (f"serving on {host} without an API key: anyone who can reach this port can use the model "
                "(set --api-key or $HYBRID_JAX_API_KEY)")
    return None


def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8000, threads: int = 64) -> None:
    if (warning := auth_warning(settings, host)) is not None:
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        log.warning(warning)
    GunicornServer(dataclasses.replace(settings, exit_on_load_failure=True), host, port, threads).run()
