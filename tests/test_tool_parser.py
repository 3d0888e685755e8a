"""Tool-call (qwen3_coder XML) and reasoning (</think>) parsers, complete and streaming."""

import json
import random
import re

import pytest

from server.reasoning_parser import ReasoningStreamer, split_reasoning
from server.tool_parser import ToolCallStreamer, parse_tool_calls


def tool(name, **properties):
    parameters = {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [
    tool("get_weather", city={"type": "string"}, days={"type": "integer"}),
    tool(
        "configure",
        count={"type": "integer"},
        ratio={"type": "number"},
        enabled={"type": "boolean"},
        options={"type": "object"},
        tags={"type": "array"},
        label={"type": ["string", "null"]},
        limit={"anyOf": [{"type": "integer"}, {"type": "null"}]},
    ),
    tool("write_file", path={"type": "string"}, code={"type": "string"}),
]

WEATHER = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
CODE = 'if a < b and x</y:\n    print("</div>")\n    return x<<2 if y>=z else "<p>"'


def call(text, tools=TOOLS):
    """parse_tool_calls as (content, [(name, arguments dict)])."""
    content, calls = parse_tool_calls(text, tools)
    for c in calls:
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", c["id"]) and c["type"] == "function"
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_no_tool_call():
    assert parse_tool_calls("Just an answer.", TOOLS) == ("Just an answer.", [])


def test_one_call():
    assert call(WEATHER) == (None, [("get_weather", {"city": "Paris"})])


def test_text_before_call():
    assert call("Let me check.\n\n" + WEATHER) == ("Let me check.\n\n", [("get_weather", {"city": "Paris"})])
    assert call("\n\n" + WEATHER)[0] is None


def test_several_calls():
    rome = WEATHER.replace("Paris", "Rome")
    content, calls = call(WEATHER + "\n" + rome + "\n" + rome.replace("get_weather", "get_time"))
    assert content is None
    assert calls == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
        ("get_time", {"city": "Rome"}),
    ]


def test_multiline_code_parameter():
    text = (
        "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n"
        f"<parameter=code>\n{CODE}\n\n</parameter>\n</function>\n</tool_call>"
    )
    assert call(text)[1] == [("write_file", {"path": "/tmp/a.py", "code": CODE + "\n"})]


def test_typed_parameters():
    params = {
        "count": "\n 7 \n",
        "ratio": "0.25",
        "enabled": "True",
        "options": '{"mode": "fast", "n": [1, 2]}',
        "tags": '["a", "b"]',
        "label": "42",
        "limit": "null",
    }
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    _, calls = call(f"<tool_call>\n<function=configure>\n{body}</function>\n</tool_call>")
    expected = {
        "count": 7,
        "ratio": 0.25,
        "enabled": True,
        "options": {"mode": "fast", "n": [1, 2]},
        "tags": ["a", "b"],
        "label": "42",
        "limit": None,
    }
    assert calls == [("configure", expected)]
    assert [type(v) for v in calls[0][1].values()] == [type(v) for v in expected.values()]


@pytest.mark.parametrize(
    ("name", "raw", "value"),
    [
        ("count", "3.0", 3),
        ("count", "many", "many"),
        ("ratio", "2", 2),
        ("ratio", "1e999", "1e999"),
        ("enabled", "false", False),
        ("enabled", "FALSE", False),
        ("enabled", "maybe", "maybe"),
        ("options", "{'python': True}", "{'python': True}"),
        ("tags", "[1, 2", "[1, 2"),
        ("unknown", "[1, 2]", [1, 2]),
        ("unknown", "NaN", "NaN"),
        ("unknown", "plain words", "plain words"),
    ],
)
def test_value_conversion(name, raw, value):
    text = f"<tool_call>\n<function=configure>\n<parameter={name}>\n{raw}\n</parameter>\n</function>\n</tool_call>"
    assert call(text)[1] == [("configure", {name: value})]


def test_unknown_tool_is_kept():
    text = "<tool_call>\n<function=launch>\n<parameter=target>\nmoon\n</parameter>\n<parameter=n>\n3\n</parameter>"
    assert call(text + "\n</function>\n</tool_call>") == (None, [("launch", {"target": "moon", "n": 3})])
    assert call(text + "\n</function>\n</tool_call>", tools=None)[1] == [("launch", {"target": "moon", "n": 3})]


MALFORMED = {
    # missing </parameter> before the next <parameter= and before </function>
    "open parameters": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</function>\n</tool_call>",
        (None, [("get_weather", {"city": "Paris", "days": 2})]),
    ),
    "no closing tags": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" + WEATHER,
        (None, [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Paris"})]),
    ),
    "missing </tool_call> at the end": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
        (None, [("get_weather", {"city": "Paris"})]),
    ),
    "cut inside a value": (
        "Hi <tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n<parameter=city>\nPar",
        ("Hi ", [("get_weather", {"days": 3})]),
    ),
    "cut inside the function tag": ("Hi <tool_call>\n<function=get_wea", ("Hi <tool_call>\n<function=get_wea", [])),
    "garbage block": ("<tool_call>\nnot xml at all\n</tool_call>", ("<tool_call>\nnot xml at all\n</tool_call>", [])),
    "garbage then a call": ("A <tool_call>junk</tool_call>\n" + WEATHER, ("A ", [("get_weather", {"city": "Paris"})])),
    "extra whitespace": (
        "<tool_call>  <function= get_weather >\n\n<parameter= city >Paris</parameter>  </function>  </tool_call>\n",
        (None, [("get_weather", {"city": "Paris"})]),
    ),
    "duplicate parameter keeps the first": (
        "<tool_call><function=get_weather><parameter=city>A</parameter><parameter=city>B</parameter></function>",
        (None, [("get_weather", {"city": "A"})]),
    ),
    "text after the last call is dropped": (WEATHER + "\nDone.", (None, [("get_weather", {"city": "Paris"})])),
    "no parameters": ("<tool_call>\n<function=get_weather>\n</function>\n</tool_call>", (None, [("get_weather", {})])),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed(name):
    text, expected = MALFORMED[name]
    assert call(text) == expected


STREAM_CASES = [
    "Plain answer with a < sign and <tool but no call.",
    "",
    "  \n",
    "Let me check.\n\n" + WEATHER,
    WEATHER + "\n" + WEATHER.replace("Paris", "Köln"),
    "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n"
    f"<parameter=code>\n{CODE}\n</parameter>\n</function>\n</tool_call>",
    '<tool_call>\n<function=configure>\n<parameter=count>\n7\n</parameter>\n<parameter=options>\n{"a": 1}\n'
    "</parameter>\n<parameter=enabled>\ntrue\n</parameter>\n</function>\n</tool_call>",
] + [text for text, _ in MALFORMED.values()]


def stream(text, sizes):
    """Feed text in chunks of the given sizes; return (content, [(name, arguments JSON)])."""
    streamer = ToolCallStreamer(TOOLS)
    deltas, pos = [], 0
    for size in sizes:
        deltas += streamer.feed(text[pos : pos + size])
        pos += size
    deltas += streamer.finish()
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["type"] == "function"
                assert tc["function"]["arguments"] == ""
                calls.append([tc["function"]["name"], ""])
            else:
                assert tc["index"] == len(calls) - 1
                calls[-1][1] += tc["function"]["arguments"]
    return content or None, [(name, args) for name, args in calls]


def expected_stream(text):
    content, calls = parse_tool_calls(text, TOOLS)
    return content or None, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def chunkings(text):
    rng = random.Random(len(text))
    yield [1] * len(text)
    for _ in range(20):
        sizes = []
        while sum(sizes) < len(text):
            sizes.append(rng.randint(1, 9))
        yield sizes


@pytest.mark.parametrize("text", STREAM_CASES)
def test_streaming_matches_complete_parse(text):
    expected = expected_stream(text)
    for sizes in chunkings(text):
        assert stream(text, sizes) == expected


def test_streaming_sends_content_early_and_holds_partial_tags():
    streamer = ToolCallStreamer(TOOLS)
    assert streamer.feed("\n") == []  # leading blank text waits: it is dropped if a call follows
    assert streamer.feed("Sure <tool") == [{"content": "\nSure "}]
    [start] = streamer.feed("_call>\n<function=get_weather>\n<parameter=city>\nParis\n")
    header = start["tool_calls"][0]
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", header.pop("id"))
    assert header == {"index": 0, "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    assert streamer.feed("</parameter>") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"'}}]}
    ]
    assert streamer.finish() == [{"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}]


# ---- reasoning parser ----

REASONING_CASES = [
    # (text, thinking, expected)
    (
        "User wants 2+2.\nIt is 4.\n</think>\n\nThe answer is 4.",
        True,
        ("User wants 2+2.\nIt is 4.", "The answer is 4."),
    ),
    ("Still thinking about x < y", True, ("Still thinking about x < y", None)),
    ("<think>\nModel opened its own block.\n</think>\n\nDone.", True, ("Model opened its own block.", "Done.")),
    ("\n\n</think>\n\nQuick answer.", True, (None, "Quick answer.")),
    ("Only thoughts.\n</think>\n\n", True, ("Only thoughts.", None)),
    ("Thoughts ending </thin", True, ("Thoughts ending </thin", None)),
    ("", True, (None, None)),
    ("The answer is 4.", False, (None, "The answer is 4.")),
    ("<think>\n\n</think>\n\nThe answer is 4.", False, (None, "The answer is 4.")),
    ("<think>\nnot empty\n</think>\n\nAnswer.", False, (None, "<think>\nnot empty\n</think>\n\nAnswer.")),
    ("  <thin", False, (None, "  <thin")),
    ("", False, (None, None)),
]


@pytest.mark.parametrize(("text", "thinking", "expected"), REASONING_CASES)
def test_split_reasoning(text, thinking, expected):
    assert split_reasoning(text, thinking) == expected


def stream_reasoning(chunks, thinking):
    streamer = ReasoningStreamer(thinking)
    pieces = [streamer.feed(chunk) for chunk in chunks] + [streamer.finish()]
    reasoning = "".join(r for r, _ in pieces)
    content = "".join(c for _, c in pieces)
    return reasoning or None, content or None


@pytest.mark.parametrize(("text", "thinking", "expected"), REASONING_CASES)
def test_reasoning_streaming_at_every_split(text, thinking, expected):
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for chunks in splits:  # a leaked partial tag would show in the joined pieces
        assert stream_reasoning(chunks, thinking) == expected, chunks


def test_reasoning_streaming_holds_back_partial_tags():
    streamer = ReasoningStreamer(thinking=True)
    assert streamer.feed("Thinking \n</th") == ("Thinking", "")
    assert streamer.feed("ink>\n") == ("", "")
    assert streamer.feed("\nHi") == ("", "Hi")
    assert streamer.finish() == ("", "")
    streamer = ReasoningStreamer(thinking=False)
    assert streamer.feed("<think>\n\n</") == ("", "")
    assert streamer.feed("think>\n\nHello") == ("", "Hello")
