"""A short soak (CI): mixed traffic in every dialect at concurrency 16, a fifth of the
streaming clients leaving mid-stream and 5% malformed bodies; then no 5xx, no slot held,
and resident memory flat over the second half. The full run (2,000 requests at C=64, real
MiniLM embeddings) is benchmarks/soak.py; the load itself is tests/ops/soak_load.py."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
from conftest import LiveServer, make_settings
from fixtures.tiny_encoders import make_tiny_bert_embedder, make_tiny_cross_encoder
from soak_load import Models, memory_books, rss_kib, run_soak, wait_idle

REQUESTS, CONCURRENCY = 3000, 16


@pytest.fixture(scope="module")
def soaked(tmp_path_factory, tiny_llama) -> Iterator[LiveServer]:
    from mlxd.store.local import ModelStore
    from mlxd.store.pull import pull

    home = tmp_path_factory.mktemp("soak")
    # a prefix cache small enough to be full before the middle of the run: it grows to its
    # budget by design (1 GiB by default: +25 MB in the second half of this run), and the
    # question here is whether anything grows *beyond* its bounds
    settings = make_settings(
        home, tiny_llama, engine={"max_num_seqs": 16, "prefix_cache_bytes": 4 << 20}
    )
    src = tmp_path_factory.mktemp("soaksrc")
    store = ModelStore(settings.models_dir)
    for name, make in (
        ("tiny-embed", make_tiny_bert_embedder),
        ("tiny-ce", make_tiny_cross_encoder),
    ):
        make(src / name)
        pull(store, str(src / name), settings.models, as_name=name)
    srv = LiveServer(settings).start()
    yield srv
    srv.stop()


def test_mixed_soak_leaves_no_errors_no_slots_and_flat_memory(soaked, capsys) -> None:
    models = Models(chat="tiny-llama", embed="tiny-embed", rerank="tiny-ce")
    pids = {"frontend": os.getpid(), "engine_core": soaked.health()["engine_core"]["pid"]}
    # warm-up: every model loaded, every path compiled, before anything is measured
    asyncio.run(
        run_soak(soaked.url, models, requests=60, concurrency=CONCURRENCY, pids=pids, seed=99)
    )
    res = asyncio.run(
        run_soak(soaked.url, models, requests=REQUESTS, concurrency=CONCURRENCY, pids=pids, seed=1)
    )
    h = wait_idle(soaked.url)
    res.rss_end = {k: rss_kib(p) for k, p in pids.items()}
    res.memory_end = memory_books(h)
    summary = res.as_dict()
    with capsys.disabled():
        print(
            f"\nsoak: {summary['requests']} requests in {summary['seconds']}s, "
            f"statuses {summary['statuses']}, left mid-stream "
            f"{summary['disconnected_mid_stream']}, malformed {summary['malformed']}, "
            f"RSS growth {summary['rss_growth_second_half']}"
        )
    assert res.requests == REQUESTS
    assert res.server_errors == 0, summary["statuses"]
    assert res.transport_errors == [], res.transport_errors[:5]
    assert res.stream_errors == [], res.stream_errors[:5]
    assert res.malformed_not_4xx == [], res.malformed_not_4xx[:5]
    assert res.disconnected > 0 and res.malformed > 0
    assert set(summary["by_kind"]) == {
        "chat",
        "chat_stream",
        "completion",
        "embed",
        "rerank",
        "tokenize",
        "ollama_chat",
        "ollama_generate",
        "anthropic",
        "anthropic_stream",
    }
    # no slot leaked: nothing in flight, no sequence running or waiting anywhere
    assert h["status"] == "ok" and h["requests_in_flight"] == 0
    assert all(m.get("running", 0) == 0 and m.get("waiting", 0) == 0 for m in h["models"])
    # memory flat over the second half (the first half filled the caches)
    growth = res.rss_growth()
    assert set(growth) == {"frontend", "engine_core"}
    assert all(g < 0.05 for g in growth.values()), summary["rss_kib"]
