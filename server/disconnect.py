"""Notice a client that hangs up while a non-streaming request is still generating.

A streaming response learns it from a failed write; a non-streaming one writes nothing until the end, so a
watcher thread peeks at the connection (gunicorn puts it in ``environ["gunicorn.socket"]``) instead.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

POLL_INTERVAL_S = 0.5


def client_gone(sock: socket.socket) -> bool | None:
    """True when the peer has closed the connection, False while it is open, None when it cannot be told."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    except ValueError:  # e.g. a TLS socket, which takes no recv flags
        return None


class DisconnectWatch:
    """While the ``with`` block runs, check ``sock`` every POLL_INTERVAL_S; call ``on_gone`` once if it closes.

    A peer that only shut down its sending side looks the same as one that closed the connection (both read
    as end of file), so both count as gone; ``gone`` then tells the handler not to send a cut-short answer.
    """

    def __init__(self, sock: socket.socket | None, on_gone: Callable[[], None]):
        self._sock, self._on_gone = sock, on_gone
        self._done = threading.Event()
        self.gone = False

    def __enter__(self) -> DisconnectWatch:
        if self._sock is not None:
            threading.Thread(target=self._watch, name="disconnect-watch", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(POLL_INTERVAL_S):
            gone = client_gone(self._sock)
            if gone is None:
                return
            if gone:
                self.gone = True
                self._on_gone()
                return
