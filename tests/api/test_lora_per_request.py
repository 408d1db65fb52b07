"""LoRA adapters per request: registered at run time (vLLM's routes), named as the model,
decoded on the base model in one batch with other adapters and with plain rows; each row's
greedy text is what a server started with that adapter alone (``--adapter``) answers."""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, make_settings
from fixtures.lora import MSG, chat, make_lora_adapter, replies_alone, reply_text


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "alpha": make_lora_adapter(tiny_llama, root / "alpha", seed=0),
        "beta": make_lora_adapter(tiny_llama, root / "beta", seed=1),
        "gamma": make_lora_adapter(tiny_llama, root / "gamma", rank=8, seed=2),
    }


@pytest.fixture(scope="module")
def expected(tiny_llama, adapters, tmp_path_factory) -> dict[str, str]:
    """Each adapter's greedy reply from a server started with it alone, and the base's."""
    out = replies_alone(tmp_path_factory, tiny_llama, {"tiny-llama": None, **adapters})
    assert len(set(out.values())) == len(out), out  # each adapter really answers differently
    return out


@pytest.fixture(scope="module")
def srv(tiny_llama, adapters, tmp_path_factory):
    server = LiveServer(make_settings(tmp_path_factory.mktemp("home"), tiny_llama)).start()
    for name, path in adapters.items():
        r = httpx.post(
            server.url + "/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": str(path)},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert f"'{name}'" in r.text
    yield server
    server.stop()


def test_adapters_are_listed_with_their_base(srv, adapters):
    data = httpx.get(srv.url + "/v1/models").json()["data"]
    cards = {m["id"]: m for m in data}
    for name, path in adapters.items():
        assert cards[name]["parent"] == "tiny-llama"
        assert cards[name]["root"] == str(path.resolve())
    assert "parent" not in cards["tiny-llama"]
    one = httpx.get(srv.url + "/v1/models/beta").json()
    assert one["id"] == "beta" and one["parent"] == "tiny-llama"


def test_each_adapter_alone_answers_as_its_own_server(srv, expected):
    for name in ("alpha", "beta", "gamma"):
        assert reply_text(chat(srv.url, name)) == expected[name], name
    assert reply_text(chat(srv.url, "tiny-llama:beta")) == expected["beta"]
    assert reply_text(chat(srv.url, "tiny-llama")) == expected["tiny-llama"]


def test_three_adapters_and_the_base_in_one_batch(srv, expected):
    names = ["alpha", "beta", "gamma", "tiny-llama"] * 3
    with cf.ThreadPoolExecutor(len(names)) as pool:
        texts = list(pool.map(lambda n: reply_text(chat(srv.url, n)), names))
    assert texts == [expected[n] for n in names]
    batch = {m["name"]: m for m in srv.health()["models"]}["tiny-llama"]
    assert {a["name"] for a in batch["lora_adapters"]} == {"alpha", "beta", "gamma"}
    assert batch["cache_memory_bytes"]["lora_adapters"] > 0


def test_an_adapter_does_not_reuse_the_base_models_cached_prefix(srv):
    long = [{"role": "user", "content": "tell me about the sea " * 12}]
    body = {"messages": long, "max_tokens": 2, "temperature": 0}
    r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "model": "tiny-llama"})
    r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "model": "tiny-llama"})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "model": "alpha"})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_load_and_unload_errors(srv, adapters, tmp_path):
    def load(**body) -> httpx.Response:
        return httpx.post(srv.url + "/v1/load_lora_adapter", json=body, timeout=60)

    r = load(lora_name="alpha", lora_path=str(adapters["alpha"]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = load(lora_name="nowhere", lora_path=str(tmp_path / "missing"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "dora"}))
    r = load(lora_name="dora", lora_path=str(tmp_path / "dora"))
    assert r.status_code == 400 and "dora" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "nobody"})
    assert r.status_code == 404, r.text
    names = {m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]}
    assert "dora" not in names and "nowhere" not in names


def test_unload_forgets_the_adapter(srv, adapters):
    r = httpx.post(
        srv.url + "/v1/load_lora_adapter",
        json={"lora_name": "delta", "lora_path": str(adapters["alpha"])},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert reply_text(chat(srv.url, "delta"))
    r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "delta"})
    assert r.status_code == 200, r.text
    r = chat(srv.url, "delta")
    assert r.status_code == 404, r.text
    assert "delta" not in {m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]}


def test_only_an_admin_key_loads_adapters(tiny_llama, adapters, start_server):
    srv = start_server(
        tiny_llama,
        security={
            "api_keys": [
                {"name": "a", "key": "k-user"},
                {"name": "b", "key": "k-admin", "admin": True},
            ]
        },
    )
    body = {"lora_name": "alpha", "lora_path": str(adapters["alpha"])}
    url = srv.url + "/v1/load_lora_adapter"
    r = httpx.post(url, json=body, headers={"Authorization": "Bearer k-user"}, timeout=60)
    assert r.status_code == 403, r.text
    r = httpx.post(url, json=body, headers={"Authorization": "Bearer k-admin"}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "alpha", "messages": MSG, "max_tokens": 2},
        headers={"Authorization": "Bearer k-user"},
    )
    assert r.status_code == 200, r.text  # any key may use a loaded adapter


def test_an_adapter_in_use_is_never_unloaded(tiny_llama, adapters):
    """The engine's rule (a request in flight cannot be timed through HTTP on a model this
    fast): while a waiting or running sequence names the adapter, unloading it is a 400."""
    from mlx_lm import load

    from mlxd.core.errors import InvalidRequest
    from mlxd.engines.lora import RowAdapters, read_adapter

    model, _ = load(str(tiny_llama))
    busy: set[str] = set()
    rows = RowAdapters(model, lambda name: name in busy)
    rows.load(read_adapter("alpha", adapters["alpha"]))
    busy.add("alpha")
    with pytest.raises(InvalidRequest, match="in use"):
        rows.load(read_adapter("alpha", adapters["beta"]))  # nor replaced
    with pytest.raises(InvalidRequest, match="in use"):
        rows.unload("alpha")
    busy.clear()
    rows.unload("alpha")
    assert not rows.adapters


def test_the_playground_offers_adapters_beside_their_base(srv):
    o = httpx.get(srv.url + "/ui/api/overview").json()
    offered = {a["name"]: a for a in o["adapters"]}
    assert offered["alpha"] == {"name": "alpha", "kind": "chat", "parent": "tiny-llama"}
