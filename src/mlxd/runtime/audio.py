"""The engine core's audio requests: transcription (Whisper windows) and speech.

The front end decodes uploads (PyAV) and sends 16 kHz mono float32 samples; here they are
cut into 30-second windows that join the model's batch queue next to other requests'
windows (:mod:`mlxd.engines.stt`). Speech pieces go to the TTS model's queue one per pass.
Both hold a lease on their model for the request, so the model manager's LRU, keep-alive
and memory budget treat them as they treat every other model.
"""

from __future__ import annotations

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
            raise InvalidRequest("name a model: no default is configured for it",
                                 param="model")
        return name

    async def transcribe(self, model: str | None, audio: bytes, task: str = "transcribe",
                         language: str | None = None, prompt: str | None = None,
                         temperature: float = 0.0, words: bool = False,
                         keep_alive: Any = None) -> dict[str, Any]:
        from mlxd.engines.stt import WindowOptions, windows

        name = self._name(model, self.rt.settings.audio.default_stt)
        samples = np.frombuffer(audio, dtype=np.float32)
        async with self.encoders.admitted():
            lease = await self.rt.models.acquire(name, keep_alive)
            try:
                entry, engine = lease.entry, lease.engine
                note(model=entry.name)
                if entry.kind != "stt":
                    raise InvalidRequest(
                        f"model '{entry.name}' is a {entry.kind} model; transcription needs a "
                        "speech-to-text (Whisper) model", param="model")
                opts = WindowOptions(task=task, language=language or None,
                                     prompt=prompt or None, temperature=float(temperature),
                                     words=bool(words))
                engine.check_options(opts)
                pieces = windows(samples)
                results = await self.encoders.run_job(engine,
                                                      engine.new_windows_job(pieces, opts))
                return {"model": entry.name, "duration": samples.size / engine.sample_rate,
                        "window_seconds": engine.window_seconds, "windows": results}
            finally:
                lease.release()

    async def speak(self, model: str | None, text: str, voice: str | None = None,
                    speed: float = 1.0, keep_alive: Any = None) -> dict[str, Any]:
        name = self._name(model, self.rt.settings.audio.default_tts)
        async with self.encoders.admitted():
            lease = await self.rt.models.acquire(name, keep_alive)
            try:
                entry, engine = lease.entry, lease.engine
                note(model=entry.name)
                if entry.kind != "tts":
                    raise InvalidRequest(
                        f"model '{entry.name}' is a {entry.kind} model; speech needs a "
                        "text-to-speech model", param="model")
                out = await self.encoders.run_job(engine,
                                                  engine.new_speech_job([text], voice, speed))
                audio = np.ascontiguousarray(out[0], dtype=np.float32)
                return {"model": entry.name, "audio": audio.tobytes(),
                        "sample_rate": engine.sample_rate, "speed_applied": engine.native_speed}
            finally:
                lease.release()
