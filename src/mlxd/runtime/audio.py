"""The engine core's audio requests: transcription (Whisper windows) and speech.

The front end decodes uploads (PyAV), cuts them into windows of at most 30 seconds and
sends each as 16 kHz mono float32 samples; here a window joins the model's batch queue
next to other requests' windows (:mod:`mlxd.engines.stt`). Speech pieces go to the TTS
model's queue one per pass.
Both hold a lease on their model for the request, so the model manager's LRU, keep-alive
and memory budget treat them as they treat every other model.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from mlxd.core.errors import InvalidRequest
from mlxd.observability.context import note


class AudioService:
    def __init__(self, runtime: Any, encoders: Any) -> None:
        self.rt = runtime
        self.encoders = encoders  # admission and job submission are shared with encoders

    @staticmethod
    def _name(model: str | None, default: str | None) -> str:
        """The front end sends resolved names; a direct call may rely on the default."""
        name = model or default
        if not name:
            raise InvalidRequest("name a model: no default is configured for it", param="model")
        return name

    @contextlib.asynccontextmanager
    async def _leased(
        self, model: str | None, default: str | None, keep_alive: Any, kind: str, needs: str
    ) -> AsyncIterator[tuple[Any, Any]]:
        """Admission, then a lease on the model for the request (``needs``: what the
        request needs when the model is of another kind)."""
        name = self._name(model, default)
        async with self.encoders.admitted():
            lease = await self.rt.models.acquire(name, keep_alive)
            try:
                entry = lease.entry
                note(model=entry.name)
                if entry.kind != kind:
                    raise InvalidRequest(
                        f"model '{entry.name}' is a {entry.kind} model; {needs}", param="model"
                    )
                yield entry, lease.engine
            finally:
                lease.release()

    async def transcribe(
        self,
        model: str | None,
        audio: bytes,
        task: str = "transcribe",
        language: str | None = None,
        prompt: str | None = None,
        temperature: float = 0.0,
        words: bool = False,
        keep_alive: Any = None,
    ) -> dict[str, Any]:
        """One window (at most ``window_seconds`` of samples at ``sample_rate``; where a
        long file is cut is the front end's choice, ``frontend/audio.window_bounds``)."""
        from mlxd.engines.stt import WindowOptions

        samples = np.frombuffer(audio, dtype=np.float32)
        async with self._leased(
            model,
            self.rt.settings.audio.default_stt,
            keep_alive,
            "stt",
            "transcription needs a speech-to-text (Whisper) model",
        ) as (entry, engine):
            if samples.size > engine.window_seconds * engine.sample_rate:
                raise InvalidRequest(
                    f"one transcription call takes at most {engine.window_seconds} s of audio",
                    param="audio",
                )
            opts = WindowOptions(
                task=task,
                language=language or None,
                prompt=prompt or None,
                temperature=float(temperature),
                words=bool(words),
            )
            engine.check_options(opts)
            (result,) = await self.encoders.run_job(engine, engine.new_windows_job([samples], opts))
            return {
                "model": entry.name,
                "duration": samples.size / engine.sample_rate,
                "window": result,
            }

    async def speak(
        self,
        model: str | None,
        text: str,
        voice: str | None = None,
        speed: float = 1.0,
        keep_alive: Any = None,
    ) -> dict[str, Any]:
        async with self._leased(
            model,
            self.rt.settings.audio.default_tts,
            keep_alive,
            "tts",
            "speech needs a text-to-speech model",
        ) as (entry, engine):
            out = await self.encoders.run_job(engine, engine.new_speech_job([text], voice, speed))
            audio = np.ascontiguousarray(out[0], dtype=np.float32)
            return {
                "model": entry.name,
                "audio": audio.tobytes(),
                "sample_rate": engine.sample_rate,
                "speed_applied": engine.native_speed,
            }
