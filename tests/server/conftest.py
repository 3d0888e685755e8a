"""A real server for the tests of this folder: ``hybrid-jax serve`` (gunicorn, gthread) with the tiny default model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MAX_MODEL_LEN = 384
MAX_BATCH = 8
MAX_BODY_BYTES = 1_000_000
MAX_WAITING = 128
READ_TIMEOUT_S = 3.0
STARTUP_TIMEOUT_S = 240


class Server:
    max_model_len = MAX_MODEL_LEN
    max_batch = MAX_BATCH
    max_body_bytes = MAX_BODY_BYTES
    max_waiting = MAX_WAITING
    read_timeout_s = READ_TIMEOUT_S
    api_key = API_KEY

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.port = int(url.rsplit(":", 1)[1])
        self.headers = {"Authorization": f"Bearer {API_KEY}"}

    def post(self, path: str, **kwargs) -> requests.Response:
        kwargs.setdefault("headers", self.headers)
        return requests.post(self.url + path, timeout=120, **kwargs)

    def get(self, path: str, **kwargs) -> requests.Response:
        kwargs.setdefault("headers", self.headers)
        return requests.get(self.url + path, timeout=60, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(ROOT / ".jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--max-batch", str(MAX_BATCH),
               "--max-model-len", str(MAX_MODEL_LEN), "--prefill-chunk", "32", "--decode-sizes", "2", str(MAX_BATCH),
               "--threads", "96", "--request-read-timeout", str(READ_TIMEOUT_S),
               "--api-key", API_KEY, "--max-body-bytes", str(MAX_BODY_BYTES), "--max-waiting", str(MAX_WAITING)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"server exited with {process.returncode}:\n{log_path.read_text()[-5000:]}")
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-5000:]}")
            time.sleep(0.5)
        model = requests.get(url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
        yield Server(url, model["data"][0]["id"])
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
