"""/v1/chat/completions and /v1/completions through the official openai client."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))


def _word_token(tokenizer, min_len: int = 2) -> tuple[int, str]:
    """A vocabulary entry that decodes to >= min_len ASCII letters (for forcing repeats)."""
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        if len(text) >= min_len and text.isascii() and text.isalpha():
            return i, text
    raise AssertionError("no multi-letter token")


def test_chat_non_streaming(client):
    r = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=6,
        temperature=0,
    )
    assert r.object == "chat.completion"
    assert r.model == "tiny-llama"
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_chat_greedy_is_deterministic_and_streaming_matches(client):
    kw = dict(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=8,
        temperature=0,
    )
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == a
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_default_model_and_second_architecture(client):
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert r.model == "tiny-llama"
    r = client.chat.completions.create(
        model="tiny-qwen2",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
    )
    assert r.model == "tiny-qwen2" and r.usage.completion_tokens == 4


def test_max_completion_tokens_and_sampling_params(client):
    r = client.chat.completions.create(
        model="tiny-llama",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        max_completion_tokens=5,
        temperature=0.8,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert r.usage.completion_tokens == 5


def test_seed_reproduces_sampled_text(client):
    kw = dict(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Tell a story"}],
        max_tokens=12,
        temperature=1.0,
    )
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    others = {
        client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2, 3)
    }
    assert a == b
    assert len(others | {a}) > 1


def test_eos_finishes_with_stop_and_is_not_shown(client, tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    r = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=10,
        logit_bias={str(eos): 100},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == ""
    assert "<|im_end|>" not in r.choices[0].message.content


def test_logit_bias_forces_a_token(client, tokenizer):
    tid, text = _word_token(tokenizer)
    r = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logit_bias={str(tid): 100},
    )
    assert r.choices[0].message.content == text * 3


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_split_across_tokens_is_never_emitted(client, tokenizer, stream):
    tid, text = _word_token(tokenizer)
    # Forced output is text*N; a stop string made of the end of one token and the start of
    # the next can only match across a token boundary.
    stop = text[-1] + text[0]
    kw = dict(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        logit_bias={str(tid): 100},
        stop=[stop, "zzzz-unused"],
    )
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        r = client.chat.completions.create(**kw)
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop"
    assert content == (text * 8)[: (text * 8).index(stop)]
    assert stop not in content


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0
        assert len(item.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)
        assert item.top_logprobs[0].token == item.token
    assert "".join(i.token for i in content) == r.choices[0].message.content


def test_completions_non_streaming_and_streaming(client):
    r = client.completions.create(
        model="tiny-llama", prompt="Once upon a time", max_tokens=6, temperature=0
    )
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    chunks = list(
        client.completions.create(
            model="tiny-llama", prompt="Once upon a time", max_tokens=6, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_token_prompt_and_logprobs(client, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    r = client.completions.create(
        model="tiny-llama", prompt=ids, max_tokens=3, temperature=0, logprobs=2
    )
    by_text = client.completions.create(
        model="tiny-llama", prompt="Once upon a time", max_tokens=3, temperature=0
    )
    assert r.choices[0].text == by_text.choices[0].text
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3
    assert all(len(t) == 2 for t in lp.top_logprobs)


def test_models_list(client):
    ids = {m.id for m in client.models.list().data}
    assert {"tiny-llama", "tiny-qwen2"} <= ids


def test_n_choices(client):
    kw = dict(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Tell a story"}],
        max_tokens=6,
        temperature=1.0,
        seed=42,
    )
    r = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # choice i samples with seed + i
    assert texts[0] == client.chat.completions.create(**kw).choices[0].message.content
    one = client.chat.completions.create(**kw).usage
    assert r.usage.prompt_tokens == one.prompt_tokens  # the prompt counts once
    assert r.usage.completion_tokens == 18
    chunks = list(
        client.chat.completions.create(
            n=2, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    streamed = [
        "".join(
            c.choices[0].delta.content or ""
            for c in chunks
            if c.choices and c.choices[0].index == i
        )
        for i in (0, 1)
    ]
    assert streamed == texts[:2]
    finishes = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(f.index for f in finishes) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 12
    r = client.completions.create(
        model="tiny-llama", prompt="Once", n=2, max_tokens=4, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text


def test_logprobs_when_streaming(client):
    kw = dict(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    full = client.chat.completions.create(**kw).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [
        lp
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.content
    ]
    assert [(x.token, round(x.logprob, 4)) for x in streamed] == [
        (x.token, round(x.logprob, 4)) for x in full
    ]
    assert all(len(x.top_logprobs) == 2 for x in streamed)
    ckw = dict(
        model="tiny-llama", prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=2
    )
    ref = client.completions.create(**ckw).choices[0].logprobs
    chunks = list(client.completions.create(stream=True, **ckw))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [
        o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert tokens == ref.tokens and offsets == ref.text_offset


def test_logprobs_name_tokens_by_id_on_request(client, tokenizer):
    """vLLM's return_tokens_as_token_ids: logprobs name each token (and alternative) by id,
    which a byte piece's text cannot do; text, offsets and streams are otherwise the same."""
    ckw = dict(
        model="tiny-llama", prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2
    )
    plain = client.completions.create(**ckw).choices[0]
    by_id = client.completions.create(
        extra_body={"return_tokens_as_token_ids": True}, **ckw
    ).choices[0]
    assert by_id.text == plain.text
    assert all(t.startswith("token_id:") for t in by_id.logprobs.tokens)
    ids = [int(t.removeprefix("token_id:")) for t in by_id.logprobs.tokens]
    assert [tokenizer.decode([i]) for i in ids] == plain.logprobs.tokens
    assert by_id.logprobs.text_offset == plain.logprobs.text_offset
    assert all(k.startswith("token_id:") for top in by_id.logprobs.top_logprobs for k in top)
    kw = dict(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
    )
    full = client.chat.completions.create(**kw).choices[0].logprobs.content
    chunks = client.chat.completions.create(
        stream=True, **kw, extra_body={"return_tokens_as_token_ids": True}
    )
    streamed = [
        lp
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.content
    ]
    assert [tokenizer.decode([int(x.token.removeprefix("token_id:"))]) for x in streamed] == [
        x.token for x in full
    ]
    assert all(x.top_logprobs[0].token.startswith("token_id:") for x in streamed)
