"""Chat template rendering: the checkpoint's own Jinja template in a sandbox, or a built-in Qwen3.5 one."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A conversation the template cannot render: bad messages, unsupported content or a template error."""


# Our own template, written from the Qwen3.5 behaviour: ChatML turns, XML tool calls, reasoning kept only
# after the last real user query, and thinking OFF unless enable_thinking is true (as in the small models). The
# developer role (which OpenAI clients send) is a system message.
BUILTIN_TEMPLATE = r"""
{%- set tool_instructions = 'If you decide to call a function, reply ONLY in the format below, '
    ~ 'with nothing after it:\n\n'
    ~ '<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n'
    ~ '<parameter=example_parameter_2>\nA value for the second parameter\nmay span\nseveral lines\n</parameter>\n'
    ~ '</function>\n</tool_call>\n\n'
    ~ '<IMPORTANT>\nRemember:\n'
    ~ '- The <function=...></function> block must always be nested inside <tool_call></tool_call> tags\n'
    ~ '- Every required parameter must be given\n'
    ~ '- Any reasoning about the call goes in plain language BEFORE the call, never after it\n'
    ~ '- If no function call is needed, answer normally from your own knowledge and do not mention functions\n'
    ~ '</IMPORTANT>' %}
{%- macro param_value(value) %}
    {%- if value is mapping or (value is iterable and value is not string) %}
        {{- value | tojson }}
    {%- else %}
        {{- value | string }}
    {%- endif %}
{%- endmacro %}
{%- set ns = namespace(last_query=messages | length) %}
{%- for message in messages %}
    {%- set text = (message.content or '') | trim %}
    {%- if message.role == 'user' and not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- set has_system = messages and messages[0].role in ('system', 'developer') %}
{%- set system_text = ((messages[0].content or '') | trim) if has_system else '' %}
{%- if tools %}
    {{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' ~ tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\n' ~ tool_instructions }}
    {%- if system_text %}
        {{- '\n\n' ~ system_text }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif has_system %}
    {{- '<|im_start|>system\n' ~ system_text ~ '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content or '' %}
    {%- if message.role in ('system', 'developer') %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' ~ content ~ '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {%- set content = content | trim %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_query %}
            {{- '<think>\n' ~ reasoning | trim ~ '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if not loop.first %}
                {{- '\n' }}
            {%- elif content %}
                {{- '\n\n' }}
            {%- endif %}
            {{- '<tool_call>\n<function=' ~ fn.name ~ '>\n' }}
            {%- for name, value in (fn.arguments or {}) | items %}
                {{- '<parameter=' ~ name ~ '>\n' ~ param_value(value) ~ '\n</parameter>\n' }}
            {%- endfor %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' ~ content ~ '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking %}
        {{- '<think>\n' }}
    {%- else %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

_IMAGE_PART_TYPES = frozenset({"image_url", "image", "input_image"})
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _make_env() -> ImmutableSandboxedEnvironment:
    """The rendering environment of HF transformers' apply_chat_template."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


_ENV = _make_env()


def _text_content(content: Any) -> str | None:
    """Message content as plain text; OpenAI content-part lists keep only (concatenated) text parts."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError("message content must be a string or a list of content parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in _IMAGE_PART_TYPES:
            raise ChatTemplateError("images are not supported by this text-only server")
        else:
            raise ChatTemplateError(f"unsupported content part: {kind!r}")
    return "".join(texts)


def _parse_tool_call(call: Any) -> Any:
    """Turn a tool call's JSON-string arguments (as OpenAI clients send them) into a dict."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    raw = function["arguments"]
    try:
        arguments = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as e:
        raise ChatTemplateError(f"tool call arguments are not valid JSON: {e}") from e
    if not isinstance(arguments, dict):
        raise ChatTemplateError("tool call arguments must be a JSON object")
    return {**call, "function": {**function, "arguments": arguments}}


def _prepare_message(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ChatTemplateError("each message must be an object")
    prepared = dict(message)
    if "content" in prepared:
        prepared["content"] = _text_content(prepared["content"])
    if isinstance(prepared.get("tool_calls"), list):
        prepared["tool_calls"] = [_parse_tool_call(call) for call in prepared["tool_calls"]]
    return prepared


def _config_template(config: dict[str, Any]) -> str | None:
    """The chat_template entry of tokenizer_config.json: a string, or the "default" of a named list."""
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """bos/eos/pad/unk token strings, passed to templates as HF does."""
    tokens = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


class ChatTemplate:
    """A compiled chat template that renders OpenAI-style messages to a prompt string."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"invalid chat template: {e}") from e
        self.source = source
        self._special_tokens = dict(special_tokens or {})

    @classmethod
    def builtin(cls) -> ChatTemplate:
        return cls(BUILTIN_TEMPLATE)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> ChatTemplate:
        """The checkpoint's chat_template.jinja, else tokenizer_config.json's chat_template, else the built-in."""
        directory = Path(checkpoint_dir)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        jinja_path = directory / "chat_template.jinja"
        source = jinja_path.read_text(encoding="utf-8") if jinja_path.is_file() else _config_template(config)
        return cls(source, _special_tokens(config)) if source else cls.builtin()

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render the conversation; template_kwargs (e.g. enable_thinking=False) go to the template."""
        prepared = [_prepare_message(message) for message in messages]
        context = {**self._special_tokens, **template_kwargs}
        try:
            return self._template.render(
                messages=prepared, tools=tools, add_generation_prompt=add_generation_prompt, **context
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # whatever the template raises on these messages (a sandbox bound too)
            raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from e

    @cached_property
    def default_enable_thinking(self) -> bool:
        """Whether the generation prompt opens a think block when enable_thinking is not given."""
        return self.render([{"role": "user", "content": "hi"}]).endswith("<think>\n")
