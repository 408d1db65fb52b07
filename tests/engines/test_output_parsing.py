"""The streaming split of generated text into answer, reasoning and tool calls."""

from __future__ import annotations

import json

import pytest

from mlxd.text.tool_calls import (
    OutputSplitter,
    ToolFormat,
    _parse_json_call,
    fallback_messages,
    template_messages,
)

FMT = ToolFormat("json_tools", "<tool_call>", "</tool_call>", _parse_json_call, True)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def run(splitter: OutputSplitter, text: str, chunk: int) -> tuple[str, str, list]:
    content, reasoning, calls = [], [], []
    for i in range(0, len(text), chunk):
        c, r, k = splitter.feed(text[i : i + chunk])
        content.append(c)
        reasoning.append(r)
        calls.extend(k)
    c, r, k = splitter.flush()
    return "".join(content) + c, "".join(reasoning) + r, calls + k


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
def test_tool_calls_are_parsed_whatever_the_chunking(chunk):
    text = "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo")
    content, reasoning, calls = run(OutputSplitter(fmt=FMT), text, chunk)
    assert content == "Let me check."
    assert reasoning == ""
    assert [c.name for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_thinking_is_split_off(chunk):
    s = OutputSplitter(think=("<think>", "</think>"), reasoning=True, fmt=FMT)
    content, reasoning, calls = run(s, "I should look.\n</think>\n\nThe answer is 4.", chunk)
    assert reasoning == "I should look.\n"
    assert content == "The answer is 4."
    assert calls == []
    s = OutputSplitter(think=("<think>", "</think>"))
    content, reasoning, _ = run(s, "<think>hmm</think>ok <think", chunk)
    assert (content, reasoning) == ("ok <think", "hmm")  # an unfinished marker is text


def test_text_that_only_looks_like_a_marker_is_released():
    s = OutputSplitter(fmt=FMT)
    assert s.feed("a <tool")[0] == "a"  # "<tool" held: it could become a marker
    assert s.feed("box> b")[0] == " <toolbox> b"
    assert s.flush() == ("", "", [])


def test_an_unparseable_or_cut_off_call_comes_back_as_text():
    content, _, calls = run(OutputSplitter(fmt=FMT), "x <tool_call>{not json}</tool_call> y", 3)
    assert calls == [] and content == "x <tool_call>{not json}</tool_call> y"
    content, _, calls = run(OutputSplitter(fmt=FMT), 'x <tool_call>{"name": "f", "argu', 5)
    assert calls == [] and content == 'x <tool_call>{"name": "f", "argu'


def test_parallel_off_keeps_the_first_call_and_no_tools_means_no_parsing():
    _, _, calls = run(OutputSplitter(fmt=FMT, parallel=False), CALL + CALL, 5)
    assert len(calls) == 1
    content, _, calls = run(OutputSplitter(), CALL, 5)
    assert calls == [] and content == CALL


def test_template_messages_and_the_fallback_syntax():
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    fixed = template_messages(history)
    assert fixed[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert history[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    fb = fallback_messages(history, tools)
    assert fb[0]["role"] == "system" and "get_weather" in fb[0]["content"]
    assert '"name": "get_weather"' in fb[2]["content"] and "<tool_call>" in fb[2]["content"]
    assert fb[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
