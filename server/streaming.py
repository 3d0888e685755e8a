"""Server-sent events: ``data: {json}\\n\\n`` chunks ending with ``data: [DONE]\\n\\n``.

When the client goes away, the WSGI server's write fails and it closes the response iterable; ``close`` then
runs ``on_close`` (which cancels the engine requests). Closing works whether or not iteration has started,
which a generator's ``finally`` would not guarantee.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

from flask import Response

DONE = "data: [DONE]\n\n"


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _EventStream:
    """An SSE body over ``chunks`` whose ``close`` (called by the WSGI server in every case) runs ``on_close``."""

    def __init__(self, chunks: Iterator[dict], on_close: Callable[[], None]):
        self._chunks, self._on_close = chunks, on_close

    def __iter__(self) -> Iterator[str]:
        for chunk in self._chunks:
            yield sse_event(chunk)
        yield DONE

    def close(self) -> None:
        self._on_close()


def sse_response(chunks: Iterator[dict], on_close: Callable[[], None]) -> Response:
    """Stream ``chunks`` as SSE; ``on_close`` runs however the stream ends (finished, failed or disconnected)."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return Response(_EventStream(chunks, on_close), mimetype="text/event-stream", headers=headers)
