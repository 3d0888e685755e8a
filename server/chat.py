"""/v1/chat/completions: the prompt from the chat template, and responses with reasoning and tool calls.

Reasoning is split off at </think> (only when thinking is on for the request) and returned as ``reasoning``
(current vLLM's name) and ``reasoning_content`` (its older one); tool calls are parsed from the answer in
Qwen3.5's XML format into ``tool_calls``, with finish_reason "tool_calls". Streams send the role first, then
reasoning, content and tool-call deltas (each token's logprobs with the first delta that carries its text),
then a chunk with the finish reason, then the usage when asked for.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from hybrid_jax.chat import ChatTemplate, ChatTemplateError
from hybrid_jax.special_text import PlainSpecialText
from hybrid_jax.tokenizer import Tokenizer
from server.completions import ENGINE_FAILED, response_header
from server.errors import APIError, bad_request
from server.generation import Choice, Generation
from server.limits import check_text_length
from server.logprobs import chat_logprobs, token_namer
from server.protocol import JSON, ChatRequest
from server.reasoning_parser import ReasoningStreamer, split_reasoning
from server.tool_parser import ToolCallStreamer, parse_tool_calls


def thinking_enabled(request_kwargs: JSON, default_kwargs: JSON, template: ChatTemplate) -> bool:
    """enable_thinking from the request, else the server's default kwargs, else the template's own default."""
    for kwargs in (request_kwargs, default_kwargs):
        if "enable_thinking" in kwargs:
            return bool(kwargs["enable_thinking"])
    return template.default_enable_thinking


def chat_prompt(request: ChatRequest, template: ChatTemplate, tokenizer: Tokenizer, default_kwargs: JSON,
                max_model_len: int, special_tokens_as_text: bool = True) -> tuple[list[int], bool]:
    """(prompt token ids, thinking) of the conversation; a template error is a 400 on ``messages``.

    With ``special_tokens_as_text``, special-token text in the messages and tools is encoded as plain text;
    only the template's own markup gives control tokens. A prompt too long for the context by its length in
    characters is rejected before it is tokenized.
    """
    thinking = thinking_enabled(request.template_kwargs, default_kwargs, template)
    kwargs = {**default_kwargs, **request.template_kwargs, "enable_thinking": thinking}
    plain = PlainSpecialText(tokenizer) if special_tokens_as_text else None
    mark = plain.mark if plain is not None else (lambda value: value)
    try:
        text = template.render(mark(request.messages), tools=mark(request.tools),
                               add_generation_prompt=request.add_generation_prompt, **mark(kwargs))
    except ChatTemplateError as e:
        raise bad_request(f"messages: {e}", "messages") from e
    check_text_length(text, max_model_len, tokenizer, "messages")
    return (plain.encode(text) if plain is not None else tokenizer.encode(text)), thinking


def reasoning_fields(reasoning: str | None) -> JSON:
    """The reasoning under both of vLLM's names."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


class ChoiceParser:
    """Splits one choice's output into reasoning, content and tool calls: whole, or as stream deltas."""

    def __init__(self, thinking: bool, tools: list[JSON] | None, parse_tools: bool, parallel_tool_calls: bool):
        self.thinking, self.tools = thinking, tools
        self.parse_tools, self.parallel = parse_tools, parallel_tool_calls
        self._reasoning = ReasoningStreamer(thinking)
        self._calls = ToolCallStreamer(tools) if parse_tools else None
        self.called = False  # a tool call was streamed

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of a complete output."""
        reasoning, content = split_reasoning(text, self.thinking)
        calls: list[JSON] = []
        if self.parse_tools and content is not None:
            content, calls = parse_tool_calls(content, self.tools)
            calls = calls if self.parallel else calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": calls}
        if self.thinking:
            message.update(reasoning_fields(reasoning))
        return message

    def feed(self, text: str) -> list[JSON]:
        """Deltas for the next piece of output text."""
        return self._deltas(*self._reasoning.feed(text), final=False)

    def finish(self) -> list[JSON]:
        """Deltas that flush what was held back."""
        return self._deltas(*self._reasoning.finish(), final=True)

    def _deltas(self, reasoning: str, content: str, final: bool) -> list[JSON]:
        deltas: list[JSON] = [reasoning_fields(reasoning)] if reasoning else []
        if self._calls is None:
            return deltas + ([{"content": content}] if content else [])
        parsed = self._calls.feed(content) if content else []
        if final:
            parsed += self._calls.finish()
        for delta in parsed:
            calls = [c for c in delta.get("tool_calls", []) if self.parallel or c["index"] == 0]
            if "tool_calls" not in delta:
                deltas.append(delta)
            elif calls:
                deltas.append({"tool_calls": calls})
                self.called = True
        return deltas


class ChatWriter:
    """Builds the response of one chat request from its Generation."""

    def __init__(self, request: ChatRequest, generation: Generation, thinking: bool, tokenizer: Tokenizer,
                 model: str):
        self.request, self.generation = request, generation
        self.name = token_namer(tokenizer, request.tokens_as_ids)
        self.parsers = [ChoiceParser(thinking, request.tools, request.parse_tools, request.parallel_tool_calls)
                        for _ in generation.choices]
        self.header = response_header("chatcmpl", "chat.completion", model)

    def _logprobs(self, events) -> dict | None:
        top = self.request.params.logprobs  # top_logprobs (0 when only logprobs is true), None without logprobs
        return None if top is None else chat_logprobs(self.name, events, top)

    def response(self) -> dict:
        """Wait for every choice; the whole response body."""
        for _ in self.generation.events():
            pass
        if self.generation.failed:
            raise APIError(500, ENGINE_FAILED)
        choices = []
        for choice, parser in zip(self.generation.choices, self.parsers, strict=True):
            message = parser.message(choice.output.text)
            finish_reason = "tool_calls" if message["tool_calls"] else choice.output.finish_reason
            choices.append({"index": choice.index, "message": message, "logprobs": self._logprobs(choice.tokens),
                            "finish_reason": finish_reason, "stop_reason": choice.output.stop_reason})
        return {**self.header, "choices": choices, "usage": self.generation.usage()}

    def _chunk(self, choice: Choice, delta: JSON, logprobs: dict | None = None, final: bool = False) -> dict:
        parser = self.parsers[choice.index]
        finish_reason = ("tool_calls" if parser.called else choice.output.finish_reason) if final else None
        entry = {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if final:
            entry["stop_reason"] = choice.output.stop_reason
        chunk = {**self.header, "object": "chat.completion.chunk", "choices": [entry]}
        if self.request.continuous_usage:
            chunk["usage"] = self.generation.choice_usage(choice)
        return chunk

    def chunks(self) -> Iterator[dict]:
        """The stream: role deltas, content / reasoning / tool-call deltas, finish chunks, usage. A token's
        logprobs go with the first delta that carries its text (held-back text holds them back too)."""
        unsent: list[list] = [[] for _ in self.generation.choices]  # per choice: token events not yet sent
        for choice in self.generation.choices:
            yield self._chunk(choice, {"role": "assistant", "content": ""})
        for choice, event, text in self.generation.events():
            if choice.output.finish_reason == "error":
                yield APIError(500, ENGINE_FAILED).body()
                return
            parser = self.parsers[choice.index]
            deltas = parser.feed(text) if text else []
            if choice.finished:
                deltas += parser.finish()
            events = unsent[choice.index]
            if event.token_id is not None:
                events.append(event)
            for delta in deltas:
                yield self._chunk(choice, delta, self._logprobs(events) if events else None)
                events.clear()
            if choice.finished:
                yield self._chunk(choice, {}, self._logprobs(events) if events else None, final=True)
        if self.request.include_usage:
            yield {**self.header, "object": "chat.completion.chunk", "choices": [], "usage": self.generation.usage()}
