"""/v1/chat/completions on the real server: plain, thinking on/off, tools (accepted and rendered), streaming."""

from __future__ import annotations

GREEDY = {"temperature": 0.0}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def rendered(server, **body) -> str:
    """The prompt the server builds for a chat request, via /tokenize and /detokenize."""
    tokens = server.post("/tokenize", json={"messages": USER, **body}).json()["tokens"]
    return server.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_plain_chat(server, client):
    out = client.chat.completions.create(model=server.model, messages=USER, max_tokens=5, **GREEDY)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    [choice] = out.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert "reasoning_content" not in choice.message.model_extra  # the tiny model's template: thinking off
    assert out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens == server.post("/tokenize", json={"messages": USER}).json()["count"]


def test_max_completion_tokens_and_default_rest_of_context(server, client):
    out = client.chat.completions.create(model=server.model, messages=USER, max_completion_tokens=3, **GREEDY)
    assert out.usage.completion_tokens == 3
    long_user = [{"role": "user", "content": "word " * (server.max_model_len - 30)}]
    rest = client.chat.completions.create(model=server.model, messages=long_user, extra_body={"ignore_eos": True},
                                          **GREEDY)
    assert rest.usage.total_tokens == server.max_model_len and rest.choices[0].finish_reason == "length"
    assert rest.usage.completion_tokens < 30


def test_thinking_on_and_off(server, client):
    assert rendered(server, chat_template_kwargs={"enable_thinking": True}).endswith("<|im_start|>assistant\n<think>\n")
    assert rendered(server).endswith("<think>\n\n</think>\n\n")
    on = client.chat.completions.create(model=server.model, messages=USER, max_tokens=6,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": True}}, **GREEDY)
    message = on.choices[0].message
    # vLLM's current name and its older one
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"]
    # The random model never closes its think block: everything it wrote is reasoning.
    assert message.model_extra["reasoning"] or message.content
    off = client.chat.completions.create(model=server.model, messages=USER, max_tokens=6,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **GREEDY)
    assert "reasoning_content" not in off.choices[0].message.model_extra


def test_tools_are_rendered_unless_tool_choice_none(server, client):
    with_tools = rendered(server, tools=[WEATHER_TOOL])
    assert "# Tools" in with_tools and '"name": "get_weather"' in with_tools
    assert "# Tools" not in rendered(server, tools=[WEATHER_TOOL], tool_choice="none")
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}, "none"):
        out = client.chat.completions.create(model=server.model, messages=USER, tools=[WEATHER_TOOL],
                                             tool_choice=choice, max_tokens=4, **GREEDY)
        assert out.choices[0].message.tool_calls in (None, [])  # random weights write no tool call
        assert out.choices[0].finish_reason == "length"


def test_chat_logprobs(server, client):
    out = client.chat.completions.create(model=server.model, messages=USER, max_tokens=3, logprobs=True,
                                         top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob  # greedy: the top


def test_streaming_chat(server, client):
    kwargs = dict(model=server.model, messages=USER, max_tokens=5, **GREEDY)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == client.chat.completions.create(**kwargs).choices[0].message.content


def test_streaming_chat_reasoning_deltas(server, client):
    extra = {"chat_template_kwargs": {"enable_thinking": True}}
    kwargs = dict(model=server.model, messages=USER, max_tokens=6, extra_body=extra, **GREEDY)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta.model_extra for c in chunks]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    reasoning = "".join(d.get("reasoning") or "" for d in deltas)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    whole = client.chat.completions.create(**kwargs).choices[0].message
    assert reasoning == (whole.model_extra["reasoning"] or "")
    assert content == (whole.content or "")


def test_thinking_token_budget_closes_the_think_block(server, client):
    end = server.post("/tokenize", json={"prompt": "</think>"}).json()["tokens"]
    extra = {"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": 3, "ignore_eos": True,
             "return_tokens_as_token_ids": True}
    out = client.chat.completions.create(model=server.model, messages=USER, max_tokens=6, logprobs=True,
                                         extra_body=extra, **GREEDY)
    ids = [int(e.token.removeprefix("token_id:")) for e in out.choices[0].logprobs.content]
    assert len(end) == 1 and ids[3] == end[0] and end[0] not in ids[:3]
    assert out.choices[0].message.model_extra["reasoning"] is not None or out.choices[0].message.content


def test_developer_role_is_a_system_message(server, client):
    developer = [{"role": "developer", "content": "Be brief."}, *USER]
    prompt = server.post("/detokenize", json={"tokens": server.post(
        "/tokenize", json={"messages": developer}).json()["tokens"]}).json()["prompt"]
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    out = client.chat.completions.create(model=server.model, messages=developer, max_tokens=2, **GREEDY)
    assert out.usage.completion_tokens == 2


def test_streaming_logprobs_arrive_with_their_text(server, client):
    kwargs = dict(model=server.model, messages=USER, max_tokens=6, logprobs=True, top_logprobs=1, **GREEDY)
    chunks = list(client.chat.completions.create(stream=True, extra_body={"ignore_eos": True}, **kwargs,
                                                 stream_options={"include_usage": True,
                                                                 "continuous_usage_stats": True}))
    with_logprobs = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs]
    assert all(c.delta.content or c.finish_reason for c in with_logprobs)  # never an empty delta
    assert sum(len(c.logprobs.content) for c in with_logprobs) == 6
    assert all(c.usage is not None for c in chunks)
    assert [c.usage.completion_tokens for c in chunks if c.choices][0] == 0


def test_raw_stream_ends_with_done(server):
    body = {"model": server.model, "messages": USER, "max_tokens": 2, "stream": True, "n": 2, **GREEDY}
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    assert response.text.count('"role":"assistant"') == 2
