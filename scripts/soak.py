"""Soak a running server with a mix of valid, invalid, slow, cancelled and oversized requests.

    python scripts/soak.py --url http://127.0.0.1:8000 --api-key KEY --duration-s 120 --max-requests 3000

Runs until the duration or the request count is reached (whichever first), then waits for the engine to go
idle and reports: answers by kind and status, p50/p99 latency of the valid requests, and the engine's pages,
slots and requests still in use (all should be 0).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import requests
from prometheus_client.parser import text_string_to_metric_families

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "hybrid_jax:kv_pages_used",
          "hybrid_jax:state_slots_used")
KINDS = {"valid": 50, "invalid": 20, "cancelled": 12, "slow": 8, "oversized": 5, "stream": 5}
INVALID = [{"prompt": "x", "max_tokens": "ten"}, {"prompt": "x", "temperature": -1}, {"messages": []},
           {"prompt": "x", "stop": 3}, {"prompt": "a\ud800b"}, {"prompt": [-1]}, {"prompt": "x", "n": 10**6},
           {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",
                                                                       "function": {"name": "f", "parameters": 5}}]}]


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.url = args.url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.statuses: Counter = Counter()
        self.latencies: list[float] = []
        self.lock = threading.Lock()

    def record(self, kind: str, status: int | str, latency: float | None = None) -> None:
        with self.lock:
            self.statuses[kind, status] += 1
            if latency is not None:
                self.latencies.append(latency)

    def post(self, path: str, body, timeout: float = 120, **kwargs) -> requests.Response:
        data = json.dumps(body).encode() if not isinstance(body, bytes) else body
        return requests.post(self.url + path, data=data, timeout=timeout,
                             headers={**self.headers, "Content-Type": "application/json"}, **kwargs)

    def valid(self, rng: random.Random) -> None:
        if rng.random() < 0.5:
            path, body = "/v1/completions", {"prompt": f"soak {rng.random()}", "max_tokens": 8}
        else:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        start = time.monotonic()
        response = self.post(path, body)
        self.record("valid", response.status_code, time.monotonic() - start)

    def stream(self, rng: random.Random) -> None:
        body = {"prompt": "stream soak", "max_tokens": 8, "stream": True}
        with self.post("/v1/completions", body, stream=True) as response:
            done = any(line == b"data: [DONE]" for line in response.iter_lines())
            self.record("stream", response.status_code if done else "no [DONE]")

    def invalid(self, rng: random.Random) -> None:
        self.record("invalid", self.post("/v1/chat/completions" if "messages" in (body := rng.choice(INVALID))
                                         else "/v1/completions", body).status_code)

    def cancelled(self, rng: random.Random) -> None:
        body = {"prompt": "cancel me", "max_tokens": 200, "ignore_eos": True}
        if rng.random() < 0.5:  # a stream dropped after its first chunk
            with self.post("/v1/completions", {**body, "stream": True}, stream=True) as response:
                next(response.iter_lines(), None)
            self.record("cancelled", "dropped stream")
            return
        try:
            self.post("/v1/completions", body, timeout=0.3)
            self.record("cancelled", "finished first")
        except requests.Timeout:
            self.record("cancelled", "given up")

    def oversized(self, rng: random.Random) -> None:
        if rng.random() < 0.5:
            status = self.post("/tokenize", {"prompt": "ab " * 1_500_000}).status_code  # 4.5 MB of text
        else:
            status = self.post("/v1/completions", b"{" + b" " * (self.args.max_body_bytes + 1) + b"}").status_code
        self.record("oversized", status)

    def slow(self, rng: random.Random) -> None:
        """A head sent a byte at a time, then silence, until the server answers (408) or closes."""
        parts = urlsplit(self.url)
        with socket.create_connection((parts.hostname, parts.port or 80), timeout=self.args.slow_wait_s) as sock:
            head = b"POST /v1/completions HTTP/1.1\r\nHost: " + parts.hostname.encode() + b"\r\nContent-Len"
            try:
                for i in range(len(head)):
                    sock.sendall(head[i:i + 1])
                    time.sleep(0.05)
                answer = sock.recv(64)
                self.record("slow", int(answer.split()[1]) if answer.startswith(b"HTTP/") else "closed")
            except TimeoutError:
                self.record("slow", "no answer")

    def one(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1_000_003 + index)
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        try:
            getattr(self, kind)(rng)
        except requests.RequestException as e:
            self.record(kind, type(e).__name__)

    def run(self) -> dict:
        deadline = time.monotonic() + self.args.duration_s
        sent = 0
        with ThreadPoolExecutor(self.args.concurrency) as pool:
            futures = []
            while sent < self.args.max_requests and time.monotonic() < deadline:
                futures = [f for f in futures if not f.done()]
                if len(futures) >= self.args.concurrency * 2:
                    time.sleep(0.01)
                    continue
                futures.append(pool.submit(self.one, sent))
                sent += 1
        return self.report(sent)

    def gauges(self) -> dict[str, float]:
        text = requests.get(self.url + "/metrics", timeout=30).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in GAUGES}

    def report(self, sent: int) -> dict:
        deadline = time.monotonic() + 30
        while any((gauges := self.gauges()).values()) and time.monotonic() < deadline:
            time.sleep(0.5)
        ordered = sorted(self.latencies)
        pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4) if ordered else None
        return {"requests": sent, "by_kind_and_status": {f"{k} {s}": n for (k, s), n in sorted(
                    self.statuses.items(), key=lambda item: str(item[0]))},
                "valid_p50_s": pick(0.50), "valid_p99_s": pick(0.99), "engine_at_end": gauges,
                "health": requests.get(self.url + "/health", timeout=10).status_code}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--max-requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024, help="the server's limit")
    parser.add_argument("--slow-wait-s", type=float, default=60.0, help="how long a slow client waits for an answer")
    parser.add_argument("--seed", type=int, default=0)
    print(json.dumps(Soak(parser.parse_args()).run(), indent=2))


if __name__ == "__main__":
    main()
