"""Run the app under gunicorn from Python: one gthread worker process (it owns the engine), many threads."""

from __future__ import annotations

from gunicorn.app.base import BaseApplication

from server.settings import Settings


class GunicornServer(BaseApplication):
    """gunicorn with fixed options; the app factory runs in the worker process (no preload)."""

    def __init__(self, settings: Settings, host: str, port: int, threads: int):
        self.settings = settings
        self.options = {
            "bind": f"{host}:{port}",
            "workers": 1,
            "worker_class": "gthread",
            "threads": threads,
            "timeout": 120,  # worker heartbeat; gthread beats while requests run
            "graceful_timeout": 10,
            "keepalive": 5,
            "errorlog": "-",
            "loglevel": "info",
            "control_socket_disable": True,  # gunicorn >= 24: one fixed path per user would clash between servers
        }
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            if key in self.cfg.settings:  # older gunicorn lacks some settings
                self.cfg.set(key, value)

    def load(self):
        from server.app import create_app  # imported in the worker, so JAX never starts in the arbiter

        return create_app(self.settings)


def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8000, threads: int = 64) -> None:
    GunicornServer(settings, host, port, threads).run()
