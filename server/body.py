"""The JSON body of a request: media type, size, syntax, nesting depth and text all checked, each a 4xx.

``application/json`` is required (415 otherwise), so a browser's cross-site "simple" POST (text/plain, form
types) cannot reach the API. A body over the limit is a 413, with or without a Content-Length. Nesting
deeper than MAX_DEPTH and strings holding lone surrogates (valid JSON escapes that no UTF-8 text, and so
no tokenizer, accepts) are 400s naming the top-level field.
"""

from __future__ import annotations

import json
from typing import Any

from flask import Request

from server.errors import APIError, bad_request

MAX_DEPTH = 64  # nesting levels of arrays and objects (an OpenAI body needs about six)
READ_BYTES = 1 << 20
SCALARS = {int, float, bool, type(None)}  # JSON values that hold no text and do not nest


def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, read up to one byte past ``max_bytes`` (a chunked body has no length to check first)."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise APIError(413, f"the request body is larger than {max_bytes} bytes")
    stream = request.environ["wsgi.input"]
    parts, size = [], 0
    while size <= max_bytes:
        part = stream.read(min(READ_BYTES, max_bytes + 1 - size))
        if not part:
            break
        parts.append(part)
        size += len(part)
    if size > max_bytes:
        raise APIError(413, f"the request body is larger than {max_bytes} bytes")
    return b"".join(parts)


def _problem(value: Any, depth: int = 1) -> str | None:
    """Why ``value`` cannot be served (too deep, a lone surrogate), or None; iterative, so any depth is safe."""
    stack = [(value, depth)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return "contains a lone surrogate (text must be valid Unicode)"
        elif isinstance(item, (list, dict)):
            if depth > MAX_DEPTH:
                return f"is nested more than {MAX_DEPTH} levels deep"
            children = item.values() if isinstance(item, dict) else item
            if set(map(type, children)) <= SCALARS:  # a prompt's token ids: checked in C, none pushed
                children = ()
            stack.extend((child, depth + 1) for child in children if isinstance(child, (str, list, dict)))
            if isinstance(item, dict):
                stack.extend((key, depth) for key in item)
    return None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def json_body(request: Request, max_bytes: int) -> Any:
    """The parsed body of a JSON endpoint."""
    if not request.is_json:
        raise APIError(415, f"Content-Type must be application/json, got {request.mimetype or 'none'!r}")
    data = read_body(request, max_bytes)
    try:
        body = json.loads(data, parse_constant=_reject_constant)
    except RecursionError as e:
        raise bad_request(f"the request body is nested more than {MAX_DEPTH} levels deep") from e
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise bad_request(f"the request body is not valid JSON: {e}") from e
    if isinstance(body, dict):
        for name, value in body.items():
            if _problem(name) is not None:
                raise bad_request("the request body has a field name that " + _problem(name))
            if (why := _problem(value, 2)) is not None:
                raise bad_request(f"{name}: {why}", name)
    elif (why := _problem(body)) is not None:
        raise bad_request(f"the request body {why}")
    return body
