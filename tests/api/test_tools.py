"""Tool calling through the official openai and anthropic clients.

The tiny models have random weights and never call a tool on their own: tool_choice
"required" / a named function makes the grammar engine write the call, in the model's own
syntax (Qwen2.5's ``<tool_call>`` JSON for the template that speaks tools, the fallback
syntax for the plain ChatML one), and the server parses it back out.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(agent_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent_server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(agent_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=agent_server.url, api_key="x", max_retries=0)


def _check_call(call, name="get_weather") -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(
        args, WEATHER if name == "get_weather" else TOOLS[1]["function"]["parameters"]
    )
    return args


@pytest.mark.parametrize("model", ["tool-qwen2", "plain-llama"])
def test_named_tool_call_round_trip(client, tool_qwen2, model):
    kw = dict(
        model=model,
        messages=ASK,
        tools=TOOLS,
        max_tokens=120,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    args = _check_call(call)

    # streaming: the same call as one tool_calls delta, then finish_reason tool_calls
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "get_weather"
    assert json.loads(deltas[0].function.arguments) == args
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""

    # the result goes back through the chat template (role "tool")
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"},
    ]
    r2 = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert r2.choices[0].finish_reason == "length" and r2.choices[0].message.content
    assert not r2.choices[0].message.tool_calls
    if model == "tool-qwen2":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tool_qwen2))
        expected = tok.apply_chat_template(
            [
                *ASK,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "get_weather", "arguments": args}}
                    ],
                },
                {"role": "tool", "content": "sunny, 24 C"},
            ],
            tools=TOOLS,
            add_generation_prompt=True,
            tokenize=False,
        )
        assert "<tool_response>\nsunny, 24 C\n</tool_response>" in expected
        assert r2.usage.prompt_tokens == len(tok(expected)["input_ids"])
    # the history's prefix was in the prefix cache
    assert r2.usage.prompt_tokens_details.cached_tokens > r.usage.prompt_tokens // 2


def test_required_lets_the_model_pick_among_tools_and_none_parses_nothing(client):
    r = client.chat.completions.create(
        model="tool-qwen2",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=1,
        seed=5,
    )
    (call,) = r.choices[0].message.tool_calls
    _check_call(call, call.function.name)
    assert call.function.name in ("get_weather", "get_time")
    r = client.chat.completions.create(
        model="tool-qwen2",
        messages=ASK,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=5,
        temperature=0,
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"


def test_tool_choice_errors_are_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tool-qwen2",
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tool-qwen2", messages=ASK, tool_choice="required")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tool-qwen2",
            messages=ASK,
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "bad",
                        "parameters": {
                            "type": "object",
                            "properties": {"x": {"not": {"type": "string"}}},
                        },
                    },
                }
            ],
            tool_choice="required",
        )
    assert "not supported" in e.value.body["message"]


def test_anthropic_tool_use_round_trip(claude):
    tools = [{"name": "get_weather", "description": "Forecast", "input_schema": WEATHER}]
    kw = dict(
        model="tool-qwen2",
        max_tokens=120,
        tools=tools,
        extra_body={"temperature": 0},
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
    )
    m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    (block,) = [b for b in m.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER)

    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (sblock,) = [b for b in final.content if b.type == "tool_use"]
    assert sblock.input == block.input

    m2 = claude.messages.create(
        model="tool-qwen2",
        max_tokens=4,
        tools=tools,
        messages=[
            *kw["messages"],
            {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": block.id, "content": "snow"},
                    {"type": "text", "text": "Thanks. Pack what?"},
                ],
            },
        ],
    )
    assert m2.stop_reason == "max_tokens" and m2.content[0].type == "text"
    assert m2.usage.cache_read_input_tokens > 0


def test_anthropic_tool_use_stream_events(agent_server):
    body = {
        "model": "tool-qwen2",
        "max_tokens": 120,
        "stream": True,
        "messages": [{"role": "user", "content": "Time?"}],
        "tools": [{"name": "get_time", "input_schema": TOOLS[1]["function"]["parameters"]}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    }
    with httpx.stream("POST", agent_server.url + "/v1/messages", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    start = next(e for e in events if e["type"] == "content_block_start")
    assert start["content_block"]["type"] == "tool_use"
    assert start["content_block"]["name"] == "get_time"
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"input_json_delta"}
    partial = "".join(d["partial_json"] for d in deltas)
    assert json.loads(partial)["zone"] in ("UTC", "CET")
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_ollama_tools_and_tool_history(agent_server, tool_qwen2):
    # raw HTTP: the ollama client rewrites tool schemas (drops additionalProperties...)
    r = httpx.post(
        agent_server.url + "/api/chat",
        timeout=60,
        json={
            "model": "tool-qwen2",
            "tools": TOOLS,
            "stream": False,
            "options": {"temperature": 0, "num_predict": 4},
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "function": {
                                "name": "get_weather",
                                "arguments": {"city": "Paris", "days": 2},
                            }
                        }
                    ],
                },
                {"role": "tool", "tool_name": "get_weather", "content": "rain"},
            ],
        },
    )
    body = r.json()
    assert r.status_code == 200 and body["message"]["content"]
    assert body["done_reason"] == "length"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tool_qwen2))
    text = tok.apply_chat_template(
        [
            *ASK,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Paris", "days": 2},
                        },
                    }
                ],
            },
            {"role": "tool", "content": "rain"},
        ],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert body["prompt_eval_count"] == len(tok(text)["input_ids"])


def _history(calls) -> list[dict]:
    return [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    ]


@pytest.mark.parametrize(
    ("calls", "param"),
    [
        (
            [{"id": "a", "type": "function", "function": "notadict"}],
            "messages[1].tool_calls[0].function",
        ),
        ("notalist", "messages[1].tool_calls"),
        ({"id": "a"}, "messages[1].tool_calls"),
        (["notadict"], "messages[1].tool_calls[0]"),
        (
            [{"id": "a", "type": "function", "function": {"arguments": "{}"}}],
            "messages[1].tool_calls[0].function.name",
        ),
        (
            [{"id": "a", "type": "function", "function": {"name": 7, "arguments": "{}"}}],
            "messages[1].tool_calls[0].function.name",
        ),
        (
            [{"id": "a", "type": "function", "function": {"name": "get_time", "arguments": 5}}],
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            [{"id": "a", "type": "function", "function": {"name": "get_time", "arguments": [1]}}],
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            [{"id": 5, "type": "function", "function": {"name": "get_time", "arguments": "{}"}}],
            "messages[1].tool_calls[0].id",
        ),
        (
            [{"id": "a", "type": "code", "function": {"name": "get_time", "arguments": "{}"}}],
            "messages[1].tool_calls[0].type",
        ),
    ],
)
@pytest.mark.parametrize("model", ["tool-qwen2", "plain-llama"])
def test_malformed_tool_calls_in_the_history_are_400(agent_server, calls, param, model):
    """With a template that renders tools and with the fallback syntax; /v1/tokenize
    reads the same messages."""
    url = agent_server.url
    for tools in (TOOLS, None):
        r = httpx.post(
            url + "/v1/chat/completions",
            timeout=60,
            json={"model": model, "messages": _history(calls), "tools": tools, "max_tokens": 2},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    r = httpx.post(
        url + "/v1/tokenize", timeout=60, json={"model": model, "messages": _history(calls)}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_malformed_tool_calls_in_other_dialects_are_400(agent_server):
    url = agent_server.url
    for call, param in (
        ({"function": "notadict"}, "messages[1].tool_calls[0].function"),
        ("notadict", None),
        ({"function": {"arguments": {}}}, "messages[1].tool_calls[0].function.name"),
        (
            {"function": {"name": "get_time", "arguments": 3}},
            "messages[1].tool_calls[0].function.arguments",
        ),
    ):
        r = httpx.post(
            url + "/api/chat",
            timeout=60,
            json={
                "model": "tool-qwen2",
                "tools": TOOLS,
                "stream": False,
                "messages": [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]}],
            },
        )
        assert r.status_code == 400, r.text
        if param is not None:
            assert param in r.json()["error"]
    for item, field in (
        ({"name": None}, "name"),
        ({"name": ""}, "name"),
        ({"name": "get_time", "arguments": 5}, "arguments"),
        ({"name": "get_time", "call_id": 5}, "call_id"),
    ):
        r = httpx.post(
            url + "/v1/responses",
            timeout=60,
            json={
                "model": "tool-qwen2",
                "tools": [{"type": "function", "name": "get_time"}],
                "max_output_tokens": 2,
                "input": [
                    {"role": "user", "content": "Time?"},
                    {"type": "function_call", "call_id": "c", **item},
                ],
            },
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == f"input[1].{field}"
    for block, field in (
        ({"name": None, "input": {}}, "name"),
        ({"name": "get_time", "input": "x"}, "input"),
        ({"name": "get_time", "input": {}, "id": 5}, "id"),
    ):
        r = httpx.post(
            url + "/v1/messages",
            timeout=60,
            json={
                "model": "tool-qwen2",
                "max_tokens": 2,
                "messages": [
                    {"role": "user", "content": "Time?"},
                    {"role": "assistant", "content": [{"type": "tool_use", **block}]},
                ],
            },
        )
        assert r.status_code == 400, r.text
        assert field in r.json()["error"]["message"]
    # the server still serves
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={"model": "tool-qwen2", "messages": ASK, "max_tokens": 2},
    )
    assert r.status_code == 200


@pytest.mark.parametrize("model", ["tool-qwen2", "plain-llama"])
@pytest.mark.parametrize("max_tokens", [1, 3, 8, 20])
def test_a_forced_call_cut_by_max_tokens_leaks_nothing(client, model, max_tokens):
    """A forced call the length limit cuts is incomplete: finish_reason "length", no
    content (not even the call's markup), no call reported, streamed or not."""
    kw = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=max_tokens, temperature=0)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(tool_choice=choice, **kw)
        c = r.choices[0]
        assert c.finish_reason == "length"
        assert not c.message.content and not c.message.tool_calls, c.message
        chunks = list(client.chat.completions.create(tool_choice=choice, stream=True, **kw))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ""
        assert not any(ch.choices[0].delta.tool_calls for ch in chunks if ch.choices)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
