"""Speech to text and text to speech through HTTP, with the official OpenAI client.

A tiny random-weight multilingual Whisper and a tiny Soprano TTS (real checkpoint layouts,
tests/fixtures/tiny_audio.py) are pulled into the store from local directories (kinds
detected from their files) and served by mlx-audio on the device worker. Random weights
write garbage text and noise, so the tests check shapes, formats, timestamps, durations
and errors, never words.
"""

from __future__ import annotations

import io
import sys
import threading
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import require  # noqa: E402

av = require("av")  # the [audio] extra
require("mlx_audio")

import openai  # noqa: E402
from conftest import LiveServer, make_settings  # noqa: E402
from fixtures.tiny_audio import make_tiny_soprano, make_tiny_whisper  # noqa: E402

STT = "tiny-whisper"
TTS = "tiny-soprano"
TTS_TOKENS = 6  # tokens per sentence: random weights never say [STOP]
SOPRANO_TOKEN_SAMPLES = 2048


# -- audio files ---------------------------------------------------------------------------


def tone(seconds: float, rate: int = 16000, channels: int = 1, seed: int = 0) -> np.ndarray:
    """A 440 Hz tone with a little noise, (channels, samples) float32."""
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.01 * np.random.RandomState(seed).randn(t.size)
    return np.repeat(x[None, :], channels, axis=0).astype(np.float32)


def encode(
    samples: np.ndarray,
    rate: int,
    fmt: str = "wav",
    codec: str = "pcm_s16le",
    bit_rate: int | None = None,
) -> bytes:
    buf = io.BytesIO()
    layout = "mono" if samples.shape[0] == 1 else "stereo"
    with av.open(buf, mode="w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate, layout=layout)
        if bit_rate:
            s.bit_rate = bit_rate
        f = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="fltp", layout=layout)
        f.sample_rate = rate
        for p in s.encode(f):
            c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


def wav(seconds: float, rate: int = 16000, channels: int = 1) -> bytes:
    return encode(tone(seconds, rate, channels), rate)


def video_only() -> bytes:
    """An mp4 holding three 16x16 video frames and no audio stream."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=10)
        s.width, s.height, s.pix_fmt = 16, 16, "yuv420p"
        for i in range(3):
            frame = av.VideoFrame.from_ndarray(
                np.full((16, 16, 3), 40 * i, np.uint8), format="rgb24"
            )
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


def decode(data: bytes) -> tuple[np.ndarray, int]:
    with av.open(io.BytesIO(data)) as c:
        st = c.streams.audio[0]
        rate = st.rate
        parts = [f.to_ndarray().reshape(-1) for f in c.decode(st)]
    return np.concatenate(parts), rate


# -- the server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def audio_dirs(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("audio")
    return make_tiny_whisper(base / STT), make_tiny_soprano(base / TTS)


def _pull(models_dir: Path, src: Path) -> dict:
    from mlxd.config import ModelSettings
    from mlxd.store.local import ModelStore
    from mlxd.store.pull import pull

    return pull(ModelStore(models_dir), str(src), ModelSettings(dir=models_dir))


@pytest.fixture(scope="module")
def asrv(tmp_path_factory, tiny_llama, audio_dirs) -> LiveServer:
    home = tmp_path_factory.mktemp("ahome")
    kinds = {m["name"]: m["kind"] for m in (_pull(home / "models", d) for d in audio_dirs)}
    assert kinds == {STT: "stt", TTS: "tts"}
    s = make_settings(
        home,
        tiny_llama,
        models={"preload": [STT, TTS]},
        audio={
            "default_stt": STT,
            "default_tts": TTS,
            "max_tokens_per_window": 12,
            "tts_max_tokens": TTS_TOKENS,
            "max_upload_bytes": 2 * 1024 * 1024,
            "max_duration_s": 120,
            "max_wait_ms": 50,
            "tts_segment_chars": 40,
        },
    )
    srv = LiveServer(s).start()
    yield srv
    srv.stop()


@pytest.fixture()
def oai(asrv) -> openai.OpenAI:
    return openai.OpenAI(base_url=asrv.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and body["error"]["message"], body
    return body["error"]


def engine(srv: LiveServer, name: str) -> dict:
    return next(m for m in srv.health()["models"] if m["name"] == name)


def metric(srv: LiveServer, prefix: str, **labels: str) -> float:
    """One sample of /metrics (0 when absent: a counter not yet incremented)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(prefix) and all(w in line for w in want):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def whisper_passes(srv: LiveServer) -> tuple[float, float]:
    """(forward passes, windows) the Whisper engine has run: its encoder batch histogram."""
    return (
        metric(srv, "mlxd:embed_batch_size_count", model=STT),
        metric(srv, "mlxd:embed_batch_size_sum", model=STT),
    )


def segments(v) -> list[dict]:
    return [s.model_dump() for s in v.segments]


def decoded(s: dict) -> tuple:
    """What a segment's decoding chose: its place, tokens and text."""
    return s["seek"], s["start"], s["end"], s["text"], s["tokens"]


# -- models --------------------------------------------------------------------------------


def test_audio_models_are_detected_loaded_and_listed(asrv):
    with asrv.client() as c:
        ids = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        tags = {m["name"]: m for m in c.get("/api/tags").json()["models"]}
    assert STT in ids and TTS in ids
    assert any(n.startswith(STT) for n in tags) and any(n.startswith(TTS) for n in tags)
    assert engine(asrv, STT)["kind"] == "stt" and engine(asrv, TTS)["kind"] == "tts"


# -- transcription ---------------------------------------------------------------------------


def test_transcription_json_and_verbose_json_with_the_openai_client(oai):
    r = oai.audio.transcriptions.create(model=STT, file=("a.wav", wav(3.0)))
    assert isinstance(r.text, str)
    v = oai.audio.transcriptions.create(
        model=STT,
        file=("a.wav", wav(3.0)),
        response_format="verbose_json",
        timestamp_granularities=["segment"],
        language="de",
    )
    assert v.language == "german" and abs(v.duration - 3.0) < 0.05
    assert v.segments, v
    for s in v.segments:
        assert 0.0 <= s.start <= s.end <= 3.0 + 1e-6
        assert isinstance(s.text, str) and s.tokens
    assert [s.id for s in v.segments] == list(range(len(v.segments)))
    assert v.text == "".join(s.text for s in v.segments).strip()


def test_word_timestamps(oai):
    v = oai.audio.transcriptions.create(
        model=STT,
        file=("a.wav", wav(35.0, rate=8000)),
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )
    assert v.words and v.segments
    for w in v.words:
        assert 0.0 <= w.start <= w.end <= 35.0 + 1e-6 and isinstance(w.word, str)
    assert [w.start for w in v.words] == sorted(w.start for w in v.words)
    assert any(w.start >= 30.0 for w in v.words)  # the second window's, on the file's clock
    only = oai.audio.transcriptions.create(
        model=STT,
        file=("a.wav", wav(2.0)),
        response_format="verbose_json",
        timestamp_granularities=["word"],
    )
    assert only.words and not only.segments


def test_text_srt_and_vtt_renderings(oai):
    """Greedy decoding: every rendering of one file carries the same transcript."""
    data = wav(2.0)
    j = oai.audio.transcriptions.create(model=STT, file=("a.wav", data))
    v = oai.audio.transcriptions.create(
        model=STT, file=("a.wav", data), response_format="verbose_json"
    )
    assert j.text and j.text == v.text
    text = oai.audio.transcriptions.create(
        model="whisper-1", file=("a.wav", data), response_format="text"
    )
    assert text == j.text + "\n"  # as OpenAI's: the text and a newline
    srt = oai.audio.transcriptions.create(model=STT, file=("a.wav", data), response_format="srt")
    cues = [c.split("\n") for c in srt.strip("\n").split("\n\n")]
    assert [c[0] for c in cues] == [str(i) for i in range(1, len(v.segments) + 1)]
    assert [c[2] for c in cues] == [s.text.strip() for s in v.segments]
    assert cues[0][1].startswith("00:00:0") and " --> 00:00:0" in cues[0][1]
    vtt = oai.audio.transcriptions.create(model=STT, file=("a.wav", data), response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:0") and " --> " in vtt
    assert vtt.strip("\n").split("\n\n")[1:] == [f"{c[1].replace(',', '.')}\n{c[2]}" for c in cues]


def test_long_audio_is_cut_into_30s_windows_decoded_in_one_batch(asrv, oai):
    before = engine(asrv, STT).get("windows_done", 0)
    v = oai.audio.transcriptions.create(
        model=STT, file=("long.wav", wav(65.0, rate=8000)), response_format="verbose_json"
    )
    assert abs(v.duration - 65.0) < 0.05
    seeks = sorted({s.seek for s in v.segments})
    assert seeks == [0, 3000, 6000], seeks  # three windows, on the file's clock
    assert all(
        s.seek / 100 <= s.start <= s.end <= min(s.seek / 100 + 30, 65.0) + 1e-6 for s in v.segments
    )
    e = engine(asrv, STT)
    assert e["windows_done"] - before == 3
    assert e["max_batch_size_seen"] >= 3


def test_long_files_are_cut_at_a_pause_and_windows_decode_independently(oai):
    """What happens at a window boundary (docs/audio.md): a 0.1 s silence at 27.0 s is the
    quietest stretch of the first window's last 5 s, so the cut is in its middle (27.05
    s); each window is decoded on its own, without the text before it, so each side's
    segments are exactly those of that stretch sent as a file of its own."""
    rate = 16000  # no resampling: the silence stays exactly zero
    cut = int(27.05 * rate)
    x = np.concatenate(
        [tone(27.0, rate), np.zeros((1, rate // 10), np.float32), tone(12.9, rate, seed=1)], axis=1
    )

    def verbose(samples: np.ndarray):
        return oai.audio.transcriptions.create(
            model=STT, file=("a.wav", encode(samples, rate)), response_format="verbose_json"
        )

    full, head, tail = verbose(x), verbose(x[:, :cut]), verbose(x[:, cut:])
    assert sorted({s.seek for s in full.segments}) == [0, 2705]
    first = [s for s in segments(full) if s["seek"] == 0]
    second = [s for s in segments(full) if s["seek"] == 2705]
    assert first and second
    assert all(s["end"] <= 27.05 for s in first) and all(s["start"] >= 27.05 for s in second)

    def own(s: dict, shift: float = 0.0) -> tuple:
        return s["text"], s["tokens"], round(s["start"] - shift, 2), round(s["end"] - shift, 2)

    assert [own(s) for s in first] == [own(s) for s in segments(head)]
    assert [own(s, 27.05) for s in second] == [own(s) for s in segments(tail)]


def test_concurrent_transcriptions_share_batches(asrv, oai):
    """Four requests at once: their windows ride in fewer passes than windows (the
    encoder batch histogram's own change, whatever ran before), and each transcript is
    the one its file gets alone (greedy)."""
    files = [encode(tone(1.0 + i * 0.5, seed=i), 16000) for i in range(4)]

    def one(i: int):
        return oai.audio.transcriptions.create(
            model=STT, file=(f"{i}.wav", files[i]), response_format="verbose_json"
        )

    alone = [one(i) for i in range(4)]
    passes, windows = whisper_passes(asrv)
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(one, range(4)))
    passes_after, windows_after = whisper_passes(asrv)
    assert windows_after - windows == 4
    assert passes_after - passes < 4  # at least one pass decoded two requests' windows
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert abs(b.duration - (1.0 + i * 0.5)) < 0.05
        assert b.text == a.text and [decoded(x) for x in segments(b)] == [
            decoded(x) for x in segments(a)
        ]
        # the probabilities, from batched matmuls, agree to float32 rounding
        assert [x["no_speech_prob"] for x in segments(b)] == pytest.approx(
            [x["no_speech_prob"] for x in segments(a)], rel=1e-4
        )


def test_mp3_flac_ogg_stereo_and_other_rates_are_decoded_and_resampled(oai):
    stereo = tone(2.0, rate=44100, channels=2)
    for name, data in (
        ("a.mp3", encode(stereo, 44100, "mp3", "libmp3lame")),
        ("a.flac", encode(stereo, 44100, "flac", "flac")),
        ("a.ogg", encode(tone(2.0, 48000), 48000, "ogg", "libopus")),
    ):
        v = oai.audio.transcriptions.create(
            model=STT, file=(name, data), response_format="verbose_json"
        )
        assert abs(v.duration - 2.0) < 0.1, (name, v.duration)


def test_streaming_transcription_sends_a_delta_per_window_then_done(oai):
    """A delta is a window's whole text: one for a file under 30 s, two for 40 s."""
    for seconds, deltas in ((2.0, 1), (40.0, 2)):
        data = wav(seconds, rate=8000)
        events = list(oai.audio.transcriptions.create(model=STT, file=("a.wav", data), stream=True))
        types = [e.type for e in events]
        assert types == ["transcript.text.delta"] * deltas + ["transcript.text.done"]
        done = events[-1]
        assert done.text == "".join(e.delta for e in events[:-1]).strip()
        if deltas == 1:  # the same text as without streaming
            assert (
                done.text == oai.audio.transcriptions.create(model=STT, file=("a.wav", data)).text
            )


def test_prompt_and_temperature(asrv, oai):
    """The prompt conditions the decoder (another transcript, the same one each time);
    temperature > 0 samples (another transcript each time) and is reported per segment."""
    data = wav(2.0)

    def verbose(**kw):
        return oai.audio.transcriptions.create(
            model=STT, file=("a.wav", data), response_format="verbose_json", **kw
        )

    plain = verbose()
    prompted = [verbose(prompt="Glossary: mlxd, Whisper, MLX.") for _ in range(2)]
    assert segments(prompted[0]) == segments(prompted[1]) != segments(plain)
    sampled = [verbose(temperature=1.0) for _ in range(2)]
    assert all(s.temperature == 1.0 for v in sampled for s in v.segments)
    assert all(s.temperature == 0.0 for s in plain.segments)
    assert sampled[0].text != sampled[1].text
    err = _err(_post(asrv, data, temperature="1.5"), 400)
    assert err["param"] == "temperature"


def test_translation_with_the_openai_client(oai):
    t = oai.audio.translations.create(model=STT, file=("a.wav", wav(2.0)))
    assert isinstance(t.text, str)
    v = oai.audio.translations.create(
        model=STT, file=("a.wav", wav(2.0)), response_format="verbose_json"
    )
    assert v.language == "english" and v.segments


# -- transcription errors --------------------------------------------------------------------


def _post(asrv, data: bytes, path: str = "/v1/audio/transcriptions", **form) -> httpx.Response:
    with asrv.client() as c:
        return c.post(path, files={"file": ("f.wav", data)}, data={"model": STT, **form})


def test_broken_empty_and_non_audio_files_are_400(asrv):
    good = wav(1.0)
    for data in (
        b"",
        b"this is not audio at all, just some text" * 20,
        good[:60],
        b"RIFF\x00\x00\x00\x00WAVEfmt " + bytes(200),
    ):
        err = _err(_post(asrv, data), 400)
        assert err["param"] == "file" and err["type"] == "invalid_request_error", err
    # a container with only a video stream
    err = _err(_post(asrv, video_only()), 400)
    assert err["param"] == "file" and "no audio stream" in err["message"], err
    # streamed too: the file is checked before the stream starts
    err = _err(_post(asrv, b"not audio" * 50, stream="true"), 400)
    assert err["param"] == "file"
    # the server still works
    assert _post(asrv, good).status_code == 200


def test_a_server_without_the_audio_extra_says_501_not_400(asrv, monkeypatch):
    """No PyAV on the server is the operator's to fix: 501 naming the extra, not a 400
    blaming the caller's file."""
    import av  # noqa: F401 - loaded first, so that undo() puts the loaded package back

    upload = wav(1.0)  # made before PyAV is hidden: the helper encodes with it
    monkeypatch.setitem(sys.modules, "av", None)  # import av now raises ImportError
    err = _err(_post(asrv, upload), 501)
    assert err["code"] == "not_installed" and "mlxd[audio]" in err["message"]
    monkeypatch.undo()
    assert _post(asrv, wav(1.0)).status_code == 200


def test_oversize_upload_and_overlong_audio_are_413(asrv):
    err = _err(_post(asrv, np.random.RandomState(0).bytes(2 * 1024 * 1024 + 10)), 413)
    assert "audio.max_upload_bytes" in err["message"]
    with asrv.client() as c:  # past the HTTP body limit for uploads: refused before parsing
        r = c.post(
            "/v1/audio/transcriptions",
            content=b"x" * (3 * 1024 * 1024),
            headers={"content-type": "multipart/form-data; boundary=b"},
        )
    _err(r, 413)
    long_mp3 = encode(tone(150.0, rate=8000), 8000, "mp3", "libmp3lame", bit_rate=16000)
    assert len(long_mp3) < 2 * 1024 * 1024
    err = _err(_post(asrv, long_mp3), 413)
    assert "audio.max_duration_s" in err["message"]


def test_bad_parameters_and_wrong_models_are_400(asrv):
    good = wav(1.0)
    assert _err(_post(asrv, good, language="xx"), 400)["param"] == "language"
    assert _err(_post(asrv, good, response_format="yaml"), 400)
    assert (
        _err(_post(asrv, good, **{"timestamp_granularities[]": "word"}), 400)["param"]
        == "timestamp_granularities"
    )  # words need verbose_json
    assert _err(
        _post(
            asrv, good, **{"timestamp_granularities[]": "letter", "response_format": "verbose_json"}
        ),
        400,
    )
    with asrv.client() as c:
        r = c.post(
            "/v1/audio/transcriptions",
            files={"file": ("f.wav", good)},
            data={"model": "tiny-llama"},
        )
        assert "chat model" in _err(r, 400)["message"]
        r = c.post("/v1/audio/transcriptions", files={"file": ("f.wav", good)}, data={"model": TTS})
        assert _err(r, 400)["param"] == "model"
        _err(c.post("/v1/audio/transcriptions", data={"model": STT}), 400)  # no file
        r = c.post("/v1/audio/speech", json={"model": STT, "input": "Hi.", "voice": "alloy"})
        assert _err(r, 400)["param"] == "model"
        r = c.post("/v1/audio/speech", json={"model": TTS, "input": " ", "voice": "alloy"})
        assert _err(r, 400)["param"] == "input"
        r = c.post("/v1/audio/speech", json={"model": TTS, "input": "x" * 5000})
        assert _err(r, 400)["param"] == "input"
        r = c.post("/v1/audio/speech", json={"model": TTS, "input": "Hi.", "speed": 9})
        _err(r, 400)


def test_audio_parts_to_a_text_model_are_a_clear_400(asrv):
    """Omni models take them (tests/api/test_omni_audio.py); a text model says it cannot."""
    import base64

    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav(0.5)).decode(), "format": "wav"},
    }
    with asrv.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "tiny-llama",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}],
            },
        )
    err = _err(r, 400)
    assert "does not accept audio" in err["message"]
    assert err["param"] == "messages[0].content"


# -- speech ---------------------------------------------------------------------------------


def _sentence_seconds(rate: int = 32000) -> float:
    """A piece's audio: Soprano decodes max_tokens hidden states (plus the prompt's last),
    2048 samples each at 32 kHz, and trims one."""
    return TTS_TOKENS * SOPRANO_TOKEN_SAMPLES / rate


PIECE_SAMPLES = TTS_TOKENS * SOPRANO_TOKEN_SAMPLES  # one piece's audio at 32 kHz
THREE_PIECES = "The first sentence is here. A second one follows it. And a third one ends it."
PLACEHOLDER = b"\xff\xff\xff\xff"  # a streamed wav's RIFF and data sizes


def test_speech_formats_with_the_openai_client(oai):
    r = oai.audio.speech.create(
        model=TTS, voice="alloy", input="Hello there.", response_format="wav"
    )
    audio, rate = decode(r.content)
    assert rate == 32000 and abs(audio.size / rate - _sentence_seconds()) < 0.02
    # one piece: encoded whole before it is sent, so the header has the real sizes
    assert r.content[4:8] != PLACEHOLDER
    with wave.open(io.BytesIO(r.content)) as w:
        assert w.getnframes() == PIECE_SAMPLES and w.getframerate() == 32000
    for fmt in ("mp3", "flac", "opus", "aac"):
        r = oai.audio.speech.create(
            model="tts-1", voice="alloy", input="Hello there.", response_format=fmt
        )
        audio, _ = decode(r.content)
        assert audio.size > 0, fmt
    pcm = oai.audio.speech.create(
        model=TTS, voice="alloy", input="Hello there.", response_format="pcm"
    ).content
    assert len(pcm) % 2 == 0  # 16-bit samples at 24 kHz
    assert abs(len(pcm) / 2 / 24000 - _sentence_seconds()) < 0.02


@pytest.mark.parametrize("fmt", ["wav", "mp3", "opus", "pcm"])
def test_speech_streams_piece_by_piece(oai, fmt):
    """Three pieces come as (at least) three chunks, as they are made, and the chunks
    together are one file of the three pieces' length."""
    with oai.audio.speech.with_streaming_response.create(
        model=TTS, voice="alloy", input=THREE_PIECES, response_format=fmt
    ) as r:
        chunks = [c for c in r.iter_bytes() if c]
    assert len(chunks) >= 3, [len(c) for c in chunks]
    body = b"".join(chunks)
    if fmt == "pcm":
        assert abs(len(body) / 2 / 24000 - 3 * _sentence_seconds()) < 0.05
        return
    audio, rate = decode(body)
    assert abs(audio.size / rate - 3 * _sentence_seconds()) < 0.05, (fmt, audio.size / rate)
    if fmt == "wav":  # OpenAI's streamed wav: both sizes 0xFFFFFFFF; every sample is there
        assert body[4:8] == PLACEHOLDER and body[body.index(b"data") + 4 :][:4] == PLACEHOLDER
        with wave.open(io.BytesIO(body)) as w:
            assert w.getnframes() == 2**31 - 1  # what wave makes of the placeholder
            assert len(w.readframes(w.getnframes())) == 2 * 3 * PIECE_SAMPLES


def test_speed_shortens_speech(oai):
    fast = oai.audio.speech.create(
        model=TTS, voice="alloy", input="Hello there.", response_format="wav", speed=2.0
    )
    audio, rate = decode(fast.content)
    assert abs(audio.size / rate - _sentence_seconds() / 2) < 0.05


def test_speech_sse_events(asrv):
    """stream_format=sse: a speech.audio.delta per piece, in order (the first holds the
    wav header; together they decode to the three pieces), then speech.audio.done."""
    import base64
    import json

    with asrv.client() as c:
        r = c.post(
            "/v1/audio/speech",
            json={
                "model": TTS,
                "input": THREE_PIECES,
                "response_format": "wav",
                "stream_format": "sse",
            },
        )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    types = [e["type"] for e in events]
    assert types[-1] == "speech.audio.done" and len(types) >= 4
    assert set(types[:-1]) == {"speech.audio.delta"}
    parts = [base64.b64decode(e["audio"]) for e in events[:-1]]
    assert all(parts) and parts[0][:4] == b"RIFF" and b"RIFF" not in b"".join(parts[1:])
    audio, rate = decode(b"".join(parts))
    assert rate == 32000 and abs(audio.size / rate - 3 * _sentence_seconds()) < 0.02


def test_transcription_and_speech_run_next_to_chat(asrv, oai):
    """The three kinds share the device thread: concurrent requests of each all finish."""
    results: dict[str, object] = {}

    def chat():
        with asrv.client() as c:
            results["chat"] = c.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny-llama",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            ).status_code

    def stt():
        results["stt"] = oai.audio.transcriptions.create(model=STT, file=("a.wav", wav(2.0))).text

    def tts():
        results["tts"] = len(
            oai.audio.speech.create(
                model=TTS, voice="x", input="Hi there.", response_format="wav"
            ).content
        )

    threads = [threading.Thread(target=f) for f in (chat, stt, tts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)  # a bound to wait only
    assert not any(t.is_alive() for t in threads)
    assert results["chat"] == 200 and isinstance(results["stt"], str) and results["tts"] > 44


# -- the model manager -------------------------------------------------------------------------


@pytest.mark.slow  # audio models loaded and evicted in turn, on a server of its own
def test_audio_models_follow_the_lru_caps_keep_alive_and_the_memory_budget(
    tmp_path, tiny_llama, audio_dirs
):
    """Two Whispers and two Sopranos under max_stt_models 1, max_tts_models 1 and a memory
    budget that holds the chat model and one audio model, never two: each load evicts an
    idle model for the reason /metrics names (capacity: the same kind's cap; memory: the
    other kind's idle model), keep_alive "1s" unloads a model about a second after its
    request, keep_alive 0 at once."""
    import shutil

    from mlxd.runtime.memory import estimate_model_bytes

    stt_b, tts_b = "tiny-whisper-b", "tiny-soprano-b"  # the name tells mlx-audio: Soprano
    for name, src in ((stt_b, audio_dirs[0]), (tts_b, audio_dirs[1])):
        shutil.copytree(src, tmp_path / "src" / name)
    for d in (*audio_dirs, tmp_path / "src" / stt_b, tmp_path / "src" / tts_b):
        _pull(tmp_path / "models", d)
    sizes = [estimate_model_bytes(d, upcast_half=True) for d in (*audio_dirs, tiny_llama)]
    budget = sizes[2] + max(sizes[:2]) + 4 * 1024 * 1024  # < the chat model + both kinds
    assert min(sizes[:2]) > 4 * 1024 * 1024
    srv = LiveServer(
        make_settings(
            tmp_path,
            tiny_llama,
            engine={"warmup": False},
            models={"max_stt_models": 1, "max_tts_models": 1, "memory_budget_bytes": budget},
            audio={"max_tokens_per_window": 4, "tts_max_tokens": 2},
        )
    ).start()
    try:

        def loaded() -> set[str]:
            return {m["name"] for m in srv.health()["models"]} - {"tiny-llama"}

        def evicted(model: str, reason: str) -> float:
            return metric(srv, "mlxd:model_evictions_total", model=model, reason=reason)

        def stt(model: str, **form: str) -> None:
            r = _post(srv, wav(1.0), model=model, **form)
            assert r.status_code == 200, r.text

        def tts(model: str, **body: str) -> None:
            with srv.client() as c:
                r = c.post("/v1/audio/speech", json={"model": model, "input": "Hi.", **body})
            assert r.status_code == 200, r.text

        def gone_within(name: str, seconds: float) -> None:
            deadline = time.time() + seconds
            while name in loaded() and time.time() < deadline:
                time.sleep(0.1)
            assert name not in loaded()

        stt(STT)
        assert loaded() == {STT}
        stt(stt_b)  # the stt cap
        assert loaded() == {stt_b} and evicted(STT, "capacity") == 1
        tts(TTS)  # the budget: the idle Whisper goes
        assert loaded() == {TTS} and evicted(stt_b, "memory") == 1
        tts(tts_b)  # the tts cap
        assert loaded() == {tts_b} and evicted(TTS, "capacity") == 1
        t0 = time.time()
        stt(STT, keep_alive="1s")  # the budget: the idle Soprano goes
        assert loaded() == {STT} and evicted(tts_b, "memory") == 1
        entry = engine(srv, STT)
        assert t0 < entry["expires_at"] <= time.time() + 1.0
        gone_within(STT, 60)
        assert evicted(STT, "idle") == 1
        tts(TTS, keep_alive="1s")
        assert loaded() == {TTS}
        gone_within(TTS, 60)
        assert evicted(TTS, "idle") == 1
        stt(stt_b, keep_alive="0")  # unloaded as the request ends: no eviction
        gone_within(stt_b, 60)
        assert evicted(stt_b, "idle") == 0
    finally:
        srv.stop()
