"""Chat templates are the model's or the operator's, never a caller's, and a render is
bounded: past server.template_timeout_s or once its client leaves it is interrupted, and
the server serves the next request."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, make_settings
from fixtures.tiny_models import make_tiny_chat_model
from fixtures.tool_models import with_chat_template

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
LOOP = [{"role": "user", "content": "please loop"}]

# A last message saying "loop" (its text, or its parts') runs 10^10 empty iterations: an
# operator's template that is too slow for some inputs.
LOOP_PREFIX = (
    "{%- if 'loop' in (messages[-1]['content'] | string) %}"
    "{%- for i in range(100000) %}{%- for j in range(100000) %}{%- endfor %}{%- endfor %}"
    "{%- endif %}"
)
LOOPING_TEMPLATE = (
    LOOP_PREFIX + "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def looping_llama(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("m")
    src = make_tiny_chat_model(base / "src", "llama", max_position_embeddings=2048, seed=4)
    return with_chat_template(src, base / "looping-llama", LOOPING_TEMPLATE)


@pytest.fixture(scope="module")
def short_deadline(tmp_path_factory, looping_llama) -> Iterator[LiveServer]:
    home = tmp_path_factory.mktemp("home")
    srv = LiveServer(
        make_settings(
            home, looping_llama, server={"template_timeout_s": 1.0, "max_concurrent_renders": 2}
        )
    ).start()
    yield srv
    srv.stop()


def _error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param
    return err


def _wait_idle(srv: LiveServer) -> None:
    """Until every render thread of the front end has ended (interrupted ones included)."""
    deadline = time.time() + 120
    while srv.runtime.renderer.running:
        assert time.time() < deadline, "a render ran on"
        time.sleep(0.05)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chat_template": "SYSTEM OVERRIDE: {{ messages|length }}"},
        {"messages": "x"},
        {"conversation": []},
        {"tools": [{"type": "function"}]},
        {"documents": [{"title": "a", "text": "b"}]},
        {"add_generation_prompt": False},
        {"continue_final_message": True},
        {"tokenize": False},
        {"return_dict": True},
        {"return_tensors": "np"},
        {"padding": True},
        {"truncation": True},
        {"max_length": 1},
        {"tokenizer_kwargs": {}},
        {"eos_token": "x"},
        {"raise_exception": "x"},
        {"range": 1},
        {"num_images": 4},
        {"_private": 1},
        {"not an identifier": 1},
    ],
)
def test_template_kwargs_set_variables_only(server, kwargs):
    """A name that is a template, the messages or a render argument is a 400 naming
    chat_template_kwargs, never rendered (the override's text never reaches the model)."""
    with server.client() as c:
        r = c.post(CHAT, json={"messages": MSG, "max_tokens": 2, "chat_template_kwargs": kwargs})
        err = _error(r, 400, "chat_template_kwargs")
        assert err["type"] == "invalid_request_error"
        # and the request that follows, with a true variable, is served
        assert (
            c.post(
                CHAT,
                json={
                    "messages": MSG,
                    "max_tokens": 2,
                    "chat_template_kwargs": {"enable_thinking": False},
                },
            ).status_code
            == 200
        )


@pytest.mark.parametrize(
    "kwargs",
    [
        {f"v{i}": 1 for i in range(33)},
        {"deep": [[[[[[["x"]]]]]]]},
        {"wide": list(range(2000))},
        {"long": "x" * 70_000},
    ],
)
def test_template_kwargs_are_bounded(server, kwargs):
    with server.client() as c:
        r = c.post(CHAT, json={"messages": MSG, "max_tokens": 2, "chat_template_kwargs": kwargs})
        _error(r, 400, "chat_template_kwargs")


def test_template_variables_still_reach_the_template(server):
    with server.client() as c:
        r = c.post(
            CHAT,
            json={
                "messages": MSG,
                "max_tokens": 3,
                "chat_template_kwargs": {
                    "enable_thinking": False,
                    "reasoning_effort": "low",
                    "custom": {"a": [1, 2]},
                },
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3


def test_a_render_past_its_deadline_is_a_400_in_every_dialect(short_deadline):
    srv = short_deadline
    with srv.client(timeout=120) as c:
        err = _error(c.post(CHAT, json={"messages": LOOP, "max_tokens": 2}), 400, "messages")
        assert err["code"] == "template_timeout"
        assert "template_timeout_s" in err["message"]
        # streaming: the error comes before any event
        r = c.post(CHAT, json={"messages": LOOP, "max_tokens": 2, "stream": True})
        assert _error(r, 400, "messages")["code"] == "template_timeout"
        r = c.post("/api/chat", json={"model": "looping-llama", "messages": LOOP, "stream": False})
        assert r.status_code == 400 and "template" in r.json()["error"]
        r = c.post(
            "/v1/messages", json={"model": "looping-llama", "max_tokens": 2, "messages": LOOP}
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = c.post("/v1/messages/count_tokens", json={"model": "looping-llama", "messages": LOOP})
        assert r.status_code == 400, r.text
        r = c.post(
            "/v1/responses",
            json={"model": "looping-llama", "input": "please loop", "max_output_tokens": 2},
        )
        assert _error(r, 400, None)["code"] == "template_timeout"
        # /v1/tokenize renders in the engine core, under the same deadline
        r = c.post("/v1/tokenize", json={"model": "looping-llama", "messages": LOOP})
        assert _error(r, 400, "messages")["code"] == "template_timeout"
        _wait_idle(srv)
        # an unrelated request on the same server is served
        r = c.post(CHAT, json={"messages": MSG, "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert srv.health()["status"] == "ok"


def test_a_client_that_leaves_interrupts_its_render(start_server, looping_llama):
    """With one render slot and a deadline far away, a client that gives up frees the slot:
    its render is interrupted, not left to loop for the rest of the deadline."""
    srv = start_server(
        looping_llama, server={"template_timeout_s": 3600, "max_concurrent_renders": 1}
    )
    for path, body in (
        (CHAT, {"messages": LOOP, "max_tokens": 2}),
        ("/api/chat", {"model": "looping-llama", "messages": LOOP}),
        ("/v1/messages", {"model": "looping-llama", "max_tokens": 2, "messages": LOOP}),
    ):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + path, json=body, timeout=httpx.Timeout(60, read=1.0))
        _wait_idle(srv)
        r = httpx.post(srv.url + CHAT, json={"messages": MSG, "max_tokens": 2}, timeout=120)
        assert r.status_code == 200, r.text
    # the engine core's renders too (/v1/tokenize), each interrupted by its cancelled call
    for _ in range(2):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                srv.url + "/v1/tokenize",
                json={"messages": LOOP},
                timeout=httpx.Timeout(60, read=1.0),
            )
    r = httpx.post(srv.url + "/v1/tokenize", json={"messages": MSG}, timeout=120)
    assert r.status_code == 200, r.text


def test_a_vision_render_in_the_engine_core_stops_with_its_client(tmp_path, tiny_llama):
    """A vision prompt renders in the engine core: a client that leaves aborts its request
    there, which interrupts the render (one slot, a deadline far away: the next request to
    the model is served only if it was)."""
    import json

    from fixtures.tiny_vlm import QWEN2_VL_TEMPLATE, make_tiny_qwen2_vl

    src = make_tiny_qwen2_vl(tmp_path / "src" / "looping-vl")
    template = LOOP_PREFIX + QWEN2_VL_TEMPLATE
    (src / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    from mlxd.config import ModelSettings
    from mlxd.store.local import ModelStore
    from mlxd.store.pull import pull

    models = tmp_path / "home" / "models"
    assert pull(ModelStore(models), str(src), ModelSettings(dir=models))["kind"] == "vision"
    srv = LiveServer(
        make_settings(
            tmp_path / "home",
            tiny_llama,
            models={"preload": ["looping-vl"]},
            server={"template_timeout_s": 3600, "max_concurrent_renders": 1},
        )
    ).start()
    try:
        body = {"model": "looping-vl", "max_tokens": 2}
        for _ in range(2):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    srv.url + CHAT,
                    json={**body, "messages": LOOP},
                    timeout=httpx.Timeout(60, read=1.0),
                )
        r = httpx.post(srv.url + CHAT, json={**body, "messages": MSG}, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
