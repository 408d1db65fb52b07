"""Transcription and speech requests in a front end: what the audio routes call.

Transcription: the upload is decoded and resampled here (PyAV, off the event loop) to the
model's rate, cut into windows of at most 30 seconds (at a pause near each 30 s mark when
there is one: :func:`mlxd.frontend.audio.window_bounds`) and sent to the core as float32
samples, one call per window, up to ``audio.max_batch_size`` of them in flight, so a
request's windows share batches with each other and with other requests'; a streamed
request yields each window's text as soon as it and those before it are done.

Speech: the input is cut at sentence ends into pieces, each piece one core call (one
synthesis pass on the device), encoded and yielded as it arrives; the next piece is
already queued while the current one is encoded and sent. An input of one piece is
encoded whole before it is sent, so its container states its real length (a wav header's
sizes); a longer one streams with the placeholders of a stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlxd.core.errors import InvalidRequest, PayloadTooLarge
from mlxd.enginecore import protocol as p
from mlxd.frontend.audio import SpeechEncoder, decode_audio, split_text, window_bounds
from mlxd.observability.context import note

log = logging.getLogger(__name__)

OPENAI_STT_NAMES = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe")
OPENAI_TTS_NAMES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


@dataclass
class Transcript:
    model: str
    task: str
    language: str
    duration: float
    text: str
    segments: list[dict[str, Any]] = field(default_factory=list)
    words: list[dict[str, Any]] | None = None  # when asked for


class SpeechRequests:
    def __init__(self, runtime: Any) -> None:
        self.rt = runtime

    @property
    def settings(self) -> Any:
        return self.rt.settings

    def _model(self, model: str | None, kind: str) -> str:
        a = self.settings.audio
        names, default = (
            (OPENAI_STT_NAMES, a.default_stt)
            if kind == "stt"
            else (OPENAI_TTS_NAMES, a.default_tts)
        )
        if model is not None and not model.strip():
            raise InvalidRequest("a model name must not be empty or blank", param="model")
        if model and model != "default" and model not in names:
            return self.rt.catalog.resolve(model)
        if default:
            return self.rt.catalog.resolve(default)
        hint = "whisper-tiny" if kind == "stt" else "soprano-80m"
        raise InvalidRequest(
            f"no {'speech-to-text' if kind == 'stt' else 'text-to-speech'} model is "
            f"configured (audio.default_{kind}); name one in 'model', e.g. after "
            f"'mlxd pull {hint}'",
            param="model",
        )

    async def _info(self, model: str | None, kind: str, keep_alive: Any) -> p.ModelInfo:
        self.rt.check_serving()
        info = await self.rt.model_info(self._model(model, kind), keep_alive)
        note(model=info.name)
        if info.kind != kind:
            what = "speech-to-text (Whisper)" if kind == "stt" else "text-to-speech"
            raise InvalidRequest(
                f"model '{info.name}' is a {info.kind} model; this endpoint needs a {what} model",
                param="model",
            )
        return info

    async def _call(self, request: p.Request[p.R]) -> p.R:
        return await self.rt.encoder_call(request)  # admission, like encoders

    # -- transcription -------------------------------------------------------------------
    async def _samples(self, data: bytes, info: p.ModelInfo) -> np.ndarray:
        a = self.settings.audio
        if len(data) > a.max_upload_bytes:
            raise PayloadTooLarge(
                f"the audio file has {len(data)} bytes, more than this "
                f"server accepts ({a.max_upload_bytes}; "
                "audio.max_upload_bytes)",
                param="file",
            )
        return await asyncio.to_thread(
            decode_audio, data, info.sample_rate, max_seconds=a.max_duration_s
        )

    async def _windows(
        self, model: str | None, data: bytes, keep_alive: Any, **opts: Any
    ) -> tuple[p.ModelInfo, np.ndarray, AsyncIterator[tuple[float, p.TranscriptWindow]]]:
        """(model info, samples, (start in seconds, result) of each window in order).

        Each window (at most 30 s) is its own core call, so no message carries more than
        one window's samples (an hour of audio is 230 MB of float32) and each result can
        be streamed as it comes; at most ``audio.max_batch_size`` of a request's windows
        are in flight at once (enough to fill a batch, never the whole queue). The model
        and the file are checked, and the first window is done, before this returns, so a
        failure there is still a plain HTTP error.
        """
        info = await self._info(model, "stt", keep_alive)
        samples = await self._samples(data, info)
        rate, window = info.sample_rate, info.window_seconds
        bounds = window_bounds(samples, rate, window, self.settings.audio.window_cut_search_s)
        pieces = [samples[a:b] for a, b in bounds]
        ahead = max(int(self.settings.audio.max_batch_size), 1)

        def call(piece: np.ndarray) -> asyncio.Future[p.Transcribed]:
            return asyncio.ensure_future(
                self._call(p.Transcribe(info.name, piece.tobytes(), keep_alive=keep_alive, **opts))
            )

        calls = [call(p) for p in pieces[:ahead]]
        try:
            await asyncio.wait([calls[0]])
            first = calls[0].result()
        except BaseException:
            for c in calls:
                c.cancel()
            raise

        async def results() -> AsyncIterator[tuple[float, p.TranscriptWindow]]:
            try:
                for i in range(len(pieces)):
                    r = first if i == 0 else await calls[i]
                    if i + ahead < len(pieces):
                        calls.append(call(pieces[i + ahead]))
                    yield bounds[i][0] / rate, r.window
            finally:
                for c in calls:
                    c.cancel()

        return info, samples, results()

    async def transcribe(
        self,
        model: str | None,
        data: bytes,
        *,
        task: str = "transcribe",
        language: str | None = None,
        prompt: str | None = None,
        temperature: float = 0.0,
        words: bool = False,
        keep_alive: Any = None,
    ) -> Transcript:
        info, samples, results = await self._windows(
            model,
            data,
            keep_alive,
            task=task,
            language=language,
            prompt=prompt,
            temperature=temperature,
            words=words,
        )
        windows = [w async for w in results]
        return _assemble(info.name, task, samples.size / info.sample_rate, windows, words)

    async def transcribe_stream(
        self,
        model: str | None,
        data: bytes,
        *,
        task: str,
        language: str | None = None,
        prompt: str | None = None,
        temperature: float = 0.0,
        keep_alive: Any = None,
    ) -> AsyncIterator[tuple[str, Any]]:
        """("delta", text) per window in order, then ("done", Transcript)."""
        info, samples, results = await self._windows(
            model,
            data,
            keep_alive,
            task=task,
            language=language,
            prompt=prompt,
            temperature=temperature,
        )

        async def gen() -> AsyncIterator[tuple[str, Any]]:
            windows: list[tuple[float, p.TranscriptWindow]] = []
            async for w in results:
                windows.append(w)
                yield "delta", w[1].text
            yield "done", _assemble(info.name, task, samples.size / info.sample_rate, windows)

        return gen()

    # -- speech --------------------------------------------------------------------------
    async def speak(
        self,
        model: str | None,
        text: str,
        *,
        voice: str | None,
        fmt: str,
        speed: float = 1.0,
        keep_alive: Any = None,
    ) -> tuple[str, AsyncIterator[bytes]]:
        """(model name, body chunks). The first piece is synthesised before this returns,
        so a failure is still a plain HTTP error."""
        a = self.settings.audio
        if not text.strip():
            raise InvalidRequest("input must not be empty", param="input")
        if len(text) > a.max_speech_chars:
            raise InvalidRequest(
                f"input has {len(text)} characters, more than this server "
                f"accepts ({a.max_speech_chars}; audio.max_speech_chars)",
                param="input",
            )
        info = await self._info(model, "tts", keep_alive)
        pieces = split_text(text, a.tts_segment_chars)
        name = info.name

        def call(piece: str) -> asyncio.Future[p.Spoken]:
            return asyncio.ensure_future(self._call(p.Speak(name, piece, voice, speed, keep_alive)))

        pending = call(pieces[0])
        try:
            first = await pending
        except BaseException:
            pending.cancel()
            raise
        rate = first.sample_rate
        encoder = SpeechEncoder(
            fmt, rate, 1.0 if first.speed_applied else speed, whole=len(pieces) == 1
        )

        async def body() -> AsyncIterator[bytes]:
            t0 = time.perf_counter()
            nxt: asyncio.Future[p.Spoken] | None = None
            r = first
            seconds = 0.0
            try:
                for i in range(len(pieces)):
                    nxt = call(pieces[i + 1]) if i + 1 < len(pieces) else None
                    audio = np.frombuffer(r.audio, dtype=np.float32)
                    seconds += audio.size / rate
                    chunk = await asyncio.to_thread(encoder.encode, audio)  # off the loop
                    if chunk:
                        yield chunk
                    if nxt is not None:
                        r = await nxt
                tail = await asyncio.to_thread(encoder.finish)
                if tail:
                    yield tail
                log.debug(
                    "speech: %d pieces, %.2f s of audio in %.2f s",
                    len(pieces),
                    seconds,
                    time.perf_counter() - t0,
                )
            finally:
                if nxt is not None:
                    nxt.cancel()

        return name, body()


def _assemble(
    model: str,
    task: str,
    duration: float,
    windows: list[tuple[float, p.TranscriptWindow]],
    words: bool = False,
) -> Transcript:
    """Windows' results (each with its start in seconds) as one transcript: segments (and
    words) on the file's clock."""
    segments: list[dict[str, Any]] = []
    all_words: list[dict[str, Any]] = []
    for offset, res in windows:
        for s in res.segments:
            all_words.extend(
                {
                    "word": x["word"],
                    "start": round(offset + x["start"], 2),
                    "end": round(offset + x["end"], 2),
                }
                for x in s.get("words", [])
            )
            segments.append(
                {
                    "id": len(segments),
                    "seek": round(offset * 100),
                    "start": round(offset + s["start"], 2),
                    "end": round(offset + s["end"], 2),
                    "text": s["text"],
                    "tokens": s["tokens"],
                    "temperature": res.temperature,
                    "avg_logprob": res.avg_logprob,
                    "compression_ratio": res.compression_ratio,
                    "no_speech_prob": res.no_speech_prob,
                }
            )
    first = windows[0][1] if windows else None
    language = (first.language_name or first.language or "") if first else ""
    if task == "translate":
        language = "english"
    text = "".join(res.text for _, res in windows).strip()
    return Transcript(
        model, task, language, round(duration, 3), text, segments, all_words if words else None
    )
