"""POST/GET/DELETE /v1/responses through the official openai client."""

from __future__ import annotations

import json

import openai
import pytest

TOOLS = [
    {
        "type": "function",
        "name": "lookup",
        "description": "Look a word up",
        "parameters": {
            "type": "object",
            "properties": {"word": {"enum": ["sea", "sky"]}},
            "required": ["word"],
            "additionalProperties": False,
        },
    }
]


@pytest.fixture(scope="module")
def client(agent_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent_server.url + "/v1", api_key="x", max_retries=0)


def test_text_and_previous_response_id(client):
    r1 = client.responses.create(
        model="plain-llama",
        input="Hello there",
        instructions="Be brief.",
        max_output_tokens=6,
        temperature=0,
    )
    assert r1.object == "response" and r1.id.startswith("resp_")
    assert r1.status == "incomplete" and r1.incomplete_details.reason == "max_output_tokens"
    assert r1.output_text and r1.output[0].type == "message"
    assert r1.usage.output_tokens == 6

    r2 = client.responses.create(
        model="plain-llama",
        input="And then?",
        previous_response_id=r1.id,
        max_output_tokens=6,
        temperature=0,
    )
    assert r2.previous_response_id == r1.id
    # the history (first input and answer) came along
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    ref = client.chat.completions.create(
        model="plain-llama",
        max_tokens=6,
        temperature=0,
        messages=[
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": r1.output_text},
            {"role": "user", "content": "And then?"},
        ],
    )
    assert r2.output_text == ref.choices[0].message.content
    assert r2.usage.input_tokens == ref.usage.prompt_tokens  # instructions not carried over
    # a third turn: the second's whole prompt and answer come from the prefix cache
    r3 = client.responses.create(
        model="plain-llama",
        input="More?",
        previous_response_id=r2.id,
        max_output_tokens=4,
        temperature=0,
    )
    assert r3.usage.input_tokens_details.cached_tokens >= r2.usage.input_tokens

    got = client.responses.retrieve(r1.id)
    assert got.id == r1.id and got.output_text == r1.output_text
    client.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="plain-llama", input="x", previous_response_id=r1.id)


def test_streaming_events(client):
    kw = dict(
        model="plain-llama",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Tell a story"}]}],
        max_output_tokens=8,
        temperature=0,
    )
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == client.responses.create(**kw).output_text
    assert events[-1].response.output_text == text


def test_function_call_round_trip(client):
    r = client.responses.create(
        model="tool-qwen2",
        input="What does sea mean?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "lookup"},
        max_output_tokens=80,
        temperature=0,
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "lookup" and json.loads(call.arguments)["word"] in ("sea", "sky")
    assert call.call_id.startswith("call_") and r.status == "completed"

    events = list(
        client.responses.create(
            model="tool-qwen2",
            input="What does sea mean?",
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=80,
            temperature=0,
            stream=True,
        )
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments)["word"] in ("sea", "sky")
    assert events[-1].type == "response.completed"
    with client.responses.stream(  # the client's accumulating helper
        model="tool-qwen2",
        input="What does sea mean?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        temperature=0,
    ) as stream:
        final = stream.get_final_response()
    (fcall,) = [o for o in final.output if o.type == "function_call"]
    assert fcall.arguments == done[0].arguments

    r2 = client.responses.create(
        model="tool-qwen2",
        previous_response_id=r.id,
        tools=TOOLS,
        max_output_tokens=4,
        temperature=0,
        input=[
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": "a large body of salt water",
            }
        ],
    )
    assert r2.output_text and r2.usage.input_tokens_details.cached_tokens > 0
