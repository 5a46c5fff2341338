"""lily.chat: reasoning / content / tool-call parsing, whole-text and streaming."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lily.chat import (
    ContentDelta,
    ParsedMessage,
    ReasoningDelta,
    StreamingParser,
    ToolCall,
    ToolCallEvent,
    convert_value,
    parse_assistant,
)
from lily.tokenizer import Tokenizer
from tokenizer_fixture import write_tiny_tokenizer

_SETTINGS = settings(max_examples=200, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "temp": {"type": "number"},
        "metric": {"type": "boolean"},
        "opts": {"type": "object"},
        "hours": {"type": "array"},
        "unit": {"enum": ["c", "f"]},
        "maybe": {"type": ["integer", "null"]},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    }}}},
    {"name": "ping", "parameters": {"type": "object", "properties": {}}},  # flat form
]


def call_xml(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def summary(message: ParsedMessage) -> tuple:
    """Everything but the random call ids."""
    return message.reasoning, message.content, [(c.name, c.arguments) for c in message.tool_calls]


def add_events(events: list, reasoning: str, content: str, calls: list) -> tuple[str, str, list]:
    """The reasoning, content and tool calls seen so far, extended by ``events``."""
    for event in events:
        if isinstance(event, ReasoningDelta):
            reasoning += event.text
        elif isinstance(event, ContentDelta):
            content += event.text
        else:
            calls.append(event.call)
    return reasoning, content, calls


def stream(text: str, cuts: list[int], **kwargs) -> tuple[ParsedMessage, list]:
    parser = StreamingParser(**kwargs)
    events = []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        events += parser.feed(text[a:b])
    events += parser.finish()
    return parser.message, events


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_tiny_tokenizer(tmp_path_factory.mktemp("tiny") / "tok"))


# -- whole-text parsing -----------------------------------------------------------------------


def test_reasoning_then_content() -> None:
    parsed = parse_assistant("Let me add.\n2+2=4\n</think>\n\nThe answer is 4.")
    assert summary(parsed) == ("Let me add.\n2+2=4", "The answer is 4.", [])


def test_thinking_off_is_all_content() -> None:
    assert summary(parse_assistant("Just 4.", thinking=False)) == (None, "Just 4.", [])
    assert summary(parse_assistant("a </think> b", thinking=False)) == (None, "a </think> b", [])


def test_truncated_reasoning_is_all_reasoning() -> None:
    assert summary(parse_assistant("still thinking <tool_call> about")) == ("still thinking <tool_call> about", "", [])


def test_a_generated_think_tag_is_dropped() -> None:
    assert summary(parse_assistant("  <think>\nhm\n</think>\nok")) == ("hm", "ok", [])


def test_tool_call_ends_reasoning_and_content_before_it() -> None:
    text = "I need the weather.\n\n" + call_xml("get_weather", city="Paris", days="3")
    parsed = parse_assistant(text, tools=TOOLS)
    assert summary(parsed) == ("I need the weather.", "", [("get_weather", {"city": "Paris", "days": 3})])
    text = "r\n</think>\n\nChecking.\n\n" + call_xml("get_weather", city="Oslo") + "\n" + call_xml("ping")
    assert summary(parse_assistant(text, tools=TOOLS)) == (
        "r", "Checking.", [("get_weather", {"city": "Oslo"}), ("ping", {})]
    )


def test_values_converted_by_schema() -> None:
    text = call_xml(
        "get_weather", city="  New York 42 ", days="7", temp="-3.5", metric="True", opts='{"a": [1, null]}',
        hours="[1, 2]", unit="c", maybe="null", either="x1",
    )
    (call,) = parse_assistant(text, tools=TOOLS, thinking=False).tool_calls
    assert call.arguments == {
        "city": "  New York 42 ", "days": 7, "temp": -3.5, "metric": True, "opts": {"a": [1, None]},
        "hours": [1, 2], "unit": "c", "maybe": None, "either": "x1",
    }


@pytest.mark.parametrize(
    ("raw", "schema", "expected"),
    [
        ("12", {"type": "integer"}, 12),
        ("12.0", {"type": "integer"}, 12),
        ("-0", {"type": "integer"}, 0),
        ("12", {"type": "number"}, 12),
        ("1e3", {"type": "number"}, 1000.0),
        (".5", {"type": "number"}, 0.5),
        ("false", {"type": "boolean"}, False),
        ("{'a': 1}", {"type": "object"}, {"a": 1}),  # a Python literal, as models sometimes write
        ("[]", {"type": "array"}, []),
        ("null", {"type": "object"}, None),
        ("null", {"type": "string"}, "null"),
        ("007", {"type": "string"}, "007"),
        ("7", {"type": ["string", "integer"]}, 7),
        ("x", {"type": ["string", "integer"]}, "x"),
        ("7", {"oneOf": [{"type": "number"}, {"type": "null"}]}, 7),
        ("7", None, 7),  # unknown parameter: JSON if it parses
        ('{"k": "v"}', {}, {"k": "v"}),
        ("hello world", None, "hello world"),
        ("NaN", None, "NaN"),
        ("1e999", None, "1e999"),
    ],
)
def test_convert_value(raw: str, schema, expected) -> None:
    value = convert_value(raw, schema)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("raw", "schema"),
    [("1.5", {"type": "integer"}), ("abc", {"type": "number"}), ("inf", {"type": "number"}),
     ("yes", {"type": "boolean"}), ("{bad", {"type": "object"}), ("[1]", {"type": "object"}),
     ("{}", {"type": "array"}), ("1" * 5000, {"type": "integer"}), ("x", {"type": "null"})],
)
def test_convert_value_rejects_mismatches(raw: str, schema) -> None:
    with pytest.raises(ValueError):
        convert_value(raw, schema)


@pytest.mark.parametrize(
    "block",
    [
        call_xml("get_weather", city="Paris")[: -len("</tool_call>")],  # unclosed
        call_xml("nope", city="Paris"),  # unknown function
        call_xml("get_weather", opts="{not json"),  # bad object
        call_xml("get_weather", days="three"),  # bad integer
        "<tool_call>\n<function=get_weather>\ngarbage\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\na\n</parameter>\n</tool_call>",  # no </function>
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        call_xml("get_weather", city="a").replace(
            "</parameter>\n", "</parameter>\n<parameter=city>\nb\n</parameter>\n"),  # duplicate parameter
    ],
)
def test_malformed_calls_stay_in_the_content(block: str) -> None:
    text = f"Before.\n\n{block}\nAfter."
    parsed = parse_assistant(text, tools=TOOLS, thinking=False)
    assert summary(parsed) == (None, text, [])
    assert summary(stream(text, list(range(0, len(text), 3)), tools=TOOLS, thinking=False)[0]) == summary(parsed)


def test_a_missing_parameter_closer_is_tolerated() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>\n</tool_call>"
    assert parse_assistant(text, tools=TOOLS, thinking=False).tool_calls[0].arguments == {"city": "Rome", "days": 2}


def test_without_tools_any_function_is_accepted() -> None:
    (call,) = parse_assistant(call_xml("anything", a="1", b="text", c='{"x": 1}'), thinking=False).tool_calls
    assert (call.name, call.arguments) == ("anything", {"a": 1, "b": "text", "c": {"x": 1}})


def test_call_ids_and_openai_form() -> None:
    calls = parse_assistant(call_xml("ping") * 3, tools=TOOLS, thinking=False).tool_calls
    assert len({c.id for c in calls}) == 3
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    call = ToolCall(name="f", arguments={"a": "é", "b": [1]}, id="call_x")
    assert call.to_openai() == {"id": "call_x", "type": "function",
                                "function": {"name": "f", "arguments": '{"a": "é", "b": [1]}'}}


def test_bad_tools_argument_is_named() -> None:
    with pytest.raises(ValueError, match=r"tools\[1\]"):
        parse_assistant("x", tools=[TOOLS[0], {"function": {}}])


# -- streaming --------------------------------------------------------------------------------


def test_stream_events_in_order() -> None:
    text = "Think.\n</think>\n\nHello " + call_xml("ping") + "\nbye"
    message, events = stream(text, list(range(len(text))), tools=TOOLS)
    assert [type(e) for e in events if not isinstance(e, (ReasoningDelta, ContentDelta))] == [ToolCallEvent]
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "Think."
    # whitespace between content pieces is kept, around the whole content it is dropped
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Hello \nbye"
    assert summary(message) == ("Think.", "Hello \nbye", [("ping", {})])


@pytest.mark.parametrize("partial", ["<tool_", "<tool_call>", "<tool_call>\n<func", "</thi", "<", "<tool_call>  \n "])
def test_partial_markup_is_held_back(partial: str) -> None:
    parser = StreamingParser(tools=TOOLS)
    shown = parser.feed("Reasoning " + partial)
    assert "".join(e.text for e in shown) == "Reasoning"
    assert "".join(e.text for e in shown + parser.feed("zz") + parser.finish()) == "Reasoning " + partial + "zz"
    # after the reasoning only tool-call markup is special
    parser = StreamingParser(tools=TOOLS, thinking=False)
    shown = parser.feed("Text " + partial)
    assert "".join(e.text for e in shown) == ("Text " + partial if partial == "</thi" else "Text")
    # once the text turns out not to be markup it is shown
    assert "".join(e.text for e in shown + parser.feed("zz") + parser.finish()) == "Text " + partial + "zz"


def test_feed_after_finish_is_an_error() -> None:
    parser = StreamingParser()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


# -- properties on arbitrary text ----------------------------------------------------------------

_FRAGMENTS = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<function=get_weather>", "<function=ping>",
    "<function=f>", "</function>", "<parameter=city>", "<parameter=days>", "<parameter=opts>", "<parameter=x>",
    "</parameter>", "<tool_", "</thi", "<", ">", "=", "\n", " ", "  \n", "x", "7", "1.5", "{", "}", '{"a": 1}',
    "[1]", "null", "true", "é", "😀", '"',
]
_values = st.one_of(st.sampled_from(["7", "-2", "1.5", "true", "null", '{"a": 1}', "[1, 2]", "{bad", "", "\n"]),
                   st.text(max_size=6))
_calls = st.builds(
    lambda name, params: call_xml(name, **params),
    st.sampled_from(["get_weather", "ping", "f"]),
    st.dictionaries(st.sampled_from(["city", "days", "temp", "opts", "hours", "x"]), _values, max_size=3),
)


@st.composite
def _damaged(draw, text: st.SearchStrategy[str]) -> str:
    """Some text with a random span cut out, to make near-valid markup malformed."""
    s = draw(text)
    if s and draw(st.booleans()):
        a = draw(st.integers(0, len(s) - 1))
        b = draw(st.integers(a, min(len(s), a + 12)))
        s = s[:a] + s[b:]
    return s


_pieces = st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=4), _calls)
arbitrary_text = st.one_of(
    st.lists(st.sampled_from(_FRAGMENTS), max_size=30).map("".join),
    st.text(max_size=40),
    _damaged(st.lists(_pieces, max_size=12).map("".join)),
)
parse_options = st.fixed_dictionaries({"tools": st.sampled_from([None, TOOLS]), "thinking": st.booleans()})


@_SETTINGS
@given(arbitrary_text, parse_options, st.lists(st.integers(0, 200), max_size=10))
def test_streaming_in_random_pieces_equals_whole_text(text: str, options: dict, cuts: list[int]) -> None:
    whole = parse_assistant(text, **options)
    parser = StreamingParser(**options)
    reasoning, content, calls = "", "", []
    bounds = [0, *sorted({c for c in cuts if c < len(text)}), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        reasoning, content, calls = add_events(parser.feed(text[a:b]), reasoning, content, calls)
        # what has been shown is never taken back: no partial markup leaks out
        assert (whole.reasoning or "").startswith(reasoning)
        assert whole.content.startswith(content)
    reasoning, content, calls = add_events(parser.finish(), reasoning, content, calls)
    assert (reasoning or None, content, [(c.name, c.arguments) for c in calls]) == summary(whole)
    assert summary(parser.message) == summary(whole)


@_SETTINGS
@given(arbitrary_text, parse_options)
def test_rendering_the_parse_back_through_the_chat_template_loses_nothing(tok: Tokenizer, text: str, options) -> None:
    parsed = parse_assistant(text, **options)
    # Two shapes cannot come back unchanged: reasoning that itself starts with <think> (the parser
    # drops one such tag), and content holding an unfinished call, which the template's calls,
    # placed after the content, would complete.
    assume(not (parsed.reasoning or "").startswith("<think>"))
    assume(not re.search(r"<tool_call>\s*<function=", parsed.content))
    message = {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning or "",
               "tool_calls": [c.to_openai() for c in parsed.tool_calls]}
    prompt = tok.apply_chat_template([{"role": "user", "content": "q"}, message], add_generation_prompt=False)
    head = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert prompt.startswith(head) and prompt.endswith("<|im_end|>\n")
    again = parse_assistant(prompt[len(head) : -len("<|im_end|>\n")], tools=options["tools"])
    assert summary(again) == summary(parsed)


_plain = st.text(alphabet=st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), max_size=30)
_weather_args = st.fixed_dictionaries({}, optional={
    "city": _plain, "days": st.integers(-10**6, 10**6), "temp": st.floats(-1e6, 1e6, allow_nan=False),
    "metric": st.booleans(), "opts": st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
    "hours": st.lists(st.integers(0, 23), max_size=4), "unit": st.sampled_from(["c", "f"]),
    "maybe": st.one_of(st.none(), st.integers()),
})


@_SETTINGS
@given(_plain, _plain, st.lists(st.one_of(st.tuples(st.just("get_weather"), _weather_args),
                                         st.tuples(st.just("ping"), st.just({}))), max_size=3))
def test_template_rendered_turns_parse_back_exactly(tok: Tokenizer, reasoning: str, content: str, calls) -> None:
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning,
               "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    prompt = tok.apply_chat_template([{"role": "user", "content": "q"}, message], add_generation_prompt=False)
    generated = prompt.split("<|im_start|>assistant\n<think>\n", 1)[1].removesuffix("<|im_end|>\n")
    expected = (reasoning.strip() or None, content.strip(), [(n, a) for n, a in calls])
    assert summary(parse_assistant(generated, tools=TOOLS)) == expected
    cuts = list(range(0, len(generated), 5))
    assert summary(stream(generated, cuts, tools=TOOLS)[0]) == expected


@pytest.mark.parametrize(
    ("tools", "match"),
    [
        ({"name": "f"}, r"tools: expected a list"),
        ([5], r"tools\[0\]: expected an object, got int"),
        ([{"function": {"name": 3}}], r"tools\[0\]: expected a function with a string 'name'"),
    ],
)
def test_bad_tools_are_refused_alike_by_the_parser_and_the_template(tok: Tokenizer, tools, match: str) -> None:
    messages = [{"role": "user", "content": "a"}]
    for build in (lambda: StreamingParser(tools=tools), lambda: parse_assistant("x", tools=tools),
                  lambda: tok.apply_chat_template(messages, tools=tools)):
        with pytest.raises(ValueError, match=match):
            build()
