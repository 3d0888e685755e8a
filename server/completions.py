"""/v1/completions responses: one JSON body, or a stream of ``text_completion`` chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

from hybrid_jax.tokenizer import Tokenizer
from server.errors import APIError
from server.generation import Choice, Generation
from server.logprobs import completion_logprobs, token_namer
from server.protocol import CompletionRequest

ENGINE_FAILED = "the engine failed while generating; see the server log"


def response_header(prefix: str, obj: str, model: str) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()), "model": model}


class CompletionWriter:
    """Builds the response of one completions request from its Generation."""

    def __init__(self, request: CompletionRequest, generation: Generation, prompt_texts: list[str],
                 tokenizer: Tokenizer, model: str):
        self.request, self.generation = request, generation
        self.name = token_namer(tokenizer, request.tokens_as_ids)
        self.prompt_texts = prompt_texts
        self.header = response_header("cmpl", "text_completion", model)

    def _echo(self, choice: Choice) -> str:
        return self.prompt_texts[choice.index // self.request.n] if self.request.echo else ""

    def _choice(self, choice: Choice, text: str, logprobs: dict | None, final: bool) -> dict:
        output = choice.output
        return {"index": choice.index, "text": text, "logprobs": logprobs,
                "finish_reason": output.finish_reason if final else None,
                "stop_reason": output.stop_reason if final else None}

    def response(self) -> dict:
        """Wait for every choice; the whole response body."""
        for _ in self.generation.events():
            pass
        if self.generation.failed:
            raise APIError(500, ENGINE_FAILED)
        want_logprobs = self.request.params.logprobs is not None
        choices = []
        for choice in self.generation.choices:
            logprobs = None
            if want_logprobs:
                echoed = choice.prompt_ids if self.request.echo else ()
                logprobs = completion_logprobs(self.name, choice.tokens, 0, echoed)
            choices.append(self._choice(choice, self._echo(choice) + choice.output.text, logprobs, True))
        return {**self.header, "choices": choices, "usage": self.generation.usage()}

    def chunks(self) -> Iterator[dict]:
        """The stream: echoed prompts, then one chunk per text delta (per token with logprobs), then usage."""
        want_logprobs = self.request.params.logprobs is not None
        offsets = [0] * len(self.generation.choices)  # characters sent per choice (for text_offset)
        if self.request.echo:
            for choice in self.generation.choices:
                text = self._echo(choice)
                logprobs = completion_logprobs(self.name, [], 0, choice.prompt_ids) if want_logprobs else None
                offsets[choice.index] = len(text)
                yield {**self.header, "choices": [self._choice(choice, text, logprobs, False)]}
        for choice, event, delta in self.generation.events():
            if choice.output.finish_reason == "error":
                yield APIError(500, ENGINE_FAILED).body()
                return
            with_logprobs = want_logprobs and event.token_id is not None
            if not (delta or choice.finished or with_logprobs):
                continue
            logprobs = completion_logprobs(self.name, [event], offsets[choice.index]) if with_logprobs else None
            offsets[choice.index] += len(delta)
            yield {**self.header, "choices": [self._choice(choice, delta, logprobs, choice.finished)]}
        if self.request.include_usage:
            yield {**self.header, "choices": [], "usage": self.generation.usage()}
