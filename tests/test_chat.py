"""Chat template rendering: the built-in Qwen3.5 template and checkpoint templates."""

import json

import pytest

from hybrid_jax.chat import ChatTemplate, ChatTemplateError

NO_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
THINK = "<|im_start|>assistant\n<think>\n"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS_HEADER = (
    "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\n"
    "If you decide to call a function, reply ONLY in the format below, with nothing after it:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nA value for the second parameter\nmay span\nseveral lines\n</parameter>\n"
    "</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nRemember:\n"
    "- The <function=...></function> block must always be nested inside <tool_call></tool_call> tags\n"
    "- Every required parameter must be given\n"
    "- Any reasoning about the call goes in plain language BEFORE the call, never after it\n"
    "- If no function call is needed, answer normally from your own knowledge and do not mention functions\n"
    "</IMPORTANT>"
)


@pytest.fixture(scope="module")
def builtin():
    return ChatTemplate.builtin()


def test_plain_chat(builtin):
    prompt = builtin.render([{"role": "user", "content": "Hello!"}])
    assert prompt == "<|im_start|>user\nHello!<|im_end|>\n" + NO_THINK


def test_thinking_switch(builtin):
    messages = [{"role": "user", "content": "Hi"}]
    assert builtin.render(messages, enable_thinking=True) == "<|im_start|>user\nHi<|im_end|>\n" + THINK
    assert builtin.render(messages, enable_thinking=False) == "<|im_start|>user\nHi<|im_end|>\n" + NO_THINK
    assert builtin.render(messages, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_system_and_user(builtin):
    messages = [{"role": "system", "content": "  You are terse.\n"}, {"role": "user", "content": " Hi \n"}]
    assert builtin.render(messages) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n Hi \n<|im_end|>\n" + NO_THINK
    )


def test_tools_with_system_message(builtin):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    assert builtin.render(messages, tools=[WEATHER_TOOL]) == (
        TOOLS_HEADER + "\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n" + NO_THINK
    )


def test_tools_without_system_message(builtin):
    prompt = builtin.render([{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL], enable_thinking=True)
    assert prompt == TOOLS_HEADER + "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" + THINK


AGENT_LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Sunny.", "reasoning_content": "Old thoughts."},
    {"role": "user", "content": "And Rome and Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "\nTwo lookups.\n",
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            {
                "id": "b",
                "type": "function",
                "function": {
                    "name": "lookup",
                    "arguments": '{"city": "Oslo", "days": 3, "ok": true, "opts": {"unit": "C"}, "tags": ["a", "b"]}',
                },
            },
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": "Rome: 25C"},
    {"role": "tool", "tool_call_id": "b", "content": "Oslo: 5C"},
    {"role": "user", "content": "<tool_response>\nRome is humid\n</tool_response>"},
    {"role": "assistant", "content": "<think>\nCompare.\n</think>\n\nRome is warmer."},
]
CALLS = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=lookup>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    '<parameter=ok>\nTrue\n</parameter>\n<parameter=opts>\n{"unit": "C"}\n</parameter>\n'
    '<parameter=tags>\n["a", "b"]\n</parameter>\n</function>\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\nRome: 25C\n</tool_response>\n"
    "<tool_response>\nOslo: 5C\n</tool_response><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\nRome is humid\n</tool_response><|im_end|>\n"
)


def test_agent_loop_keeps_reasoning_after_last_query(builtin):
    assert builtin.render(AGENT_LOOP, enable_thinking=True) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\nSunny.<|im_end|>\n"
        "<|im_start|>user\nAnd Rome and Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo lookups.\n</think>\n\n" + CALLS + "<|im_start|>assistant\n"
        "<think>\nCompare.\n</think>\n\nRome is warmer.<|im_end|>\n" + THINK
    )


def test_new_query_strips_earlier_reasoning(builtin):
    messages = AGENT_LOOP + [
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}, {"type": "text", "text": "! Oslo again?"}]},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "Oslo: 6C"},
    ]
    assert builtin.render(messages) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\nSunny.<|im_end|>\n"
        "<|im_start|>user\nAnd Rome and Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n" + CALLS + "<|im_start|>assistant\nRome is warmer.<|im_end|>\n"
        "<|im_start|>user\nThanks! Oslo again?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nChecking.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nOslo: 6C\n</tool_response><|im_end|>\n" + NO_THINK
    )


def test_render_does_not_modify_messages(builtin):
    messages = json.loads(json.dumps(AGENT_LOOP))
    builtin.render(messages)
    assert messages == AGENT_LOOP


def test_system_not_first_is_an_error(builtin):
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late."}]
    with pytest.raises(ChatTemplateError, match="System message must be at the beginning"):
        builtin.render(messages)


def test_unknown_role_is_an_error(builtin):
    with pytest.raises(ChatTemplateError, match="Unexpected message role: narrator"):
        builtin.render([{"role": "narrator", "content": "Once"}])


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image", "image": "x.png"},
    ],
)
def test_image_part_is_an_error(builtin, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    with pytest.raises(ChatTemplateError, match="images are not supported by this text-only server"):
        builtin.render(messages)


@pytest.mark.parametrize("content", [[{"type": "input_audio"}], 42])
def test_other_content_is_an_error(builtin, content):
    with pytest.raises(ChatTemplateError):
        builtin.render([{"role": "user", "content": content}])


@pytest.mark.parametrize("arguments", ["{not json", "[1, 2]"])
def test_bad_tool_call_arguments_are_an_error(builtin, arguments):
    call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(ChatTemplateError, match="tool call arguments"):
        builtin.render(messages)


# A small custom template: exercises the HF globals and filters a checkpoint template may use.
CUSTOM = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'system' %}{{ raise_exception('no system here') }}{% endif %}"
    "[{{ m.role }}] {{ m.content }}\n"
    "{% endfor %}"
    "{% if tools %}{{ tools | tojson(indent=1) }}\n{% endif %}"
    "{% if add_generation_prompt %}[assistant]"
    "{% if enable_thinking is defined and not enable_thinking %} <think></think>{% else %} <think>\n{% endif %}"
    "{% endif %}"
)


def write_json(path, data):
    path.write_text(json.dumps(data), encoding="utf-8")


def test_checkpoint_template_from_tokenizer_config(tmp_path):
    write_json(tmp_path / "tokenizer_config.json", {"chat_template": CUSTOM, "bos_token": "<s>"})
    template = ChatTemplate.from_checkpoint(tmp_path)
    assert template.render([{"role": "user", "content": "Héllo"}], tools=[{"name": "é"}]) == (
        '<s>[user] Héllo\n[\n {\n  "name": "é"\n }\n]\n[assistant] <think>\n'
    )
    assert template.render([{"role": "user", "content": "x"}], enable_thinking=False) == (
        "<s>[user] x\n[assistant] <think></think>"
    )
    with pytest.raises(ChatTemplateError, match="no system here"):
        template.render([{"role": "system", "content": "x"}])


def test_checkpoint_named_templates_take_default(tmp_path):
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": CUSTOM}]
    write_json(tmp_path / "tokenizer_config.json", {"chat_template": named, "bos_token": {"content": "<b>"}})
    template = ChatTemplate.from_checkpoint(tmp_path)
    assert template.render([{"role": "user", "content": "x"}]) == "<b>[user] x\n[assistant] <think>\n"


def test_checkpoint_jinja_file_wins(tmp_path):
    write_json(tmp_path / "tokenizer_config.json", {"chat_template": "from config"})
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}!")
    template = ChatTemplate.from_checkpoint(tmp_path)
    assert template.render([{"role": "user", "content": "from file"}]) == "from file!"


def test_checkpoint_without_template_uses_builtin(tmp_path):
    write_json(tmp_path / "tokenizer_config.json", {"eos_token": "<|im_end|>"})
    assert ChatTemplate.from_checkpoint(tmp_path).source == ChatTemplate.builtin().source
    assert ChatTemplate.from_checkpoint(tmp_path / "missing").source == ChatTemplate.builtin().source


def test_default_enable_thinking():
    assert ChatTemplate.builtin().default_enable_thinking is False
    assert ChatTemplate(CUSTOM).default_enable_thinking is True
    # Qwen3.5-27B style: the empty think block only when enable_thinking is explicitly false
    large = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}"
        "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    )
    assert ChatTemplate(large).default_enable_thinking is True
    assert ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}").default_enable_thinking is False


def test_template_errors_become_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        ChatTemplate("{% if %}")
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute access to internals
        ChatTemplate("{{ messages.__class__.__subclasses__() }}").render([])
    with pytest.raises(ChatTemplateError):  # and mutation of the messages
        ChatTemplate("{{ messages.append(1) }}").render([])
    assert ChatTemplate("{{ strftime_now('%Y') | length }}").render([]) == "4"
