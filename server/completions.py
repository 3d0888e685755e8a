"""/v1/completions responses: one JSON body, or a stream of ``text_completion`` chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

from hybrid_jax.tokenizer import Tokenizer
from server.errors import APIError
from server.generation import Choice, Generation
from server.logprobs import completion_logprobs, token_namer, vllm_prompt_logprobs
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

    def _prompt_logprobs(self, choice: Choice):
        """The logprobs of the choice's prompt (its first sample's request scored it); waits for them."""
        return self.generation.choices[choice.index - choice.index % self.request.n].handle.prompt_logprobs()

    def _logprobs(self, choice: Choice, events, offset: int, echoed: bool) -> dict | None:
        """The choice's logprobs for ``events`` (after its echoed prompt's, if ``echoed``); None unless asked."""
        top = self.request.params.logprobs
        if top is None:
            return None
        if not echoed:
            return completion_logprobs(self.name, events, offset)
        return completion_logprobs(self.name, events, offset, choice.prompt_ids, self._prompt_logprobs(choice), top)

    def _choice(self, choice: Choice, text: str, logprobs: dict | None, final: bool) -> dict:
        output = choice.output
        return {"index": choice.index, "text": text, "logprobs": logprobs,
                "finish_reason": output.finish_reason if final else None,
                "stop_reason": output.stop_reason if final else None}

    def _chunk(self, choice: Choice, text: str, logprobs: dict | None, final: bool) -> dict:
        chunk = {**self.header, "choices": [self._choice(choice, text, logprobs, final)]}
        if self.request.continuous_usage:
            chunk["usage"] = self.generation.choice_usage(choice)
        return chunk

    def response(self) -> dict:
        """Wait for every choice; the whole response body."""
        for _ in self.generation.events():
            pass
        if self.generation.failed:
            raise APIError(500, ENGINE_FAILED)
        choices = []
        for choice in self.generation.choices:
            logprobs = self._logprobs(choice, choice.tokens, 0, self.request.echo)
            entry = self._choice(choice, self._echo(choice) + choice.output.text, logprobs, True)
            if self.request.prompt_logprobs is not None:
                entry["prompt_logprobs"] = vllm_prompt_logprobs(self.name, choice.prompt_ids,
                                                                self._prompt_logprobs(choice))
            choices.append(entry)
        return {**self.header, "choices": choices, "usage": self.generation.usage()}

    def chunks(self) -> Iterator[dict]:
        """The stream: echoed prompts (with their logprobs), then one chunk per text delta (per token with
        logprobs), then usage."""
        want_logprobs = self.request.params.logprobs is not None
        offsets = [0] * len(self.generation.choices)  # characters sent per choice (for text_offset)
        if self.request.echo:
            for choice in self.generation.choices:
                text = self._echo(choice)
                offsets[choice.index] = len(text)
                yield self._chunk(choice, text, self._logprobs(choice, [], 0, True), False)
        for choice, event, delta in self.generation.events():
            if choice.output.finish_reason == "error":
                yield APIError(500, ENGINE_FAILED).body()
                return
            with_logprobs = want_logprobs and event.token_id is not None
            if not (delta or choice.finished or with_logprobs):
                continue
            logprobs = self._logprobs(choice, [event], offsets[choice.index], False) if with_logprobs else None
            offsets[choice.index] += len(delta)
            yield self._chunk(choice, delta, logprobs, choice.finished)
        if self.request.include_usage:
            yield {**self.header, "choices": [], "usage": self.generation.usage()}
