"""Vision-language chat through HTTP: a tiny random-weight Qwen2-VL (real checkpoint layout,
tests/fixtures/tiny_vlm.py) pulled into the store from a local directory (kind detected from
config.json), served by mlx-vlm on the device worker, with real PNG/JPEG images."""

from __future__ import annotations

import base64
import http.server
import io
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import require, wait_until  # noqa: E402

require("mlx_vlm")  # the [vision] extra

from conftest import LiveServer, make_settings  # noqa: E402
from fixtures.tiny_vlm import make_tiny_qwen2_vl, make_tiny_vlm_adapter  # noqa: E402
from PIL import Image  # noqa: E402

VLM = "tiny-qwen2-vl"
CHAT = "/v1/chat/completions"


# -- images and requests ------------------------------------------------------------------------


def png(seed: int, size: tuple[int, int] = (64, 48), fmt: str = "PNG") -> bytes:
    """A real image: a colour gradient plus seeded noise, so different seeds differ."""
    w, h = size
    rng = np.random.RandomState(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack(
        [xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), np.full_like(xx, (seed * 53) % 256)],
        axis=-1,
    )
    arr = np.clip(base + rng.randint(-40, 40, size=(h, w, 3)), 0, 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(*parts: dict, text: str = "What is in the picture?", model: str = VLM, **extra) -> dict:
    return {
        "model": model,
        "max_tokens": 8,
        "temperature": 0,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        **extra,
    }


def metric(srv: LiveServer, name: str, model: str = VLM) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    m = re.search(rf'^{re.escape(name)}\{{model="{re.escape(model)}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def engine(srv: LiveServer, name: str = VLM) -> dict:
    """The engine core's view of the loaded model (as /health reports it)."""
    found = {m["name"]: m for m in srv.health()["models"]}
    assert name in found, f"{name} is not loaded"
    return found[name]


def encoder_runs(srv: LiveServer) -> int:
    return engine(srv)["vision_feature_cache"]["encoder_runs"]


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / VLM)


def _pull(models_dir: Path, src: Path) -> dict:
    from mlxd.config import ModelSettings
    from mlxd.store.local import ModelStore
    from mlxd.store.pull import pull

    return pull(ModelStore(models_dir), str(src), ModelSettings(dir=models_dir))


@pytest.fixture(scope="module")
def vsrv(tmp_path_factory, tiny_llama, vlm_dir):
    """Text default model + the vision model, pulled like `mlxd pull ./dir`, preloaded."""
    home = tmp_path_factory.mktemp("vhome")
    manifest = _pull(home / "models", vlm_dir)
    assert manifest["kind"] == "vision" and manifest["name"] == VLM
    s = make_settings(
        home, tiny_llama, models={"preload": [VLM]}, vision={"allow_remote_images": False}
    )
    srv = LiveServer(s).start()
    yield srv
    srv.stop()


def _private_server(tmp_path: Path, tiny_llama, vlm_dir, **sections) -> LiveServer:
    _pull(tmp_path / "models", vlm_dir)
    return LiveServer(make_settings(tmp_path, tiny_llama, **sections)).start()


@pytest.fixture()
def private(tmp_path, tiny_llama, vlm_dir):
    started = []

    def start(**sections) -> LiveServer:
        srv = _private_server(tmp_path, tiny_llama, vlm_dir, **sections)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


# -- chat ---------------------------------------------------------------------------------------


def test_vision_model_is_detected_loaded_and_listed(vsrv):
    models = {m["name"]: m for m in vsrv.health()["models"]}
    assert models[VLM]["kind"] == "vision" and models[VLM]["pinned"]
    show = httpx.post(vsrv.url + "/api/show", json={"model": VLM}, timeout=10).json()
    assert "vision" in show["capabilities"]


def test_chat_with_one_and_two_images(vsrv):
    a, b = data_url(png(1)), data_url(png(2, (40, 72)))
    with vsrv.client() as c:
        one = c.post(CHAT, json=ask(image_part(a))).json()
        two = c.post(CHAT, json=ask(image_part(a), image_part(b))).json()
        other = c.post(CHAT, json=ask(image_part(b))).json()
        none = c.post(CHAT, json=ask()).json()
    for r in (one, two, other, none):
        assert r["object"] == "chat.completion" and r["model"] == VLM
        assert r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] == 8
        assert r["choices"][0]["message"]["content"]
    # each image adds its (processor-expanded) image tokens to the prompt
    p = {
        k: r["usage"]["prompt_tokens"]
        for k, r in (("one", one), ("two", two), ("other", other), ("none", none))
    }
    assert p["none"] < p["one"] < p["two"] and p["other"] > p["none"]
    # the images reach the model: a different image, different greedy text
    texts = {r["choices"][0]["message"]["content"] for r in (one, two, other, none)}
    assert len(texts) >= 3


def test_streaming_matches_non_streaming_and_reports_usage(vsrv):
    body = ask(image_part(data_url(png(3))), max_tokens=10)
    with vsrv.client() as c:
        full = c.post(CHAT, json=body).json()
        chunks, usage = [], None
        with c.stream(
            "POST", CHAT, json={**body, "stream": True, "stream_options": {"include_usage": True}}
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev["choices"]:
                    chunks.append(ev["choices"][0]["delta"].get("content") or "")
                elif ev.get("usage"):
                    usage = ev["usage"]
    assert "".join(chunks) == full["choices"][0]["message"]["content"]
    assert usage == full["usage"]


def test_input_image_parts_and_raw_base64(vsrv):
    raw = base64.b64encode(png(4)).decode()
    with vsrv.client() as c:
        a = c.post(CHAT, json=ask({"type": "input_image", "image_url": data_url(png(4))}))
        b = c.post(CHAT, json=ask({"type": "image_url", "image_url": raw}))
        jpg = c.post(CHAT, json=ask(image_part(base64.b64encode(png(4, fmt="JPEG")).decode())))
    assert a.status_code == b.status_code == jpg.status_code == 200, (a.text, b.text, jpg.text)
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]


def test_resent_image_hits_the_feature_cache(vsrv):
    img = data_url(png(5, (56, 56)))
    hits, misses = (
        metric(vsrv, "mlxd:vision_feature_cache_hits_total"),
        metric(vsrv, "mlxd:vision_feature_cache_misses_total"),
    )
    runs = encoder_runs(vsrv)
    with vsrv.client() as c:
        first = c.post(CHAT, json=ask(image_part(img))).json()
        assert metric(vsrv, "mlxd:vision_feature_cache_misses_total") == misses + 1
        assert encoder_runs(vsrv) == runs + 1
        # a second turn of the same conversation resends the image
        turn2 = {
            "model": VLM,
            "max_tokens": 8,
            "temperature": 0,
            "messages": [
                {"role": "user", "content": [image_part(img), {"type": "text", "text": "What?"}]},
                {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And the colours?"},
            ],
        }
        assert c.post(CHAT, json=turn2).status_code == 200
        again = c.post(CHAT, json=ask(image_part(img))).json()
    assert metric(vsrv, "mlxd:vision_feature_cache_hits_total") == hits + 2
    assert metric(vsrv, "mlxd:vision_feature_cache_misses_total") == misses + 1
    assert encoder_runs(vsrv) == runs + 1  # the encoder did not run again
    assert again["choices"][0]["message"] == first["choices"][0]["message"]  # same features
    assert metric(vsrv, "mlxd:vision_feature_cache_bytes") > 0
    stats = {m["name"]: m for m in vsrv.health()["models"]}[VLM]["vision_feature_cache"]
    assert stats["mode"] == "per_image" and stats["entries"] >= 1
    assert stats["encoder_runs"] == runs + 1


def test_a_request_mixing_a_seen_and_a_new_image_encodes_only_the_new_one(vsrv):
    """Qwen2-VL's cache is per image (docs/vision.md): the seen image comes from the cache, the
    new one runs the encoder, in one request."""
    seen, new = data_url(png(70, (56, 56))), data_url(png(71, (64, 56)))
    with vsrv.client() as c:
        assert c.post(CHAT, json=ask(image_part(seen))).status_code == 200
        hits, misses = (
            metric(vsrv, "mlxd:vision_feature_cache_hits_total"),
            metric(vsrv, "mlxd:vision_feature_cache_misses_total"),
        )
        runs = encoder_runs(vsrv)
        mixed = c.post(CHAT, json=ask(image_part(seen), image_part(new)))
    assert mixed.status_code == 200, mixed.text
    assert metric(vsrv, "mlxd:vision_feature_cache_hits_total") == hits + 1
    assert metric(vsrv, "mlxd:vision_feature_cache_misses_total") == misses + 1
    assert encoder_runs(vsrv) == runs + 1


def test_stop_strings_and_client_disconnect(vsrv):
    img = image_part(data_url(png(12)))
    with vsrv.client() as c:
        full = c.post(CHAT, json=ask(img, max_tokens=16)).json()["choices"][0]
        text = full["message"]["content"]
        stop = text[5:8]
        cut = c.post(CHAT, json=ask(img, max_tokens=16, stop=[stop])).json()["choices"][0]
        assert cut["finish_reason"] == "stop"
        assert cut["message"]["content"] == text[: text.index(stop)]
        # a streaming client that goes away frees its batch slot
        with c.stream("POST", CHAT, json=ask(img, max_tokens=2000, stream=True)) as r:
            for line in r.iter_lines():
                if '"content"' in line:
                    break

    def busy() -> bool:
        eng = engine(vsrv)
        return eng["running"] + eng["waiting"] > 0

    deadline = time.time() + 10
    while busy() and time.time() < deadline:
        time.sleep(0.02)
    assert not busy()


def _tokens(r: dict) -> list[tuple[str, float]]:
    """(token, margin to the runner-up) per generated token."""
    return [
        (e["token"], e["top_logprobs"][0]["logprob"] - e["top_logprobs"][1]["logprob"])
        for e in r["choices"][0]["logprobs"]["content"]
    ]


def _same_until_a_tie(solo: list, batched: list) -> bool:
    """Greedy decoding batched equals decoding alone, up to the first near-tie (where a
    different batch shape may round the other way)."""
    for (a, margin), (b, _) in zip(solo, batched, strict=True):
        if margin < 1e-2:
            return True
        if a != b:
            return False
    return True


def test_concurrent_vision_and_text_requests_complete_batched(vsrv):
    imgs = [data_url(png(10 + i)) for i in range(4)]

    def vbody(i: int) -> dict:
        return ask(image_part(imgs[i]), max_tokens=24, logprobs=True, top_logprobs=2)

    with vsrv.client() as c:
        solo = [c.post(CHAT, json=vbody(i)).json() for i in range(4)]

        def vision(i: int) -> dict:
            return c.post(CHAT, json=vbody(i)).json()

        def text(i: int) -> dict:
            return c.post(
                CHAT, json={"messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 24}
            ).json()

        with ThreadPoolExecutor(8) as pool:
            vs = [pool.submit(vision, i) for i in range(4)]
            ts = [pool.submit(text, i) for i in range(4)]
            batched, texts = [f.result() for f in vs], [f.result() for f in ts]
    for r in batched + texts:
        assert r["choices"][0]["finish_reason"] == "length", r
        assert r["usage"]["completion_tokens"] == 24
    for a, b in zip(solo, batched, strict=True):
        assert _same_until_a_tie(_tokens(a), _tokens(b))
    eng = engine(vsrv)
    assert eng["vision_feature_cache"]["batching"] and eng["max_batch_size_seen"] >= 2


def test_seeded_sampling_and_logprobs(vsrv):
    body = ask(image_part(data_url(png(6))), temperature=1.0, seed=42, max_tokens=6)
    with vsrv.client() as c, ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda _: c.post(CHAT, json=body).json(), range(3)))
        lp = c.post(
            CHAT, json={**ask(image_part(data_url(png(6)))), "logprobs": True, "top_logprobs": 2}
        ).json()
    assert len({o["choices"][0]["message"]["content"] for o in outs}) == 1
    content = lp["choices"][0]["logprobs"]["content"]
    assert len(content) == 8 and all(
        e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 for e in content
    )
    assert content[0]["token"] == content[0]["top_logprobs"][0]["token"]  # greedy picks top


# -- errors ---------------------------------------------------------------------------------------


def _err(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_corrupt_and_refused_images_are_400_naming_the_part(vsrv):
    good = image_part(data_url(png(7)))
    with vsrv.client() as c:
        corrupt = _err(c.post(CHAT, json=ask(good, image_part(data_url(b"\x89PNG\r\n junk")))))
        truncated = _err(c.post(CHAT, json=ask(image_part(data_url(png(7)[:80])))))
        not_b64 = _err(c.post(CHAT, json=ask(image_part("data:image/png;base64,@@@@"))))
        path = _err(c.post(CHAT, json=ask(image_part("/etc/passwd"))))
        file_url = _err(c.post(CHAT, json=ask(image_part("file:///etc/passwd"))))
        remote = _err(c.post(CHAT, json=ask(image_part("http://127.0.0.1:9/x.png"))))
        missing = _err(c.post(CHAT, json=ask({"type": "image_url"})))
    assert corrupt["param"] == "messages[0].content[1]" and "decode" in corrupt["message"]
    assert truncated["param"] == "messages[0].content[0]"
    assert not_b64["param"] == "messages[0].content[0]"
    assert "local file paths" in path["message"]
    assert file_url["param"] == "messages[0].content[0]"
    assert "allow_remote_images" in remote["message"]
    assert missing["param"] == "messages[0].content[0]"
    # the server is fine afterwards
    with vsrv.client() as c:
        assert c.post(CHAT, json=ask(good)).status_code == 200


def test_images_to_a_text_model_are_400(vsrv):
    img = data_url(png(8))
    with vsrv.client() as c:
        err = _err(c.post(CHAT, json=ask(image_part(img), model="default")))
    assert "does not accept images" in err["message"] and err["param"] == "messages[0].content"
    r = httpx.post(
        vsrv.url + "/api/chat",
        json={
            "model": "default",
            "stream": False,
            "messages": [
                {"role": "user", "content": "x", "images": [base64.b64encode(png(8)).decode()]}
            ],
        },
        timeout=30,
    )
    assert r.status_code == 400 and "does not accept images" in r.json()["error"]


def test_too_many_images_is_400(private, tmp_path):
    srv = private(vision={"max_images_per_request": 2})
    parts = [image_part(data_url(png(i))) for i in range(3)]
    with srv.client() as c:
        err = _err(c.post(CHAT, json=ask(*parts)))
    assert "3 images" in err["message"]


# -- Ollama -------------------------------------------------------------------------------------


def test_ollama_chat_and_generate_with_images(vsrv):
    import ollama

    b64 = base64.b64encode(png(9)).decode()
    client = ollama.Client(host=vsrv.url)
    r = client.chat(
        model=VLM,
        messages=[{"role": "user", "content": "Describe it.", "images": [b64]}],
        options={"num_predict": 6, "temperature": 0},
    )
    assert r.message.content and r.eval_count == 6 and r.done_reason == "length"
    streamed = "".join(
        p.message.content
        for p in client.chat(
            model=VLM,
            messages=[{"role": "user", "content": "Describe it.", "images": [b64]}],
            options={"num_predict": 6, "temperature": 0},
            stream=True,
        )
    )
    assert streamed == r.message.content
    g = client.generate(
        model=VLM, prompt="Describe it.", images=[b64], options={"num_predict": 6, "temperature": 0}
    )
    assert g.response and g.prompt_eval_count > 20
    bad = httpx.post(
        vsrv.url + "/api/chat",
        json={"model": VLM, "messages": [{"role": "user", "content": "x", "images": ["bm9wZQ=="]}]},
        timeout=30,
    )
    assert bad.status_code == 400 and "messages[0].images[0]" in bad.json()["error"]


# -- remote images -------------------------------------------------------------------------------


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802 - the stdlib's name
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", "/img.png")
            self.end_headers()
            return
        if self.path == "/big.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(b"\x00" * 300_000)
            return
        self.send_response(200 if self.path == "/img.png" else 404)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def image_host():
    _ImageHandler.body = png(21)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_remote_images_when_allowed(private, image_host):
    srv = private(
        vision={
            "allow_remote_images": True,
            "allow_private_addresses": True,
            "max_image_bytes": 200_000,
        }
    )
    hits = metric(srv, "mlxd:vision_feature_cache_hits_total")  # one registry per process
    with srv.client() as c:
        remote = c.post(CHAT, json=ask(image_part(image_host + "/img.png")))
        redirected = c.post(CHAT, json=ask(image_part(image_host + "/redirect")))
        inline = c.post(CHAT, json=ask(image_part(data_url(png(21)))))
        missing = _err(c.post(CHAT, json=ask(image_part(image_host + "/nope.png"))))
        big = _err(c.post(CHAT, json=ask(image_part(image_host + "/big.png"))))
    assert remote.status_code == redirected.status_code == inline.status_code == 200
    # the same bytes: the same features (a cache hit) and the same text
    assert remote.json()["choices"][0]["message"] == inline.json()["choices"][0]["message"]
    assert metric(srv, "mlxd:vision_feature_cache_hits_total") == hits + 2
    assert "HTTP 404" in missing["message"]
    assert "larger than this server accepts" in big["message"]


def test_remote_images_from_private_addresses_are_refused(private, image_host):
    srv = private(vision={"allow_remote_images": True})
    with srv.client() as c:
        err = _err(c.post(CHAT, json=ask(image_part(image_host + "/img.png"))))
        err6 = _err(c.post(CHAT, json=ask(image_part("http://[::1]:9/x.png"))))
        local = _err(c.post(CHAT, json=ask(image_part("http://localhost:9/x.png"))))
    assert "non-public address (127.0.0.1)" in err["message"]
    assert err["param"] == "messages[0].content[0]"
    assert "non-public" in err6["message"] and "non-public" in local["message"]


# -- oversized images ---------------------------------------------------------------------------


def test_oversized_images_are_downscaled_or_refused(private):
    big = data_url(png(30, (400, 300)))
    resize = private(vision={"max_image_pixels": 100 * 75})
    with resize.client() as c:
        r = c.post(CHAT, json=ask(image_part(big)))
        jpg = c.post(
            CHAT, json=ask(image_part(data_url(png(30, (800, 600), "JPEG"), "image/jpeg")))
        )
    assert r.status_code == 200 and jpg.status_code == 200, (r.text, jpg.text)
    resize.stop()
    reject = private(vision={"max_image_pixels": 100 * 75, "oversize_images": "reject"})
    with reject.client() as c:
        err = _err(c.post(CHAT, json=ask(image_part(data_url(png(1))), image_part(big))))
    assert err["param"] == "messages[0].content[1]" and "400x300" in err["message"]


# -- engine modes and options -----------------------------------------------------------------


def test_sequential_mode_with_kv_options_lazy_load(private):
    """vision.batching off (and a bounded KV cache): one request at a time, each
    still completes; the vision model loads lazily on the first request."""
    srv = private(vision={"batching": False}, engine={"max_kv_size": 256})
    assert all(m["kind"] != "vision" for m in srv.health()["models"])
    imgs = [data_url(png(40 + i)) for i in range(3)]
    with srv.client() as c, ThreadPoolExecutor(3) as pool:
        rs = list(pool.map(lambda u: c.post(CHAT, json=ask(image_part(u))), imgs))
        text = c.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert all(r.status_code == 200 for r in rs) and text.status_code == 200
    eng = engine(srv)
    assert not eng["vision_feature_cache"]["batching"] and eng["max_batch_size_seen"] == 1


@pytest.mark.parametrize("batching", [True, False])
def test_a_better_priority_overtakes_queued_vision_requests(private, vlm_dir, batching):
    """One slot: while a priority-10 request runs and three more wait, a priority-0 one
    sent after them runs next (batched and one at a time alike); /health counts the
    waiting requests by priority."""
    srv = private(
        engine={"max_num_seqs": 1}, models={"preload": [VLM]}, vision={"batching": batching}
    )
    added = json.loads((vlm_dir / "tokenizer.json").read_text())["added_tokens"]
    ban = {str(t["id"]): -100.0 for t in added if t["content"] in ("<|im_end|>", "<|endoftext|>")}
    assert ban
    started: list[str] = []
    lock = threading.Lock()

    def low(i: int) -> None:
        body = ask(text=f"story {i}", max_tokens=300, priority=10, logit_bias=ban, stream=True)
        with httpx.stream("POST", srv.url + CHAT, json=body, timeout=600) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):  # a token, not the role
                    with lock:
                        if f"low-{i}" not in started:
                            started.append(f"low-{i}")

    threads = [threading.Thread(target=low, args=(i,), daemon=True) for i in range(4)]
    threads[0].start()
    assert wait_until(lambda: started == ["low-0"])
    for t in threads[1:]:
        t.start()
    assert wait_until(lambda: engine(srv)["queue"]["by_priority"] == {"10": 3})
    r = httpx.post(srv.url + CHAT, json=ask(max_tokens=4, priority=0), timeout=600)
    assert r.status_code == 200, r.text
    ahead = list(started)
    for t in threads:
        t.join(600)
    assert len(ahead) <= 2, ahead  # low-0, and at most the one that took the slot it left
    assert len(started) == 4
    assert engine(srv)["queue"] == {"by_priority": {}, "preemptions": 0}


def test_kv_options_per_model_and_adapter_on_the_default_model(
    private, vlm_dir, tmp_path, tmp_path_factory
):
    """models.options.<name> sets a quantized KV cache (still batched); a vision directory
    as the default model (`mlxd serve --model DIR --adapter A`) gets the LoRA adapter."""
    adapter = make_tiny_vlm_adapter(vlm_dir, tmp_path_factory.mktemp("adapter"))
    body = ask(image_part(data_url(png(50))))
    plain = private(models={"options": {VLM: {"kv_bits": 8, "kv_group_size": 32}}})
    with plain.client() as c:
        base = c.post(CHAT, json=body)
    eng = engine(plain)
    assert base.status_code == 200 and eng["vision_feature_cache"]["batching"]
    assert eng["options"]["kv_bits"] == 8
    plain.stop()
    adapted = LiveServer(
        make_settings(tmp_path / "a", vlm_dir, models={"adapter_path": str(adapter)})
    ).start()
    try:
        with adapted.client() as c:
            tuned = c.post(CHAT, json={**body, "model": "default"})
        assert tuned.status_code == 200, tuned.text
        assert tuned.json()["model"] == VLM and engine(adapted)["adapter_path"] is not None
        assert tuned.json()["choices"][0]["message"] != base.json()["choices"][0]["message"]
    finally:
        adapted.stop()


def test_fractional_kv_bits_are_turboquant_and_stay_batched(private):
    """models.options.<name>.kv_bits 3.5 (mlx-vlm's TurboQuant, the scheme taken from the
    fractional bits) and an explicit kv_quant_scheme turboquant at whole bits: concurrent
    image and text requests all complete, still in one batch."""
    for opts in ({"kv_bits": 3.5}, {"kv_bits": 4, "kv_quant_scheme": "turboquant"}):
        srv = private(models={"options": {VLM: opts}})
        bodies = [ask(image_part(data_url(png(60 + i)))) for i in range(2)] + [
            {"model": VLM, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
        ]
        with srv.client() as c, ThreadPoolExecutor(3) as pool:
            rs = list(pool.map(lambda b: c.post(CHAT, json=b), bodies))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        assert all(r.json()["usage"]["completion_tokens"] > 0 for r in rs)
        eng = engine(srv)
        assert eng["vision_feature_cache"]["batching"]
        assert eng["options"]["kv_bits"] == opts["kv_bits"]
        srv.stop()


@pytest.mark.parametrize(
    "flags, key, says",
    [
        (
            ["--kv-bits", "3.5", "--kv-quant-scheme", "uniform"],
            "engine.kv_bits",
            "fractional bits need kv_quant_scheme turboquant",
        ),
        (
            ["--kv-bits", "3.3", "--kv-quant-scheme", "turboquant"],
            "engine.kv_bits",
            "whole or half bits",
        ),
        (["--kv-bits", "7"], "engine.kv_bits", "2, 3, 4, 5, 6, 8 bits only"),
        (["--kv-bits", "4", "--max-kv-size", "512"], "engine.kv_bits", "rotating"),
        (["--kv-quant-scheme", "affine"], "kv_quant_scheme", "'uniform' or 'turboquant'"),
    ],
)
def test_kv_combinations_the_library_refuses_stop_the_start(
    monkeypatch, tmp_path, flags, key, says
):
    """A KV combination mlx-vlm would refuse (or quietly not apply) is a configuration
    error at `mlxd serve`, naming the key, before any model loads."""
    from typer.testing import CliRunner

    from mlxd.cli.main import app

    monkeypatch.setenv("MLXD_HOME", str(tmp_path))
    monkeypatch.setattr("mlxd.server.run", lambda s: pytest.fail("the server started"))
    r = CliRunner().invoke(app, ["serve", "--model", "m", *flags])
    assert r.exit_code == 2, r.output
    assert key in r.output and says in r.output, r.output


def test_kv_combination_per_model_is_checked_over_the_engine_defaults(tmp_path):
    from mlxd.config import ConfigError, load_settings

    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        f"engine: {{max_kv_size: 1024}}\nmodels: {{options: {{{VLM}: {{kv_bits: 8}}}}}}\n"
    )
    with pytest.raises(ConfigError, match=rf"models\.options\.{VLM}\.kv_bits: .*rotating"):
        load_settings(cfg)


def test_serve_flags_reach_the_settings(monkeypatch, tmp_path):
    import typer.main

    from mlxd.cli.main import app

    seen = {}
    monkeypatch.setenv("MLXD_HOME", str(tmp_path))
    monkeypatch.setattr("mlxd.server.run", lambda s: seen.setdefault("s", s) and 0)
    cmd = typer.main.get_command(app)
    with pytest.raises(SystemExit):
        cmd.main(
            [
                "serve",
                "--model",
                "m",
                "--adapter",
                str(tmp_path),
                "--trust-remote-code",
                "--kv-bits",
                "3.5",
                "--kv-quant-scheme",
                "turboquant",
                "--kv-group-size",
                "32",
            ],
            standalone_mode=True,
        )
    s = seen["s"]
    assert s.models.adapter_path == tmp_path and s.models.trust_remote_code
    assert (s.engine.kv_bits, s.engine.kv_quant_scheme, s.engine.kv_group_size) == (
        3.5,
        "turboquant",
        32,
    )
    seen.clear()
    with pytest.raises(SystemExit):
        cmd.main(["serve", "--model", "m", "--max-kv-size", "1024"], standalone_mode=True)
    assert seen["s"].engine.max_kv_size == 1024
