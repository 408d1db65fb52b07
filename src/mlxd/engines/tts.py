"""Text to speech: mlx-audio TTS checkpoints (Soprano, Kokoro, OuteTTS, Spark...).

mlx-audio's TTS models share one interface, ``model.generate(text, voice=..., ...)``
yielding audio pieces; they have no batched decode across requests, so each forward pass
here synthesises one piece of text (the front end cuts a request's input at sentence ends
and sends the pieces in order). One pass per worker step keeps a long speech from holding
the device: other models' decode steps and other speeches run between its pieces, and the
front end streams each piece as it comes.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.core.errors import InvalidRequest, ModelLoadError
from mlxd.engines.batching import BatchPolicy, EncodeItem, EncodeJob
from mlxd.engines.encoder import BatchingEncoder

log = logging.getLogger(__name__)


@dataclass(eq=False)
class SpeechPiece(EncodeItem):
    """One piece of text to speak; one per forward pass."""

    text: str = ""
    voice: str | None = None
    speed: float = 1.0
    extra: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return 1


class TextToSpeechEngine(BatchingEncoder):
    kind = "tts"

    def __init__(
        self,
        name: str,
        path: Path,
        policy: BatchPolicy,
        *,
        max_tokens: int = 1024,
        architecture: str | None = None,
    ) -> None:
        policy.max_batch_size = 1  # see the module docstring
        super().__init__(name, policy)
        self.path = Path(path)
        try:
            from mlx_audio.tts.utils import load_model
        except ImportError as exc:
            raise ModelLoadError(
                f"model '{name}' is a text-to-speech model; install the "
                "audio extra (pip install 'mlxd[audio]')"
            ) from exc
        kw = {"model_type": architecture} if architecture else {}
        try:
            model = load_model(self.path, **kw)
        except Exception as exc:  # noqa: BLE001 - one clear load error
            raise ModelLoadError(
                f"could not load text-to-speech model '{name}' from {path}: {exc}"
            ) from exc
        if not callable(getattr(model, "generate", None)):
            raise ModelLoadError(f"model '{name}' has no speech generator")
        self.model = model
        self.sample_rate = int(getattr(model, "sample_rate", 24000))
        self.max_tokens = int(max_tokens)
        params = inspect.signature(model.generate).parameters
        self.native_speed = "speed" in params
        self._takes_max_tokens = "max_tokens" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
        )
        self.context_length = 0
        from mlx.utils import tree_flatten

        self.nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))

    def new_speech_job(self, pieces: list[str], voice: str | None, speed: float) -> EncodeJob:
        return EncodeJob(
            [SpeechPiece(i, [], text=t, voice=voice, speed=speed) for i, t in enumerate(pieces)]
        )

    # -- the forward pass (worker thread) ------------------------------------------------
    def _forward(self, items: list[EncodeItem]) -> list[Any]:
        return [self._speak(it) for it in items]  # type: ignore[arg-type]

    def _speak(self, it: SpeechPiece) -> np.ndarray:
        kw: dict[str, Any] = {"text": it.text, "voice": it.voice, "verbose": False}
        if self.native_speed:
            kw["speed"] = it.speed
        if self._takes_max_tokens:
            kw["max_tokens"] = self.max_tokens
        try:
            parts = [
                np.asarray(r.audio, dtype=np.float32).reshape(-1) for r in self.model.generate(**kw)
            ]
        except (ValueError, KeyError) as exc:  # an unknown voice, text it cannot speak
            raise InvalidRequest(f"model '{self.name}' cannot speak this: {exc}") from exc
        if not parts:
            return np.zeros(0, np.float32)
        return np.concatenate(parts)

    def warmup(self) -> None:
        saved, self.max_tokens = self.max_tokens, min(self.max_tokens, 4)
        try:
            self._speak(SpeechPiece(0, [], text="Hi."))
        finally:
            self.max_tokens = saved
        self.max_batch_seen = 0

    def close(self) -> None:
        super().close()
        self.model = None
        mx.clear_cache()
