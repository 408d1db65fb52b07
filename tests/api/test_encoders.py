"""Embeddings, reranking and token counting through HTTP, on one server.

The server's default chat model is the real SmolLM2 (the LLM reranker), its default
embedding model the real all-MiniLM-L6-v2 (checked against sentence-transformers vectors
stored in fixtures/minilm_reference.json); generated tiny encoders in the real Hugging Face
layouts stand in for rerankers and other embedders (fixtures/tiny_encoders.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from conftest import LiveServer, make_settings
from fixtures.tiny_encoders import (
    make_tiny_bert_embedder,
    make_tiny_cross_encoder,
    make_tiny_xlmr_cross_encoder,
)
from fixtures.tiny_models import make_tiny_chat_model

from mlxd.enginecore.protocol import Scorers

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MINILM = "all-minilm-l6-v2"
SMOL = "smollm2-135m-instruct"


def _qwen3_embedder(out: Path) -> Path:
    """A tiny Qwen3 as a Qwen3-Embedding checkpoint: the bare body (no ``model.`` prefix),
    sentence-transformers files with last-token pooling and normalisation."""
    import mlx.core as mx

    make_tiny_chat_model(out, "qwen3", seed=3)
    w = mx.load(str(out / "model.safetensors"))
    mx.save_safetensors(
        str(out / "model.safetensors"), {k.removeprefix("model."): v for k, v in w.items()}
    )
    (out / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_lasttoken": True})
    )
    return out


@pytest.fixture(scope="module")
def srv(tmp_path_factory, long_llama):
    from mlxd.store.local import ModelStore
    from mlxd.store.pull import pull

    home = tmp_path_factory.mktemp("enc")
    settings = make_settings(home, SMOL, models={"preload": [str(long_llama)]})
    store = ModelStore(settings.models_dir)
    src = tmp_path_factory.mktemp("encsrc")

    def cls_embedder(out: Path) -> Path:
        return make_tiny_bert_embedder(out, pooling="cls", seed=5)

    for name, make in (
        ("tiny-embed", make_tiny_bert_embedder),
        ("tiny-embed-cls", cls_embedder),
        ("tiny-ce", make_tiny_cross_encoder),
        ("tiny-xlmr-reranker", make_tiny_xlmr_cross_encoder),
        ("tiny-qwen3-embedding", _qwen3_embedder),
    ):
        make(src / name)
        pull(store, str(src / name), settings.models, as_name=name)
    s = LiveServer(settings).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(srv):
    with srv.client(timeout=120) as c:
        yield c


def _oai(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def _embed(http, inputs, **kw) -> np.ndarray:
    r = http.post("/v1/embeddings", json={"input": inputs, **kw})
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def _model_status(srv, name: str) -> dict:
    return next(m for m in srv.health()["models"] if m["name"] == name)


# -- embeddings ---------------------------------------------------------------------------------


def test_minilm_agrees_with_sentence_transformers(http):
    ref = json.loads((FIXTURES / "minilm_reference.json").read_text())
    r = http.post("/v1/embeddings", json={"input": ref["sentences"]})  # default model
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == MINILM and body["object"] == "list"
    assert [d["index"] for d in body["data"]] == list(range(len(ref["sentences"])))
    ours = np.array([d["embedding"] for d in body["data"]])
    theirs = np.array(ref["vectors"])
    cos = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cos.min() >= 0.999, cos  # includes a text longer than the 256-token limit
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 256


def test_float_and_base64_decode_to_the_same_numbers(srv):
    client = _oai(srv)
    texts = ["The cat sat on the mat.", "Water boils at 100 degrees."]
    flt = client.embeddings.create(model=MINILM, input=texts, encoding_format="float")
    b64 = client.embeddings.create(model=MINILM, input=texts, encoding_format="base64")
    auto = client.embeddings.create(model=MINILM, input=texts)  # the client asks for base64
    for f, b, a in zip(flt.data, b64.data, auto.data, strict=True):
        decoded = np.frombuffer(base64.b64decode(b.embedding), dtype="<f4")
        assert len(f.embedding) == 384
        np.testing.assert_array_equal(np.array(f.embedding, dtype=np.float32), decoded)
        np.testing.assert_array_equal(np.array(a.embedding, dtype=np.float32), decoded)
    assert flt.usage.prompt_tokens == flt.usage.total_tokens > 0


def test_dimensions_truncate_then_normalise(http):
    full = _embed(http, ["Matryoshka embeddings nest."])[0]
    short = _embed(http, ["Matryoshka embeddings nest."], dimensions=64)[0]
    assert short.shape == (64,)
    assert math.isclose(float(np.linalg.norm(short)), 1.0, rel_tol=1e-5)
    np.testing.assert_allclose(short, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)
    r = http.post("/v1/embeddings", json={"input": "x", "dimensions": 385})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    assert http.post("/v1/embeddings", json={"input": "x", "dimensions": 0}).status_code == 400


def test_token_id_inputs_equal_text_inputs(http):
    ids = http.post(
        "/v1/tokenize", json={"model": MINILM, "input": "hello world", "return_tokens": True}
    ).json()["data"][0]["token_ids"]
    by_text = _embed(http, "hello world", model=MINILM)
    by_ids = _embed(http, ids, model=MINILM)
    np.testing.assert_allclose(by_text, by_ids, atol=1e-6)
    assert (
        http.post("/v1/embeddings", json={"model": MINILM, "input": [[10**9]]}).status_code == 400
    )


def test_sixty_four_concurrent_requests_share_batches_and_keep_their_own_vectors(srv, http):
    http.post("/unload", json={"model": MINILM})  # a fresh engine: fresh batch counters
    texts = [
        f"Sentence number {i} is about {w}."
        for i, w in enumerate(
            ("apples rivers planets music trains cats mountains code " * 8).split()
        )
    ]
    assert len(set(texts)) == 64
    alone = np.stack([_embed(http, t, model=MINILM)[0] for t in texts])  # one at a time
    assert _model_status(srv, MINILM)["max_batch_size_seen"] == 1

    async def main():
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        rs = await asyncio.gather(
            *(
                client.embeddings.create(model=MINILM, input=t, encoding_format="float")
                for t in texts
            )
        )
        await client.close()
        return rs

    rs = asyncio.run(main())
    got = np.array([r.data[0].embedding for r in rs], dtype=np.float32)
    np.testing.assert_allclose(got, alone, atol=2e-5)  # each response is its own input's
    sims = got @ got.T  # ... and the inputs' vectors are all distinct
    assert (sims - np.eye(64) * 2 < 0.9999).all()
    assert _model_status(srv, MINILM)["max_batch_size_seen"] > 1
    metrics = http.get("/metrics").text
    count = _hist(metrics, "mlxd:embed_batch_size_count", MINILM)
    le1 = _hist(metrics, 'mlxd:embed_batch_size_bucket{le="1.0"', MINILM)
    assert count > le1  # some forward passes held more than one input


def _hist(text: str, prefix: str, model: str) -> float:
    for line in text.splitlines():
        if line.startswith(prefix) and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{prefix} for {model} not in /metrics")


def test_truncate_true_cuts_and_false_rejects(http):
    long = "word " * 400
    ok = http.post("/v1/embeddings", json={"input": ["short", long]})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 3 + 256
    r = http.post("/v1/embeddings", json={"input": ["short", long], "truncate": False})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "input[1]"
    assert "256" in err["message"]
    r = http.post("/api/embed", json={"model": MINILM, "input": long, "truncate": False})
    assert r.status_code == 400 and "256" in r.json()["error"]  # Ollama-shaped
    docs = ["short", "tiny " * 200]
    assert (
        http.post(
            "/v1/rerank", json={"model": "tiny-ce", "query": "q", "documents": docs}
        ).status_code
        == 200
    )
    r = http.post(
        "/v1/rerank", json={"model": "tiny-ce", "query": "q", "documents": docs, "truncate": False}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents[1]"


def test_limits_are_clear_errors(srv, http):
    def err(path, body, status):
        r = http.post(path, json=body)
        assert r.status_code == status, (path, body, r.text)
        return r.json()["error"]

    assert err("/v1/embeddings", {"input": []}, 400)["param"] == "input"
    assert err("/v1/embeddings", {"input": ["ok", ""]}, 400)["param"] == "input[1]"
    limit = srv.settings.batch.max_inputs_per_request
    e = err("/v1/embeddings", {"input": ["x"] * (limit + 1)}, 413)
    assert e["code"] == "request_too_large" and str(limit) in e["message"]
    assert err("/v1/rerank", {"model": "tiny-ce", "query": "q", "documents": []}, 400)
    err("/v1/rerank", {"model": "tiny-ce", "query": "q", "documents": ["d"] * (limit + 1)}, 413)
    assert (
        err("/v1/rerank", {"model": "tiny-ce", "query": "", "documents": ["d"]}, 400)["param"]
        == "query"
    )
    assert "chat model" in err("/v1/embeddings", {"model": SMOL, "input": "x"}, 400)["message"]
    assert (
        "embedding model"
        in err("/v1/rerank", {"model": MINILM, "query": "q", "documents": ["d"]}, 400)["message"]
    )
    err("/v1/embeddings", {"model": "no-such-model", "input": "x"}, 404)
    err("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, 400)
    assert isinstance(err("/api/embed", {"model": SMOL, "input": "x"}, 400), str)


def test_a_decoder_embedder_pools_the_last_token_and_batches_exactly(http):
    texts = ["Hello!", "The quick brown fox jumps over the lazy dog.", "Keep calm."]
    together = _embed(http, texts, model="tiny-qwen3-embedding")
    assert together.shape == (3, 64)
    alone = np.concatenate([_embed(http, t, model="tiny-qwen3-embedding") for t in texts])
    np.testing.assert_allclose(together, alone, atol=1e-5)  # right padding changes nothing
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, rtol=1e-5)


def test_tiny_embedders_match_a_numpy_bert_with_their_pooling(http, srv):
    texts = ["the cat sat on the mat.", "hello", "water boils at 100 degrees celsius."]
    for name, pool in (("tiny-embed", "mean"), ("tiny-embed-cls", "cls")):
        got = _embed(http, texts, model=name)  # one request: padded into one batch
        w, cfg, tok = _load_np(srv.runtime.models.store.get(name))
        for text, vec in zip(texts, got, strict=True):
            e = tok.encode(text)
            h = _np_bert(w, cfg, e.ids, e.type_ids, "")
            v = h.mean(0) if pool == "mean" else h[0]
            np.testing.assert_allclose(vec, v / np.linalg.norm(v), atol=2e-5)


# -- reranking ---------------------------------------------------------------------------------


PARIS = [
    "Paris is the capital of France.",
    "Bananas are yellow.",
    "The stock market fell sharply today.",
]


def test_llm_reranker_on_smollm2_ranks_the_relevant_document_first(srv, http):
    r = http.post(
        "/v1/rerank", json={"query": "What is the capital of France?", "documents": PARIS}
    )  # default: the chat model
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == SMOL
    assert [x["index"] for x in body["results"]][0] == 0, body["results"]
    scores = {x["index"]: x["relevance_score"] for x in body["results"]}
    assert all(0.0 < s < 1.0 for s in scores.values())
    # Batched scoring equals scoring each document alone (right padding is exact).
    alone = http.post(
        "/v1/rerank",
        json={"model": SMOL, "query": "What is the capital of France?", "documents": [PARIS[2]]},
    ).json()
    assert abs(alone["results"][0]["relevance_score"] - scores[2]) < 1e-4
    # The chat model's weights are shared, not loaded again.
    assert [m["name"] for m in srv.health()["models"]].count(SMOL) == 1
    # Architectures without a plain LM head take the full forward: the same scores.
    assert srv.core(Scorers()).count == 1
    srv.fault("scorer_plain_head", value=False)
    try:
        full = http.post(
            "/v1/rerank",
            json={"model": SMOL, "query": "What is the capital of France?", "documents": PARIS},
        ).json()
    finally:
        srv.fault("scorer_plain_head", value=True)
    for x in full["results"]:
        assert abs(x["relevance_score"] - scores[x["index"]]) < 1e-4


def test_rerank_jina_shape(http):
    r = http.post(
        "/v1/rerank",
        json={
            "model": "tiny-ce",
            "query": "capital of france",
            "documents": [
                "paris is the capital of france.",
                {"text": "bananas are yellow."},
                "the cat sat on the mat.",
            ],
            "top_n": 2,
            "return_documents": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    res = body["results"]
    assert len(res) == 2 and body["model"] == "tiny-ce"
    assert res[0]["relevance_score"] >= res[1]["relevance_score"]
    assert all(set(x) == {"index", "relevance_score", "document"} for x in res)
    texts = ["paris is the capital of france.", "bananas are yellow.", "the cat sat on the mat."]
    assert all(x["document"] == {"text": texts[x["index"]]} for x in res)
    assert body["usage"]["total_tokens"] > 0
    full = http.post(
        "/v1/rerank", json={"model": "tiny-ce", "query": "capital of france", "documents": texts}
    ).json()["results"]
    assert [x["index"] for x in full][:2] == [x["index"] for x in res]
    assert sorted(x["index"] for x in full) == [0, 1, 2]


def test_rerank_cohere_shapes(http):
    docs = [
        {"title": "France", "body": "Paris is the capital."},
        {"title": "Fruit", "body": "Bananas are yellow."},
    ]
    r = http.post(
        "/rerank",
        json={
            "model": "tiny-ce",
            "query": "capital",
            "documents": docs,
            "rank_fields": ["title", "body"],
            "max_chunks_per_doc": 10,
            "return_documents": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] and body["meta"]["api_version"]["version"] == "1"
    assert {x["index"] for x in body["results"]} == {0, 1}
    assert all(x["document"] == docs[x["index"]] for x in body["results"])
    v2 = http.post(
        "/v2/rerank",
        json={
            "model": "tiny-ce",
            "query": "capital",
            "documents": ["Paris is the capital.", "Bananas."],
            "top_n": 1,
            "max_tokens_per_doc": 512,
        },
    )
    assert v2.status_code == 200
    b2 = v2.json()
    assert b2["meta"]["api_version"]["version"] == "2" and len(b2["results"]) == 1
    assert set(b2["results"][0]) == {"index", "relevance_score"}  # v2: no documents by default
    r = http.post(
        "/v1/rerank",
        json={"model": "tiny-ce", "query": "q", "documents": [{"title": "no text field"}]},
    )
    assert r.status_code == 400


def test_return_text_and_decision_threshold(http):
    body = {
        "model": "tiny-ce",
        "query": "capital",
        "documents": ["a", "b", "c"],
        "return_text": True,
    }
    res = http.post("/v1/rerank", json=body).json()["results"]
    cut = sorted(x["relevance_score"] for x in res)[1]
    res = http.post("/v1/rerank", json={**body, "decision_threshold": cut}).json()["results"]
    assert [x["text_output"] for x in res] == ["yes", "yes", "no"]
    assert (
        "text_output"
        not in http.post("/v1/rerank", json={**body, "return_text": False}).json()["results"][0]
    )


def test_cross_encoders_match_a_numpy_reference(http, srv):
    query = "what is the capital of france?"
    docs = ["paris is the capital of france.", "yes", "the train leaves from platform 9."]
    for name, prefix in (("tiny-ce", "bert."), ("tiny-xlmr-reranker", "roberta.")):
        res = http.post(
            "/v1/rerank", json={"model": name, "query": query, "documents": docs}
        ).json()["results"]
        got = {x["index"]: x["relevance_score"] for x in res}
        w, cfg, tok = _load_np(srv.runtime.models.store.get(name))
        for i, d in enumerate(docs):
            e = tok.encode(query, d)
            h = _np_bert(w, cfg, e.ids, e.type_ids, prefix)
            if prefix == "bert.":
                pooled = np.tanh(_lin(w, "bert.pooler.dense", h[0]))
                logit = _lin(w, "classifier", pooled)[0]
            else:
                logit = _lin(w, "classifier.out_proj", np.tanh(_lin(w, "classifier.dense", h[0])))[
                    0
                ]
            assert abs(got[i] - 1 / (1 + math.exp(-logit))) < 1e-4, (name, i)


def test_dedicated_llm_reranker_checkpoint_uses_the_qwen3_prompt(srv, http):
    """A causal LM stored as kind 'reranker' (Qwen3-Reranker's layout) loads its own copy."""
    import os

    from mlxd.store.pull import remove

    rt = srv.runtime
    store = rt.models.store
    src = store.get(SMOL)

    def link(out: Path) -> dict:  # the SmolLM2 files under a reranker's name, hard-linked
        for f in src.iterdir():
            if f.is_file() and f.name != "mlxd.json":
                os.link(f, out / f.name)
        return {"format": "mlx"}

    store.install("smol-reranker", link, kind="reranker", source=str(src))
    r = http.post(
        "/v1/rerank",
        json={
            "model": "smol-reranker",
            "query": "capital of France?",
            "documents": PARIS[:2],
            "return_text": True,
        },
    )
    assert r.status_code == 200, r.text
    assert all(0 < x["relevance_score"] < 1 for x in r.json()["results"])
    st = _model_status(srv, "smol-reranker")
    assert st["kind"] == "reranker" and st["max_batch_size_seen"] >= 1
    http.post("/unload", json={"model": "smol-reranker"})
    remove(store, "smol-reranker")


# -- token counting ---------------------------------------------------------------------------


def test_tokenize_counts_equal_the_tokenizers(srv, http):
    from tokenizers import Tokenizer

    texts = ["Hello, world!", "Tokenizers split text into pieces."]
    for name in (MINILM, SMOL, "tiny-ce"):
        r = http.post("/v1/tokenize", json={"model": name, "input": texts, "return_tokens": True})
        assert r.status_code == 200, r.text
        body = r.json()
        # read after the request: a packaged model enters the store on its first use
        tok = Tokenizer.from_file(str(srv.runtime.models.store.get(name) / "tokenizer.json"))
        tok.no_padding()
        tok.no_truncation()
        want = [tok.encode(t).ids for t in texts]
        assert [d["token_ids"] for d in body["data"]] == want, name
        # the documented shape of the embeddings server mlxd replaces: tokens is the count
        assert [d["tokens"] for d in body["data"]] == [len(x) for x in want]
        assert [d["index"] for d in body["data"]] == [0, 1]
        assert body["count"] == sum(map(len, want)) and body["context_length"] > 0
    one = http.post("/v1/tokenize", json={"input": "Hello, world!"}).json()  # default model
    assert one["model"] == SMOL and "token_ids" not in one["data"][0]
    assert one["data"][0]["tokens"] == one["count"] > 0
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = http.post("/v1/tokenize", json={"model": SMOL, "messages": msgs}).json()
    tok = Tokenizer.from_file(str(srv.runtime.models.store.get(SMOL) / "tokenizer.json"))
    from mlxd.text.processor import load_tokenizer

    chat_tok = load_tokenizer(srv.runtime.models.store.get(SMOL))
    templated = chat_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert r["data"][0]["tokens"] == len(templated) > len(tok.encode(msgs[0]["content"]).ids)
    assert http.post("/v1/tokenize", json={"model": MINILM, "messages": msgs}).status_code == 400


# -- Ollama ------------------------------------------------------------------------------------


def test_ollama_embed_shapes(srv, http):
    import ollama

    client = ollama.Client(host=srv.url)
    res = client.embed(model=MINILM, input=["The cat sat on the mat.", "Hello"])
    assert len(res.embeddings) == 2 and len(res.embeddings[0]) == 384
    assert res.prompt_eval_count > 0 and res.total_duration > 0 and res.load_duration >= 0
    ours = _embed(http, ["The cat sat on the mat.", "Hello"], model=MINILM)
    np.testing.assert_allclose(np.array(res.embeddings), ours, atol=1e-6)
    one = http.post("/api/embed", json={"model": MINILM, "input": "Hello"}).json()
    assert (
        set(one) >= {"model", "embeddings", "total_duration", "load_duration", "prompt_eval_count"}
        and len(one["embeddings"]) == 1
    )
    legacy = http.post("/api/embeddings", json={"model": MINILM, "prompt": "Hello"}).json()
    np.testing.assert_allclose(legacy["embedding"], ours[1], atol=1e-6)
    assert http.post("/api/embed", json={"model": MINILM}).json() == {
        "model": MINILM,
        "embeddings": [],
    }  # no input: load only, as Ollama does
    r = http.post("/api/embed", json={"model": "no-such-model", "input": "x"})
    assert r.status_code == 404 and set(r.json()) == {"error"}
    # `curl -d` (Ollama's and TEI's documented calls) sends no JSON content type
    form = {"content-type": "application/x-www-form-urlencoded"}
    for path in ("/api/embed", "/v1/embeddings"):
        r = http.post(path, content=json.dumps({"model": MINILM, "input": "Hello"}), headers=form)
        assert r.status_code == 200, r.text
    r = http.post("/api/embed", content=b"{not json", headers=form)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]


# -- interleaving with decode -----------------------------------------------------------------


def _stream_chat(srv, model: str, max_tokens: int, stop: threading.Event, times: list):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
    }
    with (
        httpx.Client(base_url=srv.url, timeout=120) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                times.append(time.perf_counter())
            if stop.is_set() or line == "data: [DONE]":
                return


def test_embeddings_interleave_with_a_running_chat_stream(srv):
    stop, times = threading.Event(), []
    t = threading.Thread(target=_stream_chat, args=(srv, "long-llama", 4000, stop, times))
    t.start()
    try:
        deadline = time.time() + 30
        while len(times) < 5 and time.time() < deadline:
            time.sleep(0.01)
        assert len(times) >= 5, "the chat stream did not start"
        texts = [f"Embedding request {i} about topic {i * 7 % 13}." for i in range(64)]

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                return await asyncio.gather(
                    *(
                        c.post("/v1/embeddings", json={"model": MINILM, "input": [x, x + "!"]})
                        for x in texts
                    )
                )

        t0 = time.perf_counter()
        rs = asyncio.run(burst())
        t1 = time.perf_counter()
        assert all(r.status_code == 200 for r in rs)
        assert t.is_alive(), "the stream ended before the embeddings did"
        during = [x for x in times if t0 <= x <= t1]
        assert len(during) >= 3, (len(during), t1 - t0)  # decode kept going
        # and was never starved for long: tokens came in both halves of the burst
        middle = (t0 + t1) / 2
        assert min(during) < middle < max(during), (during, t0, t1)
    finally:
        stop.set()
        t.join(30)


def test_llm_reranking_interleaves_with_the_same_models_decode(srv, http):
    stop, times = threading.Event(), []
    t = threading.Thread(target=_stream_chat, args=(srv, SMOL, 200, stop, times))
    t.start()
    try:
        deadline = time.time() + 30
        while len(times) < 3 and time.time() < deadline:
            time.sleep(0.01)
        n0 = len(times)
        r = http.post(
            "/v1/rerank",
            json={"model": SMOL, "query": "What is the capital of France?", "documents": PARIS},
        )
        assert r.status_code == 200 and r.json()["results"][0]["index"] == 0
        assert len(times) > n0 and t.is_alive()  # the stream advanced while scoring
    finally:
        stop.set()
        t.join(60)


# -- numpy reference encoders ------------------------------------------------------------------


def _load_np(path: Path):
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    w = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        w.update(load_file(str(f)))
    cfg = json.loads((Path(path) / "config.json").read_text())
    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return w, cfg, tok


def _lin(w: dict, name: str, x: np.ndarray) -> np.ndarray:
    return x @ w[name + ".weight"].T + w[name + ".bias"]


def _np_bert(w: dict, cfg: dict, ids: list[int], types: list[int], p: str) -> np.ndarray:
    """transformers' BertModel / XLMRobertaModel forward for one unpadded sequence."""
    eps = cfg["layer_norm_eps"]
    heads = cfg["num_attention_heads"]
    erf = np.vectorize(math.erf)

    def ln(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w[name + ".weight"] + w[name + ".bias"]

    n = len(ids)
    pos = np.arange(n) + (cfg["pad_token_id"] + 1 if cfg["model_type"] == "xlm-roberta" else 0)
    e = p + "embeddings."
    h = (
        w[e + "word_embeddings.weight"][ids]
        + w[e + "position_embeddings.weight"][pos]
        + w[e + "token_type_embeddings.weight"][types]
    )
    h = ln(h, e + "LayerNorm")
    for i in range(cfg["num_hidden_layers"]):
        L = f"{p}encoder.layer.{i}."

        def split(x):
            return x.reshape(n, heads, -1).transpose(1, 0, 2)

        q, k, v = (split(_lin(w, L + f"attention.self.{m}", h)) for m in ("query", "key", "value"))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        ctx = (a @ v).transpose(1, 0, 2).reshape(n, -1)
        h = ln(_lin(w, L + "attention.output.dense", ctx) + h, L + "attention.output.LayerNorm")
        f = _lin(w, L + "intermediate.dense", h)
        f = 0.5 * f * (1 + erf(f / math.sqrt(2)))
        h = ln(_lin(w, L + "output.dense", f) + h, L + "output.LayerNorm")
    return h
