"""Parse Qwen3.5 XML tool calls into OpenAI tool calls (the format of vLLM's `qwen3_coder` parser).

The model writes, after any plain text::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are converted by the JSON-schema type the request's tools declare for each parameter. The parser is
tolerant: a missing </parameter> ends at the next <parameter=, a block without </tool_call> ends at the next
<tool_call>, and an output cut short keeps its complete parts (calls with a complete <function=NAME> tag, and
their terminated parameters). A duplicated parameter keeps its first value.
"""

from __future__ import annotations

import json
import math
import random
import string
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_FUNCTION = "<function="
_FUNCTION_END = "</function>"
_PARAMETER = "<parameter="
_PARAMETER_END = "</parameter>"

_TAGS = (TOOL_CALL_START, TOOL_CALL_END, _FUNCTION, _FUNCTION_END, _PARAMETER, _PARAMETER_END)
_MAX_TAG_LEN = 256  # longest tag (with its name) recognised while streaming; finish() catches longer ones
_ID_CHARS = string.ascii_letters + string.digits

Schemas = dict[str, dict[str, Any]]  # tool name -> parameter name -> JSON schema
Call = dict[str, Any]  # an OpenAI tool call


def new_call_id() -> str:
    return "call_" + "".join(random.choices(_ID_CHARS, k=24))


def parameter_schemas(tools: list[dict[str, Any]] | None) -> Schemas:
    """Parameter schemas by tool name, from OpenAI tools ({"type": "function", "function": {...}})."""
    schemas: Schemas = {}
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        parameters = function.get("parameters") if isinstance(function, dict) else None
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if isinstance(function.get("name"), str) and isinstance(properties, dict):
            schemas[function["name"]] = properties
    return schemas


def schema_type(schema: Any) -> str | None:
    """The declared type, ignoring "null" (also inside anyOf/oneOf)."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if kind is None:
        branches = schema.get("anyOf") or schema.get("oneOf") or []
        kind = [branch.get("type") for branch in branches if isinstance(branch, dict)]
    if isinstance(kind, list):
        kind = next((k for k in kind if k not in ("null", None)), None)
    return kind if isinstance(kind, str) else None


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _reject_constant(text: str) -> float:
    raise ValueError(text)


def _json_or_text(text: str) -> Any:
    """The JSON value of text (finite numbers only), else text itself."""
    try:
        return json.loads(text, parse_float=_finite_float, parse_constant=_reject_constant)
    except ValueError:
        return text


def convert_value(raw: str, schema: Any) -> Any:
    """A raw parameter value converted by its schema; strings lose one leading and trailing newline."""
    value = raw.removeprefix("\n").removesuffix("\n")
    kind = schema_type(schema)
    if kind == "string":
        return value
    parsed = _json_or_text(value)
    if kind == "boolean" and isinstance(parsed, str) and parsed.strip().lower() in ("true", "false"):
        return parsed.strip().lower() == "true"
    if kind == "integer" and isinstance(parsed, float) and parsed.is_integer():
        return int(parsed)
    return parsed


def _block_end(text: str, start: int) -> tuple[int, int] | None:
    """For a call block whose body starts at `start`: (body end, where scanning resumes), or None if open."""
    close = text.find(TOOL_CALL_END, start)
    following = text.find(TOOL_CALL_START, start)
    if following >= 0 and (close < 0 or following < close):
        return following, following
    if close >= 0:
        return close, close + len(TOOL_CALL_END)
    return None


def _function_header(block: str) -> tuple[str, int] | None:
    """(name, offset after the tag) of the block's complete <function=NAME> tag."""
    start = block.find(_FUNCTION)
    end = block.find(">", start + len(_FUNCTION)) if start >= 0 else -1
    name = block[start + len(_FUNCTION) : end].strip() if end >= 0 else ""
    return (name, end + 1) if name else None


def _function_body(block: str, start: int, terminated: bool) -> tuple[str, bool]:
    """(body, closed): the function body from `start` up to </function>, and whether it can still grow."""
    end = block.find(_FUNCTION_END, start)
    return (block[start:end], True) if end >= 0 else (block[start:], terminated)


def _next_parameter(body: str, pos: int, closed: bool) -> tuple[str, str, int] | None:
    """(name, raw value, offset after it) of the next terminated parameter at or after `pos`.

    A value ends at </parameter>, at the next <parameter= (missing close tag) or at the end of a closed body.
    """
    start = body.find(_PARAMETER, pos)
    head_end = body.find(">", start + len(_PARAMETER)) if start >= 0 else -1
    if head_end < 0:
        return None
    name = body[start + len(_PARAMETER) : head_end].strip()
    close = body.find(_PARAMETER_END, head_end + 1)
    following = body.find(_PARAMETER, head_end + 1)
    if following >= 0 and (close < 0 or following < close):
        return name, body[head_end + 1 : following], following
    if close >= 0:
        return name, body[head_end + 1 : close], close + len(_PARAMETER_END)
    if closed:
        return name, body[head_end + 1 :], len(body)
    return None


def _parse_block(block: str, terminated: bool, schemas: Schemas) -> Call | None:
    """One OpenAI tool call from the text of a <tool_call> block, or None if it has no function tag."""
    header = _function_header(block)
    if header is None:
        return None
    name, start = header
    body, closed = _function_body(block, start, terminated)
    arguments: dict[str, Any] = {}
    pos = 0
    while (parameter := _next_parameter(body, pos, closed)) is not None:
        key, raw, pos = parameter
        if key not in arguments:
            arguments[key] = convert_value(raw, schemas.get(name, {}).get(key))
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[Call]]:
    """(content, calls) of a complete output.

    Content is the text before the first <tool_call> (None if blank); without any parseable call it is the
    whole text.
    """
    schemas = parameter_schemas(tools)
    first = text.find(TOOL_CALL_START)
    calls = []
    pos = first
    while pos >= 0:
        body_start = pos + len(TOOL_CALL_START)
        bounds = _block_end(text, body_start)
        block = text[body_start : bounds[0]] if bounds else text[body_start:]
        if (call := _parse_block(block, bounds is not None, schemas)) is not None:
            calls.append(call)
        pos = text.find(TOOL_CALL_START, bounds[1]) if bounds else -1
    if not calls:
        return text, []
    content = text[:first]
    return (content if content.strip() else None), calls


def _closes_tag(text: str, start: int) -> bool:
    """Whether a ">" at or after `start` ends one of the XML tags (the only way parsing can progress)."""
    end = text.find(">", start)
    while end >= 0:
        begin = text.rfind("<", max(0, end - _MAX_TAG_LEN), end)
        if begin >= 0 and text.startswith(_TAGS, begin):
            return True
        end = text.find(">", end + 1)
    return False


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest proper prefix of tag that text ends with."""
    return next((n for n in range(len(tag) - 1, 0, -1) if text.endswith(tag[:n])), 0)


class ToolCallStreamer:
    """Incremental parse_tool_calls producing OpenAI chat-completion `delta` dicts.

    Content streams until a <tool_call> starts (a partial tag is held back; so is leading whitespace, which
    is dropped when a call follows it). Each call then sends a delta with its index, id, type, name and
    arguments "", and one JSON fragment per completed parameter; the fragments of a call concatenate to the
    arguments string parse_tool_calls gives.
    """

    def __init__(self, tools: list[dict[str, Any]] | None = None):
        self._schemas = parameter_schemas(tools)
        self._text = ""
        self._sent = 0  # characters of text sent as content
        self._calling = False  # a <tool_call> was seen
        self._scan = 0  # offset of the open block's <tool_call>, or where the next one is searched from
        self._in_block = False
        self._count = 0  # calls started
        self._name: str | None = None  # name of the open call, once its function tag is complete
        self._body_start = 0
        self._param_pos = 0
        self._keys: set[str] = set()

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """Deltas for the next piece of generated text."""
        start = len(self._text)
        self._text += delta
        if not self._calling:
            return self._feed_content()
        return self._advance() if _closes_tag(self._text, start) else []

    def finish(self) -> list[dict[str, Any]]:
        """Deltas that flush what was held back at the end of generation."""
        if not self._calling:
            return self._content(len(self._text), force=True)
        deltas = self._advance() + self._close_call()
        if not self._count:  # nothing parseable: the whole text is content
            deltas += self._content(len(self._text), force=True)
        return deltas

    def _feed_content(self) -> list[dict[str, Any]]:
        start = self._text.find(TOOL_CALL_START, self._sent)
        if start < 0:
            return self._content(len(self._text) - _partial_tag(self._text, TOOL_CALL_START))
        self._calling, self._scan = True, start
        return self._content(start) + self._advance()

    def _content(self, end: int, force: bool = False) -> list[dict[str, Any]]:
        """Send text[sent:end] as content, unless everything up to end is still blank (and not forced)."""
        if end <= self._sent or not (force or self._sent or self._text[:end].strip()):
            return []
        piece, self._sent = self._text[self._sent : end], end
        return [{"content": piece}]

    def _advance(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while True:
            if not self._in_block:
                start = self._text.find(TOOL_CALL_START, self._scan)
                if start < 0:
                    return deltas
                self._scan, self._in_block = start, True
            body_start = self._scan + len(TOOL_CALL_START)
            bounds = _block_end(self._text, body_start)
            block = self._text[body_start : bounds[0]] if bounds else self._text[body_start:]
            deltas += self._advance_block(block, terminated=bounds is not None)
            if bounds is None:
                return deltas
            deltas += self._close_call()
            self._scan, self._in_block = bounds[1], False

    def _advance_block(self, block: str, terminated: bool) -> list[dict[str, Any]]:
        deltas = []
        if self._name is None:
            header = _function_header(block)
            if header is None:
                return []
            self._name, self._body_start = header
            self._count += 1
            function = {"name": self._name, "arguments": ""}
            deltas.append(self._call_delta({"id": new_call_id(), "type": "function", "function": function}))
        body, closed = _function_body(block, self._body_start, terminated)
        while (parameter := _next_parameter(body, self._param_pos, closed)) is not None:
            key, raw, self._param_pos = parameter
            if key in self._keys:
                continue
            value = convert_value(raw, self._schemas.get(self._name, {}).get(key))
            piece = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
            deltas.append(self._arguments_delta((", " if self._keys else "{") + piece))
            self._keys.add(key)
        return deltas

    def _close_call(self) -> list[dict[str, Any]]:
        if self._name is None:
            return []
        delta = self._arguments_delta("}" if self._keys else "{}")
        self._name, self._param_pos, self._keys = None, 0, set()
        return [delta]

    def _call_delta(self, fields: dict[str, Any]) -> dict[str, Any]:
        return {"tool_calls": [{"index": self._count - 1, **fields}]}

    def _arguments_delta(self, arguments: str) -> dict[str, Any]:
        return self._call_delta({"function": {"arguments": arguments}})
