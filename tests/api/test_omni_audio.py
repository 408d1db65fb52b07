"""Audio content parts in chat (``input_audio``) on an omni model mlx-vlm serves: a tiny
random-weight Gemma 4 with its audio tower (real processor and loading code,
tests/fixtures/tiny_omni.py) pulled into the store and served on the device worker.

Gemma 4's processor turns a clip into ceil(ms / 40) audio soft tokens, so the prompt's
token count tells how much audio reached the model; the logprobs tell that the audio
encoder's output reached the language model (two clips of one length, two answers).
"""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import require  # noqa: E402

av = require("av")  # the [audio] extra decodes uploads
require("mlx_vlm")  # the [vision] extra serves the model

import openai  # noqa: E402
from conftest import LiveServer, make_settings  # noqa: E402
from fixtures.tiny_omni import AUDIO_MS_PER_TOKEN, make_tiny_gemma4_audio  # noqa: E402
from fixtures.tiny_vlm import make_tiny_qwen2_vl  # noqa: E402

OMNI = "tiny-gemma4-audio"
VLM = "tiny-qwen2-vl"
CHAT = "/v1/chat/completions"


def clip(
    seconds: float,
    *,
    rate: int = 16000,
    hz: float = 440.0,
    seed: int = 0,
    fmt: str = "wav",
    codec: str = "pcm_s16le",
) -> str:
    """A tone with a little noise, encoded (wav or mp3) and base64'd as input_audio wants."""
    import io

    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * hz * t) + 0.02 * np.random.RandomState(seed).randn(t.size)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate, layout="mono")
        f = av.AudioFrame.from_ndarray(x[None, :].astype(np.float32), format="fltp", layout="mono")
        f.sample_rate = rate
        for p in s.encode(f):
            c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return base64.b64encode(buf.getvalue()).decode()


def audio_part(data: str, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def ask(part: dict, model: str = OMNI, **extra) -> dict:
    return {
        "model": model,
        "max_tokens": 4,
        "temperature": 0,
        "messages": [
            {"role": "user", "content": [part, {"type": "text", "text": "What is said?"}]}
        ],
        **extra,
    }


def _pull(models_dir: Path, src: Path) -> dict:
    from mlxd.config import ModelSettings
    from mlxd.store.local import ModelStore
    from mlxd.store.pull import pull

    return pull(ModelStore(models_dir), str(src), ModelSettings(dir=models_dir))


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> Path:
    return make_tiny_gemma4_audio(tmp_path_factory.mktemp("omni") / OMNI)


@pytest.fixture(scope="module")
def osrv(tmp_path_factory, tiny_llama, omni_dir):
    base = tmp_path_factory.mktemp("omnisrv")
    home = base / "home"
    manifests = [
        _pull(home / "models", omni_dir),
        _pull(home / "models", make_tiny_qwen2_vl(base / VLM)),
    ]
    assert {m["name"]: m["kind"] for m in manifests} == {OMNI: "vision", VLM: "vision"}
    s = make_settings(
        home,
        tiny_llama,
        models={"preload": [OMNI], "max_vision_models": 2},
        audio={"max_upload_bytes": 64 * 1024, "max_duration_s": 3, "max_clips_per_request": 2},
    )
    srv = LiveServer(s).start()
    yield srv
    srv.stop()


@pytest.fixture()
def oai(osrv) -> openai.OpenAI:
    return openai.OpenAI(base_url=osrv.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and body["error"]["message"], body
    return body["error"]


def test_input_audio_reaches_the_model_through_the_openai_client(oai):
    def chat(data: str, fmt: str = "wav"):
        return oai.chat.completions.create(
            model=OMNI,
            max_tokens=4,
            temperature=0,
            logprobs=True,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is said?"},
                        {"type": "input_audio", "input_audio": {"data": data, "format": fmt}},
                    ],
                }
            ],
        )

    short, long = chat(clip(0.5)), chat(clip(1.0))
    for r in (short, long):
        assert r.choices[0].message.content
        assert r.usage.completion_tokens == 4
    # ceil(500 / 40) = 13 and ceil(1000 / 40) = 25 audio soft tokens
    grown = long.usage.prompt_tokens - short.usage.prompt_tokens
    assert grown == 1000 // AUDIO_MS_PER_TOKEN - -(-500 // AUDIO_MS_PER_TOKEN) == 12
    # the encoder's output is in the prompt: another clip of one length, other logprobs
    other = chat(clip(1.0, hz=1500.0, seed=3))
    assert other.usage.prompt_tokens == long.usage.prompt_tokens
    first = [c.logprob for c in long.choices[0].logprobs.content]
    assert first != [c.logprob for c in other.choices[0].logprobs.content]
    # the same clip again: the same answer (greedy)
    again = chat(clip(1.0))
    assert [c.logprob for c in again.choices[0].logprobs.content] == pytest.approx(first)
    # mp3, resampled from 44.1 kHz to the model's 16 kHz
    mp3 = chat(clip(1.0, rate=44100, fmt="mp3", codec="mp3"), "mp3")
    assert mp3.choices[0].message.content
    assert abs(mp3.usage.prompt_tokens - long.usage.prompt_tokens) <= 2  # encoder padding


def _logprobs(r: dict) -> list[float]:
    return [t["logprob"] for t in r["choices"][0]["logprobs"]["content"]]


def _batch_seen(osrv) -> int:
    return next(m for m in osrv.health()["models"] if m["name"] == OMNI)["max_batch_size_seen"]


def _fresh_engine(osrv) -> None:
    """Unload the omni model: the next request loads a new engine, whose largest batch so
    far is then this test's own."""
    with osrv.client() as c:
        assert c.post("/unload", json={"model": OMNI}).status_code == 200


def _post_all(osrv, bodies: list[dict]) -> tuple[list[dict], list[dict], int]:
    """Each body alone (one at a time), then all at once: (solo, together, the largest
    batch of the concurrent run)."""
    _fresh_engine(osrv)
    with httpx.Client(base_url=osrv.url, timeout=120) as c:

        def post(body: dict) -> dict:
            r = c.post(CHAT, json=body)
            assert r.status_code == 200, r.text
            return r.json()

        solo = [post(b) for b in bodies]
        assert _batch_seen(osrv) == 1
        # slow steps keep the first arrival decoding while the others' media are prepared,
        # however fast this machine decodes
        osrv.fault("slow_steps", model=OMNI, seconds=0.1)
        try:
            with ThreadPoolExecutor(len(bodies)) as pool:
                together = list(pool.map(post, bodies))
        finally:
            osrv.fault("slow_steps", model=OMNI, seconds=0)
    return solo, together, _batch_seen(osrv)


def test_concurrent_audio_requests_share_the_batch(osrv):
    """Clips of different lengths decode in one batch, each as it does alone."""
    bodies = [
        ask(audio_part(clip(0.5 + 0.1 * i, seed=i)), max_tokens=16, logprobs=True) for i in range(4)
    ]
    solo, batched, seen = _post_all(osrv, bodies)
    assert seen >= 2
    sizes = [r["usage"]["prompt_tokens"] for r in batched]
    assert sizes == sorted(sizes) and len(set(sizes)) == 4
    for a, b in zip(solo, batched, strict=True):
        assert b["choices"][0]["message"]["content"]
        assert b["usage"] == a["usage"]
        assert _logprobs(b) == pytest.approx(_logprobs(a), abs=1e-3)


def png_url(seed: int = 0) -> str:
    """A 32x32 PNG with seeded noise, as a data URL."""
    import io

    from PIL import Image

    arr = np.random.RandomState(seed).randint(0, 255, (32, 32, 3)).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_an_image_request_and_an_audio_request_share_one_batch(osrv):
    """Gemma 4 takes both: an image request and an audio request decode together, each
    as it does alone."""
    image = ask(
        {"type": "image_url", "image_url": {"url": png_url()}}, max_tokens=24, logprobs=True
    )
    audio = ask(audio_part(clip(0.5)), max_tokens=24, logprobs=True)
    solo, batched, seen = _post_all(osrv, [image, audio])
    assert seen == 2
    assert solo[0]["usage"]["prompt_tokens"] != solo[1]["usage"]["prompt_tokens"]
    for a, b in zip(solo, batched, strict=True):
        assert b["usage"] == a["usage"]
        assert _logprobs(b) == pytest.approx(_logprobs(a), abs=1e-3)


def test_several_clips_in_one_request_and_the_clip_limit(osrv):
    """Gemma 4's processor takes several clips per request (each expanded on its own);
    more than audio.max_clips_per_request (2 here) is a 400 naming the first one over."""

    def prompt_tokens(*parts: dict) -> int:
        with osrv.client() as c:
            r = c.post(
                CHAT,
                json={
                    "model": OMNI,
                    "max_tokens": 1,
                    "messages": [
                        {"role": "user", "content": [*parts, {"type": "text", "text": "Hi"}]}
                    ],
                },
            )
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    short, long = audio_part(clip(0.5)), audio_part(clip(1.0, seed=1))
    none = prompt_tokens()
    both = prompt_tokens(short, long)
    assert both - none == (prompt_tokens(short) - none) + (prompt_tokens(long) - none)
    with osrv.client() as c:
        r = c.post(
            CHAT,
            json={
                "model": OMNI,
                "max_tokens": 1,
                "messages": [
                    {
                        "role": "user",
                        "content": [short, long, short, {"type": "text", "text": "Hi"}],
                    }
                ],
            },
        )
    err = _err(r, 400)
    assert err["param"] == "messages[0].content[2]" and "max_clips_per_request" in err["message"], (
        err
    )


def test_sequential_mode_takes_audio_too(tmp_path, tiny_llama, omni_dir):
    """vision.batching off: the one-at-a-time path gets the audio features as well."""
    _pull(tmp_path / "models", omni_dir)
    srv = LiveServer(make_settings(tmp_path, tiny_llama, vision={"batching": False})).start()
    try:
        with srv.client() as c:
            rs = [c.post(CHAT, json=ask(audio_part(clip(s)), logprobs=True)) for s in (0.5, 1)]
    finally:
        srv.stop()
    assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
    short, long = (r.json() for r in rs)
    assert long["usage"]["prompt_tokens"] - short["usage"]["prompt_tokens"] == 12
    assert all(r["choices"][0]["message"]["content"] for r in (short, long))


def test_broken_audio_is_400_and_too_much_is_413(osrv):
    with osrv.client() as c:
        for data in (base64.b64encode(b"not audio at all" * 8).decode(), "@@@ not base64"):
            err = _err(c.post(CHAT, json=ask(audio_part(data))), 400)
            assert err["param"] == "messages[0].content[0]"
        r = c.post(CHAT, json=ask({"type": "input_audio", "input_audio": {"format": "wav"}}))
        assert _err(r, 400)["param"] == "messages[0].content[0]"
        r = c.post(CHAT, json=ask({"type": "audio_url", "audio_url": {"url": "http://x/a"}}))
        assert "input_audio" in _err(r, 400)["message"]
        # 4 s at 16 kHz: 128 kB of wav, more than max_upload_bytes (64 kB)
        err = _err(c.post(CHAT, json=ask(audio_part(clip(4.0)))), 413)
        assert "max_upload_bytes" in err["message"]
        # 5 s of 8 kHz mp3 is small but longer than max_duration_s (3 s)
        small = clip(5.0, rate=8000, fmt="mp3", codec="mp3")
        err = _err(c.post(CHAT, json=ask(audio_part(small, "mp3"))), 413)
        assert "max_duration_s" in err["message"]


def test_models_without_an_audio_encoder_refuse_audio(osrv):
    with osrv.client() as c:
        for model in (VLM, "tiny-llama"):
            err = _err(c.post(CHAT, json=ask(audio_part(clip(0.5)), model=model)), 400)
            assert "does not accept audio" in err["message"], (model, err)
            assert err["param"] == "messages[0].content"
