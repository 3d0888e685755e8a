"""gunicorn's gthread worker with requests read whole before a thread serves them, and errors as JSON.

gthread hands a connection to a request thread as soon as it is readable, and the thread then blocks until
the request head and body have arrived: a few dozen idle or trickling sockets take every thread. Here the
worker's event loop reads a connection without blocking until its head and body are in (only gunicorn's
parser then reads them, from that buffer), so slow sockets hold no thread; one whose request has not
arrived ``read_timeout`` seconds after it started waiting is answered 408 and closed. gunicorn's own
error answers (400, 414, 431, ...) leave as OpenAI-style JSON bodies instead of HTML.
"""

from __future__ import annotations

import contextlib
import html
import json
import re
import selectors
import time
from functools import partial

from gunicorn import util
from gunicorn.workers.gthread import ThreadWorker

HEAD_END = b"\r\n\r\n"
CHUNKED_END = b"0\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length[ \t]*:[ \t]*(\d+)[ \t]*(?=\r\n|$)")
_CHUNKED = re.compile(rb"\r\ntransfer-encoding[ \t]*:[^\r]*chunked")
_EXPECT_CONTINUE = re.compile(rb"\r\nexpect[ \t]*:[ \t]*100-continue")
_STATUS = re.compile(rb"HTTP/1\.1 (\d{3}) ([^\r]*)\r\n")
_HTML_MESSAGE = re.compile(rb"</h1>\s*(.*?)\s*</body>", re.S)
RECV_BYTES = 64 * 1024


def request_complete(buf: bytes | bytearray, max_head: int, max_body: int) -> bool:
    """Whether ``buf`` holds a whole HTTP/1 request, or enough that gunicorn's parser can judge it now.

    A head over ``max_head`` bytes, a malformed length or a body over ``max_body`` goes to the parser at
    once: it answers those with an error without waiting for the rest.
    """
    end = buf.find(HEAD_END)
    if end < 0:
        return len(buf) > max_head
    head = bytes(buf[:end]).lower()
    body = len(buf) - end - len(HEAD_END)
    if _CHUNKED.search(head):
        return buf.endswith(CHUNKED_END) or body > max_body
    if b"\r\ncontent-length" not in head:
        return True
    length = _CONTENT_LENGTH.findall(head)
    if len(length) != 1 or int(length[0]) > max_body:
        return True
    return body >= int(length[0])


def json_error_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response (closing the connection) with an OpenAI-style error body."""
    from server.errors import APIError

    body = json.dumps(APIError(status, message or reason).body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


class _Capture:
    """Stands in for a client socket while gunicorn writes an error answer, keeping the bytes."""

    def __init__(self):
        self.data = b""

    def gettimeout(self) -> float:
        return 0.0

    def setblocking(self, flag: bool) -> None:
        pass

    def sendall(self, data: bytes) -> None:
        self.data += data

    send = sendall


class PrereadThreadWorker(ThreadWorker):
    """gthread whose event loop reads each request whole (within ``read_timeout`` s) before a thread serves it."""

    read_timeout = 15.0
    max_body_bytes = 32 * 1024 * 1024

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reading: dict = {}  # connection -> deadline, in the order reading began (so by deadline)

    @property
    def max_head_bytes(self) -> int:
        cfg = self.cfg
        return cfg.limit_request_line + 4 + cfg.limit_request_fields * (cfg.limit_request_field_size + 2)

    def enqueue_req(self, conn) -> None:
        """Every connection with a request to serve reads it whole first (TLS ones go to gthread as they are)."""
        if getattr(conn, "preread", None) is not None or self.cfg.is_ssl:
            super().enqueue_req(conn)
            return
        pending = conn.parser.unreader.take_buffered() if conn.parser is not None else b""
        conn.preread = bytearray(pending)
        conn.continued = False
        if request_complete(conn.preread, self.max_head_bytes, self.max_body_bytes):
            super().enqueue_req(conn)
            return
        conn.sock.setblocking(False)
        self.reading[conn] = time.monotonic() + self.read_timeout
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_readable, conn))

    def _on_readable(self, conn, _sock) -> None:
        try:
            data = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away before its request was in
            self._stop_reading(conn)
            self.nr_conns -= 1
            conn.close()
            return
        conn.preread += data
        if not conn.continued and HEAD_END in conn.preread:
            conn.continued = True
            head = bytes(conn.preread[:conn.preread.find(HEAD_END)]).lower()
            if _EXPECT_CONTINUE.search(head):  # the client sends its body only after this
                util.write_nonblock(conn.sock, CONTINUE)
        if request_complete(conn.preread, self.max_head_bytes, self.max_body_bytes):
            self._stop_reading(conn)
            conn.data_ready = True
            super().enqueue_req(conn)

    def _stop_reading(self, conn) -> None:
        self.reading.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.poller.unregister(conn.sock)

    def handle(self, conn):
        """In a request thread: hand what the event loop read to gunicorn's parser, then serve as gthread does."""
        data, conn.preread = getattr(conn, "preread", None), None
        if data:
            conn.init()
            conn.parser.unreader.unread(bytes(data))
        return super().handle(conn)

    def murder_pending(self) -> None:
        """Also answer 408 to, and close, every connection whose request is late."""
        super().murder_pending()
        now = time.monotonic()
        for conn, deadline in list(self.reading.items()):
            if deadline > now:
                break
            self._stop_reading(conn)
            self.nr_conns -= 1
            message = f"the request did not arrive within {self.read_timeout:g} s"
            with contextlib.suppress(OSError):
                util.write_nonblock(conn.sock, json_error_response(408, "Request Timeout", message))
            conn.close()

    def handle_error(self, req, client, addr, exc) -> None:
        """gunicorn's answer to a request it could not parse (or serve), sent as JSON."""
        capture = _Capture()
        super().handle_error(req, capture, addr, exc)
        status = _STATUS.match(capture.data)
        if status is None:
            return
        found = _HTML_MESSAGE.search(capture.data)
        message = html.unescape(found.group(1).decode("latin-1")) if found else ""
        reason = status.group(2).decode("latin-1")
        try:
            util.write_nonblock(client, json_error_response(int(status.group(1)), reason, message))
        except Exception:
            self.log.debug("Failed to send error message.")


def worker_class(read_timeout: float, max_body_bytes: int) -> type[PrereadThreadWorker]:
    """The worker class with these limits (gunicorn takes a class; the forked worker inherits it)."""
    return type("PrereadThreadWorker", (PrereadThreadWorker,),
                {"read_timeout": read_timeout, "max_body_bytes": max_body_bytes, "__module__": __name__})
