"""The gunicorn worker's app loading: the backend's client starts on its own thread, before the app's imports."""

from __future__ import annotations

import threading

import jax

from server import app, launcher
from server.settings import Settings


def test_the_worker_starts_the_backend_client_then_builds_the_app(monkeypatch):
    calls = []
    monkeypatch.setattr(launcher, "start_backend_client", lambda: calls.append("client"))
    monkeypatch.setattr(app, "create_app", lambda settings, backend: calls.append(("app", settings)) or "the app")
    settings = Settings()
    server = launcher.GunicornServer(settings, "127.0.0.1", 0, 1)
    assert server.load() == "the app"
    assert calls == ["client", ("app", settings)]
    assert server.cfg.worker_exit == server.worker_exit  # the hook gunicorn calls in the exiting worker
    stopped = []
    monkeypatch.setattr(server.backend, "shutdown", lambda: stopped.append(True))
    server.worker_exit(None, None)
    assert stopped == [True]


def test_the_backend_client_starts_on_its_own_thread(monkeypatch):
    callers = []
    monkeypatch.setattr(jax, "devices", lambda: callers.append(threading.current_thread().name))
    launcher.start_backend_client().join(10)
    assert callers == ["hybrid-jax-client"]


def test_a_backend_that_fails_to_start_leaves_its_error_to_the_engine(monkeypatch):
    """The thread swallows the error (the engine's own jax.devices() raises and reports it): nothing escapes it."""
    escaped = []
    monkeypatch.setattr(threading, "excepthook", escaped.append)

    def broken():
        raise RuntimeError("no CUDA device")

    monkeypatch.setattr(jax, "devices", broken)
    launcher.start_backend_client().join(10)
    assert escaped == []
