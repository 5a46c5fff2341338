"""The packaged Qwen3.6 chat template and Tokenizer.apply_chat_template.

Expected prompts are written out by hand from the Qwen3.6 template's rules; random conversations are compared with
transformers' own template renderer.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.utils.chat_template_utils import render_jinja_template

from lily.tokenizer import PACKAGED_TEMPLATE, ChatTemplateError, Tokenizer
from tokenizer_fixture import write_tiny_tokenizer

OFFICIAL_SHA256 = "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city, «today» <b>&</b>",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]},
    },
}
ZEBRA = {"type": "function", "function": {"name": "zebra", "parameters": {"z": 1, "a": 2}}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_tiny_tokenizer(tmp_path_factory.mktemp("tiny") / "tok"))


def test_packaged_template_is_the_official_file_with_a_header() -> None:
    text = PACKAGED_TEMPLATE.read_text("utf-8")
    header, body = text.split("-#}\n", 1)
    assert "Apache-2.0" in header and "Qwen/Qwen3.6-35B-A3B" in header
    assert hashlib.sha256(body.encode("utf-8")).hexdigest() == OFFICIAL_SHA256


def test_generation_prompt_thinking_on_and_off(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    turn = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    assert tok.apply_chat_template(messages) == turn + "<|im_start|>assistant\n<think>\n"
    assert tok.apply_chat_template(messages, enable_thinking=False) == (
        turn + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == turn


def test_system_turn_only_with_a_system_message_or_tools(tok: Tokenizer) -> None:
    user = {"role": "user", "content": "hi"}
    assert tok.apply_chat_template([user], add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    assert tok.apply_chat_template([{"role": "system", "content": "  Be brief. "}, user], add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )


def test_tools_block_then_system_text(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(messages, tools=[WEATHER, ZEBRA], add_generation_prompt=False)
    # one JSON schema per line, keys in the caller's order, non-ASCII and HTML characters unescaped
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in (WEATHER, ZEBRA))
    assert '"z": 1, "a": 2' in lines and "«today» <b>&</b>" in lines
    pattern = (
        re.escape("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n")
        + re.escape(lines)
        + re.escape("\n</tools>\n\n")
        + r"[^<]*<tool_call>\n<function=[^>]+>\n<parameter=[^>]+>\n.*</tool_call>\n\n<IMPORTANT>\n.*</IMPORTANT>"
        + re.escape("\n\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
    )
    assert re.fullmatch(pattern, prompt, re.DOTALL), prompt
    without_system = tok.apply_chat_template(messages[1:], tools=[WEATHER, ZEBRA], add_generation_prompt=False)
    assert without_system == prompt.replace("\n\nBe brief.<|im_end|>", "<|im_end|>")


def _history() -> list[dict]:
    return [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "", "reasoning_content": "r2",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "\nIt is sunny.", "reasoning": "r3"},
    ]


CALL_BLOCK = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


def test_reasoning_dropped_before_the_last_user_query(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template(_history(), add_generation_prompt=False)
    assert prompt == (
        "<|im_start|>user\nq1<|im_end|>\n"
        "<|im_start|>assistant\na1<|im_end|>\n"  # before the last real user query: no reasoning
        "<|im_start|>user\nq2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nr2\n</think>\n\n" + CALL_BLOCK + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nr3\n</think>\n\nIt is sunny.<|im_end|>\n"
    )
    preserved = tok.apply_chat_template(_history(), add_generation_prompt=False, preserve_thinking=True)
    assert preserved == prompt.replace("assistant\na1", "assistant\n<think>\nr1\n</think>\n\na1")


def test_tool_calls_and_grouped_tool_responses(tok: Tokenizer) -> None:
    args = {"s": "x y", "i": 3, "f": 0.5, "b": False, "n": None, "o": {"k": ["v", 1]}, "l": [1, "é"]}
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": args}},
            {"name": "g", "arguments": "{}"},  # the flat form, arguments as a JSON string
        ]},
        {"role": "tool", "content": "R1"},
        {"role": "tool", "content": [{"type": "text", "text": "R2"}]},
        {"role": "user", "content": "thanks"},
    ]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=False, preserve_thinking=True)
    expected_call = (
        "<tool_call>\n<function=f>\n"
        "<parameter=s>\nx y\n</parameter>\n<parameter=i>\n3\n</parameter>\n<parameter=f>\n0.5\n</parameter>\n"
        "<parameter=b>\nfalse\n</parameter>\n<parameter=n>\nnull\n</parameter>\n"
        '<parameter=o>\n{"k": ["v", 1]}\n</parameter>\n<parameter=l>\n[1, "é"]\n</parameter>\n'
        "</function>\n</tool_call>"
    )
    assert prompt == (
        "<|im_start|>user\ngo<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nCalling.\n\n" + expected_call
        + "\n<tool_call>\n<function=g>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nR1\n</tool_response>\n<tool_response>\nR2\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nthanks<|im_end|>\n"
    )


def test_content_parts_equal_plain_strings(tok: Tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "ab"}])


def test_caller_messages_are_not_modified(tok: Tokenizer) -> None:
    history = _history()
    before = copy.deepcopy(history)
    tok.apply_chat_template(history)
    assert history == before


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", r"messages: expected a list"),
        ([], r"messages: the list is empty"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\]: expected an object"),
        ([{"role": "robot", "content": "a"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content: expected a string or a list"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], r"messages\[0\]\.content\[0\]: .*image_url"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\]\.content\[0\]\.text"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}], r"messages\[1\]: a system message"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "reasoning_content": 3}], r"messages\[1\]\.reasoning_content"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": {"name": "f"}}], r"messages\[1\]\.tool_calls: expected a list"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}],
         r"messages\[1\]\.tool_calls\[0\]\.function\.name"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{bad"}}]}], r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "[1]"}}]}], r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: expected a JSON object"),
        ([{"role": "user", "content": "a", "tool_calls": [{"name": "f"}]}], r"messages\[0\]\.tool_calls: only assistant"),
    ],
)
def test_malformed_messages_are_named(tok: Tokenizer, messages, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_template_errors_become_chat_template_errors(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="No user query found"):
        tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        tok.apply_chat_template([{"role": "user", "content": "a"}], tools=["get_weather"])


def test_checkpoint_template_gets_hf_helpers(tmp_path: Path) -> None:
    d = write_tiny_tokenizer(tmp_path / "t")
    (d / "chat_template.jinja").write_text(
        "{% generation %}{{ bos_token }}{{ eos_token }}{% endgeneration %}|{{ strftime_now('%Y') | length }}|"
        "{{ {'b': 1, 'a': 'é'} | tojson }}|{% for k, v in messages[0] | items %}{{ k }}{% endfor %}|{{ custom }}"
        "{% if messages | length > 1 %}{{ raise_exception('only one') }}{% endif %}"
    )
    tok = Tokenizer.from_dir(d)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], custom=7) == (
        '<|im_end|>|4|{"b": 1, "a": "é"}|rolecontent|7'
    )
    with pytest.raises(ChatTemplateError, match="only one"):
        tok.apply_chat_template([{"role": "user", "content": "x"}] * 2)
    (d / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ChatTemplateError, match="chat template line 1"):
        Tokenizer.from_dir(d)


def test_thinking_is_the_templates_choice_unless_asked(tmp_path: Path, tok: Tokenizer) -> None:
    d = write_tiny_tokenizer(tmp_path / "t")
    (d / "chat_template.jinja").write_text("{{ enable_thinking is defined }}:{{ enable_thinking }}")
    custom = Tokenizer.from_dir(d)
    hi = [{"role": "user", "content": "x"}]
    assert [custom.apply_chat_template(hi, enable_thinking=e) for e in (None, True, False)] == [
        "False:", "True:True", "True:False"]
    assert tok.thinks_by_default  # Qwen3.6 thinks when enable_thinking is left out
    (d / "chat_template.jinja").write_text("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not Tokenizer.from_dir(d).thinks_by_default


def test_sandbox_blocks_unsafe_attribute_access(tmp_path: Path) -> None:
    d = write_tiny_tokenizer(tmp_path / "t")
    (d / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])


# -- random conversations against transformers' renderer ------------------------------------------

_text = st.text(alphabet="ab é\n中😀{}\"'", max_size=12)
_args = st.dictionaries(
    st.sampled_from(["city", "n", "flag", "obj", "items"]),
    st.one_of(_text, st.integers(-5, 5), st.booleans(), st.none(), st.floats(-10, 10, allow_nan=False),
              st.dictionaries(st.text("xy", max_size=2), st.integers(0, 3), max_size=2),
              st.lists(st.integers(0, 3), max_size=3)),
    max_size=3,
)


@st.composite
def _conversations(draw) -> tuple[list[dict], list[dict]]:
    """(messages for Lily, the same messages as transformers expects them)."""
    ours: list[dict] = []
    theirs: list[dict] = []
    if draw(st.booleans()):
        system = draw(_text)
        ours.append({"role": "system", "content": system})
        theirs.append({"role": "system", "content": system})
    turns = draw(st.lists(st.sampled_from(["user", "assistant", "tool"]), max_size=7))
    for role in ["user", *turns]:
        text = draw(_text)
        if role == "assistant":
            reasoning = draw(st.one_of(st.none(), _text))
            calls = draw(st.lists(st.tuples(st.sampled_from(["f", "get_weather"]), _args), max_size=2))
            mine: dict = {"role": role, "content": text}
            hf: dict = {"role": role, "content": text}
            if reasoning is not None:
                mine["reasoning" if draw(st.booleans()) else "reasoning_content"] = reasoning
                hf["reasoning_content"] = reasoning
            if calls:
                as_string = draw(st.booleans())
                mine["tool_calls"] = [{"type": "function", "function": {
                    "name": n, "arguments": json.dumps(a) if as_string else a}} for n, a in calls]
                hf["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
            ours.append(mine)
            theirs.append(hf)
        else:
            ours.append({"role": role, "content": text})
            theirs.append({"role": role, "content": text})
    return ours, theirs


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(_conversations(), st.booleans(), st.booleans(), st.booleans(), st.booleans())
def test_matches_transformers_rendering(tok: Tokenizer, conversation, tools, generation, thinking, preserve) -> None:
    ours, theirs = conversation
    schema = [WEATHER, ZEBRA] if tools else None
    expected, _ = render_jinja_template(
        [theirs], tools=schema, chat_template=PACKAGED_TEMPLATE.read_text("utf-8"),
        add_generation_prompt=generation, enable_thinking=thinking, preserve_thinking=preserve,
    )
    assert tok.apply_chat_template(ours, tools=schema, add_generation_prompt=generation,
                                   enable_thinking=thinking, preserve_thinking=preserve) == expected[0]
