"""Speech to text: Whisper checkpoints through mlx-audio, batched across requests.

Why mlx-audio and not mlx-whisper (checked against mlx-audio 0.6.2 and mlx-whisper 0.4.3):
mlx-vlm (the ``vision`` extra) already requires mlx-audio, which also brings the TTS
models; both wheels are pure Python, but mlx-whisper requires PyTorch (its reference model
in ``torch_whisper.py``), numba, scipy and tiktoken, reads audio through the ``ffmpeg`` program,
and loads only MLX conversions (``weights.safetensors``/``weights.npz``), where mlx-audio's
Whisper also loads Hugging Face's own checkpoints (tokenizer through transformers'
``WhisperProcessor``, which mlxd already has).

The unit of work is one window of at most 30 seconds of 16 kHz mono samples (Whisper's
encoder sees exactly 30 s; a shorter window is padded with silence). The front end cuts a
request's audio into windows (at pauses where it can: ``frontend/audio.window_bounds``)
that are decoded independently -- no window is conditioned on the text of the one before
-- so the windows of one long file and those of concurrent requests ride in the same
batch: one pass runs the encoder on up to ``audio.max_batch_size`` windows and
mlx-audio's batched greedy (or sampled) decoder over them, grouped by their decoding
options (task, language, prompt, temperature). The decoder writes Whisper's timestamp
tokens, which become segments with times relative to the window.
"""

from __future__ import annotations

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

SAMPLE_RATE = 16000
WINDOW_SECONDS = 30
WINDOW_SAMPLES = SAMPLE_RATE * WINDOW_SECONDS
SECONDS_PER_TIMESTAMP = 0.02


@dataclass(frozen=True)
class WindowOptions:
    """What one window is decoded with; windows with equal options share a decode call."""

    task: str = "transcribe"  # or "translate" (to English)
    language: str | None = None  # None: detected per window
    prompt: str | None = None
    temperature: float = 0.0
    words: bool = False  # word timestamps (cross-attention alignment, one pass per window)


@dataclass(eq=False)
class AudioWindow(EncodeItem):
    """One window of a request: its samples and decoding options. It counts as one
    "token" in the batch queue, so ``max_batch_size`` bounds the windows of a pass."""

    audio: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    options: WindowOptions = field(default_factory=WindowOptions)

    @property
    def n(self) -> int:
        return 1


class SpeechToTextEngine(BatchingEncoder):
    """One loaded Whisper model and the batch queue of its windows."""

    kind = "stt"

    def __init__(
        self,
        name: str,
        path: Path,
        policy: BatchPolicy,
        *,
        max_tokens: int = 224,
        dtype: str = "auto",
    ) -> None:
        super().__init__(name, policy)
        self.path = Path(path)
        try:
            from mlx_audio.stt.utils import load_model
        except ImportError as exc:
            raise ModelLoadError(
                f"model '{name}' is a speech-to-text model; install the "
                "audio extra (pip install 'mlxd[audio]')"
            ) from exc
        try:
            model = load_model(self.path)
        except Exception as exc:  # noqa: BLE001 - one clear load error
            raise ModelLoadError(
                f"could not load speech-to-text model '{name}' from {path}: {exc}"
            ) from exc
        if not hasattr(model, "decode") or not hasattr(model, "dims"):
            raise ModelLoadError(
                f"model '{name}' ({type(model).__module__}) is not a Whisper "
                "model; only Whisper checkpoints are served for speech to "
                "text"
            )
        if getattr(model, "_processor", None) is None:
            raise ModelLoadError(
                f"model '{name}': no Whisper tokenizer files (vocab.json, "
                "merges.txt, preprocessor_config.json) next to the weights"
            )
        self._cast(model, dtype)
        self.model = model
        self.sample_rate = SAMPLE_RATE
        self.window_seconds = WINDOW_SECONDS
        self.context_length = int(model.dims.n_text_ctx)
        self.max_tokens = min(int(max_tokens), self.context_length // 2)
        self.multilingual = bool(model.is_multilingual)
        from mlx.utils import tree_flatten

        self.nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        self._tokenizers: dict[tuple[str | None, str], Any] = {}

    @staticmethod
    def _cast(model: Any, dtype: str) -> None:
        """models.dtype for Whisper: mlx-audio builds it in float16, which MLX's CPU backend
        runs several times slower than float32 ('auto' on the CPU: float32)."""
        from mlxd.engines.backend import apply_dtype

        used = apply_dtype(model, {}, dtype)
        if used in ("float32", "float16", "bfloat16"):
            model.dtype = getattr(mx, used)
            enc = model.encoder  # its sinusoids are no parameter: cast them too
            enc._positional_embedding = enc._positional_embedding.astype(model.dtype)

    # -- off the device: request checks --------------------------------------------------
    def check_options(self, opts: WindowOptions) -> None:
        from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES, TO_LANGUAGE_CODE

        if opts.language is not None:
            code = TO_LANGUAGE_CODE.get(opts.language.lower(), opts.language.lower())
            if code not in LANGUAGES:
                raise InvalidRequest(
                    f"language {opts.language!r} is not one Whisper knows; "
                    "use an ISO-639-1 code such as 'en' or 'de'",
                    param="language",
                )
            if not self.multilingual and code != "en":
                raise InvalidRequest(f"model '{self.name}' is English-only", param="language")
        if opts.task == "translate" and not self.multilingual:
            raise InvalidRequest(
                f"model '{self.name}' is English-only and cannot translate; "
                "use a multilingual Whisper",
                param="model",
            )

    def new_windows_job(self, pieces: list[np.ndarray], opts: WindowOptions) -> EncodeJob:
        return EncodeJob([AudioWindow(i, [], audio=a, options=opts) for i, a in enumerate(pieces)])

    # -- the forward pass (worker thread) ------------------------------------------------
    def _forward(self, items: list[EncodeItem]) -> list[Any]:
        out: list[Any] = [None] * len(items)
        groups: dict[WindowOptions, list[int]] = {}
        for i, it in enumerate(items):
            assert isinstance(it, AudioWindow)
            groups.setdefault(it.options, []).append(i)
        for opts, idx in groups.items():
            results = self._decode([items[i] for i in idx], opts)  # type: ignore[misc]
            for i, r in zip(idx, results, strict=True):
                out[i] = r
        return out

    def _decode(self, items: list[AudioWindow], opts: WindowOptions) -> list[dict]:
        from mlx_audio.stt.models.whisper.audio import N_FRAMES, log_mel_spectrogram, pad_or_trim
        from mlx_audio.stt.models.whisper.decoding import DecodingOptions

        m = self.model
        mels = []
        for it in items:
            mel = log_mel_spectrogram(
                mx.array(it.audio), n_mels=m.dims.n_mels, padding=WINDOW_SAMPLES
            )
            mels.append(pad_or_trim(mel, N_FRAMES, axis=-2).astype(m.dtype))
        options = DecodingOptions(
            task=opts.task,
            language=opts.language,
            temperature=opts.temperature,
            prompt=opts.prompt,
            sample_len=self.max_tokens,
            without_timestamps=False,
            fp16=m.dtype == mx.float16,
        )
        results = m.decode(mx.stack(mels), options)
        out = []
        for r, it, mel in zip(results, items, mels, strict=True):
            res = self._result(r, it.audio.size / SAMPLE_RATE, opts)
            if opts.words:
                self._add_words(res, r.language, opts.task, mel, it.audio.size)
            out.append(res)
        return out

    def _add_words(self, res: dict, language: str, task: str, mel: mx.array, samples: int) -> None:
        """Word timings for a window's segments: mlx-audio's alignment (Whisper's
        cross-attention heads over the window's frames, dynamic time warping)."""
        from mlx_audio.stt.models.whisper.audio import HOP_LENGTH
        from mlx_audio.stt.models.whisper.timing import add_word_timestamps

        segs = [{**s, "seek": 0} for s in res["segments"]]
        if segs:
            add_word_timestamps(
                segments=segs,
                model=self.model,
                tokenizer=self._tokenizer(language, task),
                mel=mel,
                num_frames=max(samples // HOP_LENGTH, 2),
                last_speech_timestamp=0.0,
            )
        for s, done in zip(res["segments"], segs, strict=True):
            s["words"] = [
                {"word": w["word"], "start": w["start"], "end": w["end"]}
                for w in done.get("words", [])
            ]

    def _tokenizer(self, language: str | None, task: str) -> Any:
        key = (language, task)
        tok = self._tokenizers.get(key)
        if tok is None:
            tok = self._tokenizers[key] = self.model.get_tokenizer(language=language, task=task)
        return tok

    def _result(self, r: Any, seconds: float, opts: WindowOptions) -> dict[str, Any]:
        tok = self._tokenizer(r.language, opts.task)
        segments = split_segments(list(r.tokens), tok.timestamp_begin, tok.eot, seconds)
        segs = []
        for start, end, ids in segments:
            text = tok.hf_tokenizer.decode(ids, skip_special_tokens=True)
            segs.append({"start": start, "end": end, "text": text, "tokens": ids})
        from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

        return {
            "language": r.language,
            "language_name": LANGUAGES.get(r.language, r.language),
            "text": "".join(s["text"] for s in segs),
            "segments": segs,
            "avg_logprob": _num(r.avg_logprob),
            "no_speech_prob": _num(r.no_speech_prob),
            "compression_ratio": _num(r.compression_ratio),
            "temperature": float(opts.temperature),
            "tokens": len(r.tokens),
        }

    def warmup(self) -> None:
        self._forward([AudioWindow(0, [], audio=np.zeros(SAMPLE_RATE, np.float32))])
        self.max_batch_seen = 0

    def stats(self) -> dict[str, Any]:
        return {"windows_done": self.inputs_done}

    def close(self) -> None:
        super().close()
        self.model = None
        mx.clear_cache()


def split_segments(
    tokens: list[int], ts_begin: int, eot: int, seconds: float
) -> list[tuple[float, float, list[int]]]:
    """Whisper's output tokens as (start, end, text token ids) segments.

    Timestamp tokens (ids from ``ts_begin``, 20 ms apart) bracket the text: ``<|t0|> text
    <|t1|>`` is a segment from t0 to t1. Text before any timestamp starts at 0; text after
    the last one ends where the window's audio ends. Special tokens (>= ``eot``) are no
    text.
    """
    out: list[tuple[float, float, list[int]]] = []
    start: float | None = None
    text: list[int] = []
    for t in tokens:
        if t >= ts_begin:
            stamp = min((t - ts_begin) * SECONDS_PER_TIMESTAMP, seconds)
            if text:
                out.append((start if start is not None else 0.0, max(stamp, start or 0.0), text))
                text = []
            start = stamp
        elif t < eot:
            text.append(t)
    if text:
        begin = start if start is not None else 0.0
        out.append((begin, max(seconds, begin), text))
    return [(round(a, 2), round(b, 2), ids) for a, b, ids in out]


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if np.isfinite(v) else None
