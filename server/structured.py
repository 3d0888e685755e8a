"""Structured-output fields of a request body -> `StructuredOutputsParams` (vLLM's surface), and the grammar that
makes tool_choice "required" or a named function produce Qwen3.5's tool calls.

Accepted, at most one per request: ``response_format`` {"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}; ``structured_outputs`` {json | regex | choice | grammar |
json_object, disable_any_whitespace}; the legacy ``guided_json``, ``guided_regex``, ``guided_choice`` and
``guided_grammar``. Each problem is a 400 naming the field the constraint came from.
"""

from __future__ import annotations

import json
from typing import Any

from hybrid_jax.engine.sampling_params import STRUCTURED_KINDS, StructuredOutputsParams
from server.errors import bad_request
from server.tool_parser import parameter_schemas, schema_type

JSON = dict[str, Any]
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
LEGACY_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
PARAMETER_END = "\n</parameter>\n"


def _params(field: str, **kw) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:
        raise bad_request(f"{field}: {str(e).removeprefix('structured_outputs: ')}", field) from e


def _response_format(value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, dict):
        raise bad_request("response_format: must be an object", "response_format")
    kind = value.get("type", "text")
    if kind not in RESPONSE_FORMATS:
        raise bad_request(f"response_format: type must be one of {', '.join(map(repr, RESPONSE_FORMATS))}"
                          + (" (structural_tag is not supported)" if kind == "structural_tag" else ""),
                          "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return _params("response_format", json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad_request("response_format: json_schema must be an object with a name", "response_format")
    schema = spec.get("schema")
    if schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise bad_request("response_format: json_schema.schema must be an object (a JSON schema)", "response_format")
    return _params("response_format", json=schema)


def _structured_outputs(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs: must be an object", "structured_outputs")
    if value.get("structural_tag") is not None:
        raise bad_request("structured_outputs: structural_tag is not supported", "structured_outputs")
    kw = {k: value[k] for k in STRUCTURED_KINDS if value.get(k) is not None}
    whitespace = value.get("disable_any_whitespace", False)
    if not isinstance(whitespace, bool):
        raise bad_request("structured_outputs: disable_any_whitespace must be a boolean", "structured_outputs")
    return _params("structured_outputs", disable_any_whitespace=whitespace, **kw)


def parse_structured(body: JSON) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the request's structured-output constraint, the field it came from), or (None, None)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append((spec, "response_format"))
    if body.get("structured_outputs") is not None:
        found.append((_structured_outputs(body["structured_outputs"]), "structured_outputs"))
    for field, kind in LEGACY_FIELDS.items():
        if body.get(field) is not None:
            found.append((_params(field, **{kind: body[field]}), field))
    if len(found) > 1:
        names = ", ".join(field for _, field in found)
        raise bad_request(f"{found[1][1]}: only one structured-output constraint per request (got {names})",
                          found[1][1])
    return found[0] if found else (None, None)


def _lark(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _value(name: str, schema: Any, rules: list[str]) -> str:
    """The grammar of one parameter's value and its closing tag, as the tool parser reads it back: raw text for
    a string (an enum's strings, or any text up to the closing tag), else JSON under the parameter's schema."""
    schema = schema if isinstance(schema, dict) else {}
    if schema_type(schema) == "string":
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return "(" + " | ".join(_lark(v) for v in enum) + ") " + _lark(PARAMETER_END)
        rule = f"text_{len(rules)}"
        rules.append(f"{rule}[suffix={_lark(PARAMETER_END)}]: /(?s:.*)/")
        return rule
    return f"%json {json.dumps(schema, ensure_ascii=False)} {_lark(PARAMETER_END)}"


def tool_call_grammar(tools: list[JSON], name: str | None, parallel: bool) -> str:
    """A Lark grammar of Qwen3.5 tool calls: of the function ``name`` (None: any of ``tools``), one call or (with
    ``parallel``) one or more, each parameter in the order its schema lists them (required ones always)."""
    schemas = parameter_schemas(tools)
    rules: list[str] = []
    calls = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        parameters = function.get("parameters") or {}
        required = set(parameters.get("required") or []) if isinstance(parameters, dict) else set()
        parts = [_lark(f"\n<function={function['name']}>\n")]
        for key, schema in schemas.get(function["name"], {}).items():
            part = f"{_lark(f'<parameter={key}>' + chr(10))} {_value(key, schema, rules)}"
            parts.append(part if key in required else f"({part})?")
        parts.append(_lark("</function>\n"))
        calls.append(f"call_{len(calls)}: <tool_call> {' '.join(parts)} </tool_call>")
    alternatives = " | ".join(f"call_{i}" for i in range(len(calls)))
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start, f"call: {alternatives}", *calls, *rules])


def tool_choice_structured(tools: list[JSON], choice: str, parallel: bool) -> StructuredOutputsParams | None:
    """The constraint tool_choice implies: a grammar for "required" or a named function, else None."""
    if choice in ("none", "auto"):
        return None
    return StructuredOutputsParams(grammar=tool_call_grammar(tools, None if choice == "required" else choice,
                                                             parallel))


def check_grammar(engine, params, field: str) -> None:
    """Compile ``params``' grammar (the engine caches it for the request's submit); a 400 naming ``field`` when it
    is invalid or too slow to compile."""
    try:
        engine.compile_grammar(params)
    except ValueError as e:  # GrammarError, or an engine without grammars
        raise bad_request(f"{field}: {str(e).removeprefix('structured_outputs: ')}", field) from e
