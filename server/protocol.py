"""Request bodies of the OpenAI endpoints -> validated request records; every problem is a 400 naming the field.

Field names, defaults and value types follow vLLM's OpenAI server: unknown fields are ignored, ``null`` means
"not given", ranges are checked by ``SamplingParams``; the structured-output fields are read by
`server.structured`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hybrid_jax.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from server.errors import APIError, bad_request, from_value_error
from server.structured import parse_structured, tool_choice_structured

JSON = dict[str, Any]
TOOL_CHOICES = ("none", "auto", "required")
# Template arguments the server sets itself; chat_template_kwargs may not override them.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")
SEED_RANGE = (-(2**63), 2**63 - 1)
MAX_CHOICES = 256  # prompts x n of one request (each choice is an engine request with a forwarding thread)


def all_ints(values: list) -> bool:
    """Every value is an int (not a bool): one scan of their types in C."""
    return set(map(type, values)) <= {int}


class Reader:
    """Typed, optional access to the fields of a JSON object body."""

    def __init__(self, body: Any):
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        self.body: JSON = body

    def get(self, name: str, types: type | tuple[type, ...], what: str, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        allowed = types if isinstance(types, tuple) else (types,)
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise bad_request(f"{name}: must be {what}", name)
        return value

    def integer(self, name: str, default: int | None = None, low: int | None = None, high: int | None = None):
        """An integer; like pydantic's lax mode (vLLM), a float without a fraction counts as one."""
        value = self.get(name, (int, float), "an integer", default)
        if isinstance(value, float):
            if not value.is_integer():
                raise bad_request(f"{name}: must be an integer", name)
            value = int(value)
        if value is not None and ((low is not None and value < low) or (high is not None and value > high)):
            bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise bad_request(f"{name}: must be an integer {bounds}, got {value}", name)
        return value

    def number(self, name: str, default: float | None = None) -> float | None:
        value = self.get(name, (int, float), "a number", default)
        return None if value is None else float(value)

    def boolean(self, name: str, default: bool) -> bool:
        return self.get(name, bool, "a boolean", default)

    def string(self, name: str, default: str | None = None) -> str | None:
        return self.get(name, str, "a string", default)

    def object(self, name: str) -> JSON:
        return self.get(name, dict, "an object", {})

    def array(self, name: str, default: list | None = None) -> list | None:
        return self.get(name, list, "an array", default)

    def integers(self, name: str) -> list[int]:
        values = self.array(name, [])
        if not all_ints(values):
            raise bad_request(f"{name}: must be an array of integers", name)
        return values


@dataclass
class GenerationRequest:
    """What both endpoints share: sampling, choices per prompt, streaming."""

    model: str | None
    params: SamplingParams  # max_tokens is a placeholder until max_tokens below is resolved
    max_tokens: int | None  # None: the rest of the context
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage in every chunk (stream_options.continuous_usage_stats)
    tokens_as_ids: bool  # logprobs name tokens "token_id:N" (vLLM's return_tokens_as_token_ids)
    structured_field: str | None  # the field params.structured_outputs came from (what its errors name)
    cache_salt: str | None  # prefix cache blocks shared only with requests of the same salt (vLLM's field)

    def params_for(self, choice: int, max_tokens: int) -> SamplingParams:
        """The sampling params of sample ``choice`` (0..n-1): seed + choice when seeded, as vLLM does; the prompt
        is scored by its first sample only (unless nothing is generated)."""
        seed = None if self.params.seed is None else self.params.seed + choice
        prompt_logprobs = self.params.prompt_logprobs if choice == 0 or max_tokens == 0 else None
        return dataclasses.replace(self.params, max_tokens=max_tokens, seed=seed, prompt_logprobs=prompt_logprobs)


@dataclass
class CompletionRequest(GenerationRequest):
    prompts: list[str | list[int]]
    echo: bool
    prompt_logprobs: int | None  # vLLM's prompt_logprobs field: returned as each choice's prompt_logprobs


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[JSON]
    tools: list[JSON] | None  # rendered into the prompt (None with tool_choice "none")
    parse_tools: bool  # parse tool calls out of the output
    parallel_tool_calls: bool
    template_kwargs: JSON
    add_generation_prompt: bool


def _stop(reader: Reader) -> list[str]:
    stop = reader.body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop: must be a string or an array of strings", "stop")
    return [s for s in stops if s]


def _logit_bias(reader: Reader) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids (as strings, JSON's keys) -> biases; the range is SamplingParams's check."""
    bias = reader.object("logit_bias")
    if not bias:
        return None
    try:
        ids = [int(key) for key in bias]
    except ValueError as e:
        raise bad_request("logit_bias: keys must be token ids (integers)", "logit_bias") from e
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in bias.values()):
        raise bad_request("logit_bias: biases must be numbers", "logit_bias")
    return dict(zip(ids, bias.values(), strict=True))


def _bad_words(reader: Reader) -> list[str]:
    words = reader.array("bad_words", [])
    if not all(isinstance(w, str) for w in words):
        raise bad_request("bad_words: must be an array of strings", "bad_words")
    return words


def _sampling(reader: Reader, defaults: JSON, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
    """SamplingParams from the body; fields the request leaves out take the server's defaults, then vLLM's."""
    numbers = {}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = reader.number(name, defaults.get(name))
        if value is not None:
            numbers[name] = value
    top_k = reader.integer("top_k", defaults.get("top_k"))
    min_tokens = reader.integer("min_tokens", 0, 0)
    allowed = reader.integers("allowed_token_ids") if reader.body.get("allowed_token_ids") is not None else None
    try:
        return SamplingParams(
            max_tokens=max(1, min_tokens),  # a placeholder until max_tokens is resolved
            **numbers,
            **({} if top_k is None else {"top_k": top_k}),
            seed=reader.integer("seed", None, *SEED_RANGE),
            stop=_stop(reader),
            stop_token_ids=reader.integers("stop_token_ids"),
            ignore_eos=reader.boolean("ignore_eos", False),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=reader.boolean("skip_special_tokens", True),
            include_stop_str_in_output=reader.boolean("include_stop_str_in_output", False),
            min_tokens=min_tokens,
            logit_bias=_logit_bias(reader),
            allowed_token_ids=allowed,
            bad_words=_bad_words(reader),
            thinking_token_budget=reader.integer("thinking_token_budget", defaults.get("thinking_token_budget")),
        )
    except ValueError as e:
        raise from_value_error(e) from e


def _stream_options(reader: Reader, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats); as vLLM, usage in every chunk needs include_usage."""
    if reader.body.get("stream_options") is None:
        return False, False
    if not stream:
        raise bad_request("stream_options: only allowed when stream is true", "stream_options")
    options = reader.object("stream_options")
    flags = [options.get(name, default) for name, default in (("include_usage", True),
                                                               ("continuous_usage_stats", False))]
    for name, flag in zip(("include_usage", "continuous_usage_stats"), flags, strict=True):
        if not isinstance(flag, bool):
            raise bad_request(f"stream_options.{name}: must be a boolean", "stream_options")
    return flags[0], flags[0] and flags[1]


def _common(reader: Reader, defaults: JSON, logprobs: int | None, max_tokens: int | None,
            prompt_logprobs: int | None = None) -> JSON:
    structured, field = parse_structured(reader.body)
    stream = reader.boolean("stream", False)
    include_usage, continuous_usage = _stream_options(reader, stream)
    params = _sampling(reader, defaults, logprobs, prompt_logprobs)
    params.structured_outputs = structured
    return dict(model=reader.string("model"), params=params,
                max_tokens=max_tokens, n=reader.integer("n", 1, 1, MAX_CHOICES), stream=stream,
                include_usage=include_usage, continuous_usage=continuous_usage,
                tokens_as_ids=reader.boolean("return_tokens_as_token_ids", False), structured_field=field,
                cache_salt=reader.string("cache_salt"))  # Engine.submit refuses an empty one


def _prompts(value: Any) -> list[str | list[int]]:
    """A completions prompt: a string, token ids, or a non-empty array of either (a batch)."""
    def token_ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all_ints(v)

    if isinstance(value, str):
        return [value]
    if token_ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) or token_ids(v) for v in value):
        return list(value)
    raise bad_request("prompt: must be a string, an array of token ids, or a non-empty array of either", "prompt")


def parse_completion(body: Any, defaults: JSON) -> CompletionRequest:
    reader = Reader(body)
    if "prompt" not in reader.body:
        raise bad_request("prompt: field required", "prompt")
    prompts = _prompts(reader.body["prompt"])
    if reader.body.get("suffix"):
        raise bad_request("suffix: not supported", "suffix")
    logprobs = reader.integer("logprobs", None, 0, MAX_LOGPROBS)
    echo = reader.boolean("echo", False)
    max_tokens = reader.integer("max_tokens", 16, 0)
    if max_tokens == 0 and not echo:
        raise bad_request("max_tokens: must be >= 1 (0 only with echo: the prompt and its logprobs)", "max_tokens")
    prompt_logprobs = reader.integer("prompt_logprobs", None, 0, MAX_LOGPROBS)
    if prompt_logprobs is not None and reader.body.get("stream"):
        raise bad_request("prompt_logprobs: not available when stream is true", "prompt_logprobs")
    # vLLM's: echo with logprobs scores the prompt too; with nothing generated it is always scored (the idiom).
    scored = prompt_logprobs if prompt_logprobs is not None else logprobs if echo else None
    common = _common(reader, defaults, logprobs, max_tokens, 0 if scored is None and max_tokens == 0 else scored)
    best_of = reader.integer("best_of", None, 1)
    if best_of is not None and best_of < common["n"]:
        raise bad_request(f"best_of: must be >= n ({common['n']}), got {best_of}", "best_of")
    if best_of is not None and best_of > common["n"]:
        raise bad_request("best_of: values above n are not supported (as in vLLM's V1 engine)", "best_of")
    if len(prompts) * common["n"] > MAX_CHOICES:
        raise bad_request(f"n: prompts x n must be at most {MAX_CHOICES}", "n")
    return CompletionRequest(**common, prompts=prompts, echo=echo, prompt_logprobs=prompt_logprobs)


def _tool_name(tool: Any) -> str:
    function = tool.get("function") if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(name, str) and name):
        raise bad_request("tools: each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools")
    for key, kind, what in (("parameters", dict, "an object (a JSON schema)"), ("description", str, "a string"),
                            ("strict", bool, "a boolean")):
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise bad_request(f"tools: function.{key} must be {what}", "tools")
    return name


def _tool_choice(reader: Reader, tools: list[JSON]) -> str:
    """"none", "auto", "required" or a function name; tools must allow it."""
    choice = reader.body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("tool_choice: a named choice must be "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        if name not in {_tool_name(t) for t in tools}:
            raise bad_request(f"tool_choice: the function {name!r} is not among the tools", "tool_choice")
        return name
    if choice not in TOOL_CHOICES:
        raise bad_request("tool_choice: must be \"none\", \"auto\", \"required\" or a named function", "tool_choice")
    if choice == "required" and not tools:
        raise bad_request("tool_choice: \"required\" needs tools", "tool_choice")
    return choice


def _messages(reader: Reader) -> list[JSON]:
    messages = reader.array("messages")
    if not messages:
        raise bad_request("messages: must be a non-empty array", "messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("messages: each message must be an object with a string role", "messages")
    return messages


def parse_chat(body: Any, defaults: JSON) -> ChatRequest:
    reader = Reader(body)
    messages = _messages(reader)
    tools = reader.array("tools", [])
    for tool in tools:
        _tool_name(tool)
    choice = _tool_choice(reader, tools)
    template_kwargs = reader.object("chat_template_kwargs")
    if reserved := [k for k in RESERVED_TEMPLATE_KWARGS if k in template_kwargs]:
        raise bad_request(f"chat_template_kwargs: may not set {', '.join(reserved)}", "chat_template_kwargs")
    want_logprobs = reader.boolean("logprobs", False)
    top_logprobs = reader.integer("top_logprobs", None, 0, MAX_LOGPROBS)
    if top_logprobs and not want_logprobs:
        raise bad_request("top_logprobs: needs logprobs to be true", "top_logprobs")
    top_logprobs = (top_logprobs or 0) if want_logprobs else None
    max_tokens = reader.integer("max_completion_tokens", None, 1)
    max_tokens = reader.integer("max_tokens", None, 1) if max_tokens is None else max_tokens
    if reader.body.get("prompt_logprobs") is not None:
        raise bad_request("prompt_logprobs: only /v1/completions returns prompt logprobs", "prompt_logprobs")
    common = _common(reader, defaults, top_logprobs, max_tokens)
    parallel = reader.boolean("parallel_tool_calls", True)
    forced = tool_choice_structured(tools, choice, parallel)
    if forced is not None:
        if common["params"].structured_outputs is not None:
            raise bad_request(f"tool_choice: {choice!r} cannot be combined with {common['structured_field']}",
                              "tool_choice")
        common["params"].structured_outputs, common["structured_field"] = forced, "tool_choice"
    return ChatRequest(
        **common,
        messages=messages,
        tools=tools if tools and choice != "none" else None,
        parse_tools=bool(tools) and choice != "none",
        parallel_tool_calls=parallel,
        template_kwargs=template_kwargs,
        add_generation_prompt=reader.boolean("add_generation_prompt", True),
    )


def check_model(requested: str | None, served: str) -> None:
    """404 unless the request names the served model (or names none, which vLLM also accepts)."""
    if requested is not None and requested != served:
        raise APIError(404, f"The model `{requested}` does not exist.", "model", "model_not_found")
