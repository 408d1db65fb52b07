"""/v1/tokenize answers the documented shape of the embeddings server it replaces:
``{"index": i, "tokens": <count>}``, the ids under ``token_ids`` only when asked for."""

from __future__ import annotations


def test_tokens_is_the_count(server):
    with server.client() as c:
        r = c.post("/v1/tokenize", json={"model": "tiny-llama", "input": ["hello world", "hi"]})
        assert r.status_code == 200, r.text
        body = r.json()
        counts = [d["tokens"] for d in body["data"]]
        assert [set(d) for d in body["data"]] == [{"index", "tokens"}] * 2
        assert [d["index"] for d in body["data"]] == [0, 1]
        assert all(isinstance(n, int) and n > 0 for n in counts)
        assert body["count"] == sum(counts) == body["usage"]["prompt_tokens"]

        r = c.post(
            "/v1/tokenize",
            json={"model": "tiny-llama", "input": ["hello world", "hi"], "return_tokens": True},
        )
        data = r.json()["data"]
    assert [d["tokens"] for d in data] == counts
    assert [len(d["token_ids"]) for d in data] == counts
    assert all(isinstance(t, int) for d in data for t in d["token_ids"])
