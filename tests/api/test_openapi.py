"""/openapi.json tells what the server really does: validation errors are 400 (never 422),
errors in each dialect's shape, the streaming media types, request and 200 body schemas."""

from __future__ import annotations

import httpx
import pytest

BODY_ROUTES = [
    "/v1/embeddings",
    "/api/embed",
    "/api/embeddings",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/v1/tokenize",
    "/generate",
    "/v1/chat/completions",
    "/api/chat",
    "/v1/messages",
]
STREAMING = {
    "/v1/chat/completions": "text/event-stream",
    "/v1/completions": "text/event-stream",
    "/v1/messages": "text/event-stream",
    "/v1/responses": "text/event-stream",
    "/generate": "text/event-stream",
    "/api/generate": "application/x-ndjson",
    "/api/chat": "application/x-ndjson",
    "/api/pull": "application/x-ndjson",
    "/v1/audio/transcriptions": "text/event-stream",
}
OK_MODELS = {
    ("post", "/v1/chat/completions"): "ChatCompletion",
    ("post", "/v1/completions"): "Completion",
    ("get", "/v1/models"): "ModelList",
    ("get", "/v1/models/{model_id}"): "ModelCard",
    ("post", "/v1/embeddings"): "EmbeddingList",
    ("post", "/v1/rerank"): "RerankResponse",
    ("post", "/v1/tokenize"): "TokenizeResponse",
    ("post", "/generate"): "GenerateResponse",
    ("get", "/health"): "Health",
    ("post", "/api/generate"): "OllamaGenerate",
    ("post", "/api/chat"): "OllamaChat",
    ("post", "/api/embed"): "OllamaEmbed",
    ("post", "/v1/messages"): "AnthropicResponse",
}


@pytest.fixture(scope="module")
def spec(server) -> dict:
    r = httpx.get(server.url + "/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


def _ops(spec):
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            yield path, method, op


def _ref(content: dict) -> str:
    return content["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]


def test_no_422_anywhere(spec):
    for path, method, op in _ops(spec):
        assert "422" not in op["responses"], (method, path)
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def test_errors_are_documented_in_each_dialect(spec):
    for path, method, op in _ops(spec):
        if path == "/health":
            assert set(op["responses"]) == {"200", "503"}
            continue
        want = (
            "OllamaError"
            if path.startswith("/api/")
            else "AnthropicError"
            if path.startswith("/v1/messages")
            else "OpenAIError"
        )
        codes = {"401", "429", "503", "default"}
        if "requestBody" in op:
            codes |= {"400", "404", "413"}
        assert codes <= set(op["responses"]), (method, path, sorted(op["responses"]))
        for code in codes:
            assert _ref(op["responses"][code]["content"]) == want, (method, path, code)
    err = spec["components"]["schemas"]["OpenAIErrorBody"]
    assert set(err["properties"]) == {"message", "type", "param", "code"}


def test_the_documented_error_is_the_real_one(server, spec):
    documented = spec["components"]["schemas"]["OpenAIErrorBody"]["properties"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) == set(documented)
    r = httpx.post(server.url + "/api/chat", json={"model": 5}, timeout=30)
    assert r.status_code == 400
    assert set(r.json()) == set(spec["components"]["schemas"]["OllamaError"]["properties"])


def test_request_bodies_are_documented(spec):
    for path in BODY_ROUTES:
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["required"] is True, path
        assert "$ref" in body["content"]["application/json"]["schema"], path


def test_streaming_media_types(spec):
    for path, media in STREAMING.items():
        content = spec["paths"][path]["post"]["responses"]["200"]["content"]
        assert media in content and "application/json" in content, path


def test_200_bodies_have_schemas(spec):
    for (method, path), name in OK_MODELS.items():
        content = spec["paths"][path][method]["responses"]["200"]["content"]
        assert _ref(content) == name, (method, path)
    token_count = spec["components"]["schemas"]["TokenCount"]["properties"]
    assert token_count["tokens"]["type"] == "integer" and "token_ids" in token_count


def test_model_path_parameter(spec):
    assert not any(":" in p for p in spec["paths"])
    (param,) = spec["paths"]["/v1/models/{model_id}"]["get"]["parameters"]
    assert param["name"] == "model_id" and param["in"] == "path" and param["required"]
    assert param["schema"]["type"] == "string"


def test_head_health_is_200(server):
    r = httpx.head(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.content == b""
    assert r.headers["content-type"] == "application/json"
