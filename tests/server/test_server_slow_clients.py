"""Slow, idle and half-closed sockets against the real server, and the HTTP layer's own errors as JSON."""

from __future__ import annotations

import json
import socket
import threading
import time

import requests

IDLE = 200
TRICKLING = 50
HEALTH_LIMIT_S = 2.0


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one HTTP/1.1 answer read until the server closes or the body is complete."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", -1))
    while length < 0 or len(body) < length:
        part = sock.recv(65536)
        if not part:
            break
        body += part
    return int(lines[0].split()[1]), headers, body


def assert_json_error(status: int, headers: dict[str, str], body: bytes, expected: int) -> dict:
    assert status == expected, body
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def timed_health(server) -> float:
    start = time.monotonic()
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    return time.monotonic() - start


def test_idle_and_trickling_sockets_do_not_block_requests(server, client):
    stop = threading.Event()
    idle = [connect(server) for _ in range(IDLE)]
    trickling = [connect(server) for _ in range(TRICKLING)]
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {server.api_key}\r\nContent-Length: 100000\r\n\r\n").encode()

    def trickle(sock: socket.socket, data: bytes) -> None:
        for i in range(len(data)):  # a few bytes a second: the head first, then the body
            if stop.wait(0.3):
                return
            try:
                sock.sendall(data[i:i + 1])
            except OSError:
                return

    threads = [threading.Thread(target=trickle, args=(s, head + b"x" * 1000), daemon=True) for s in trickling]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        waits = [timed_health(server) for _ in range(5)]
        assert max(waits) < HEALTH_LIMIT_S, waits
        start = time.monotonic()
        out = client.completions.create(model=server.model, prompt="still served", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2 and time.monotonic() - start < 30
        # Past the read timeout every slow socket is answered 408 (JSON) and closed.
        time.sleep(server.read_timeout_s + 1.5)
        status, headers, body = read_response(trickling[0])
        error = assert_json_error(status, headers, body, 408)
        assert error["type"] == "RequestTimeoutError"
        assert idle[0].recv(65536).startswith(b"HTTP/1.1 408")
        assert timed_health(server) < HEALTH_LIMIT_S
    finally:
        stop.set()
        for s in idle + trickling:
            s.close()


def raw_request(server, data: bytes, half_close: bool = False) -> tuple[int, dict[str, str], bytes]:
    with connect(server) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        return read_response(sock)


def test_gunicorn_errors_are_json(server):
    long_line = b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    assert_json_error(*raw_request(server, long_line), 414)
    many_headers = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"".join(
        b"X-H%d: v\r\n" % i for i in range(200)) + b"\r\n"
    assert_json_error(*raw_request(server, many_headers), 431)
    assert_json_error(*raw_request(server, b"NOT HTTP AT ALL\r\n\r\n"), 400)
    assert timed_health(server) < HEALTH_LIMIT_S


def test_half_closed_client_gets_no_cut_short_200(server):
    body = json.dumps({"model": server.model, "prompt": "half", "max_tokens": server.max_model_len - 8,
                       "ignore_eos": True, "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {server.api_key}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    error = assert_json_error(*raw_request(server, head + body, half_close=True), 499)
    assert "closed" in error["message"]


def test_chunked_body_over_the_limit_is_413(server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(server.max_body_bytes // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    response = requests.post(server.url + "/v1/completions", data=chunks(), timeout=60,
                             headers={**server.headers, "Content-Type": "application/json"})
    assert response.status_code == 413, response.text
    assert response.json()["error"]["type"] == "RequestEntityTooLargeError"
