"""OpenAI's audio API on the wire: the speech request body and the transcription replies
(json, verbose_json, and the text/srt/vtt renderings)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from mlxd.api.wire import KeepAlive, ModelName, WireModel

TranscriptFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]
SpeechFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]


class SpeechBody(WireModel):
    model: ModelName | None = Field(
        None, description="A text-to-speech model; 'tts-1', 'tts-1-hd' or none: audio.default_tts."
    )
    input: str = Field(description="The text to speak (at most audio.max_speech_chars).")
    voice: str | None = Field(
        None, description="A voice of the model (passed to it; models with one voice ignore it)."
    )
    instructions: str | None = Field(None, description="Accepted and ignored.")
    response_format: SpeechFormat = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = Field(
        "audio",
        description="'audio': the encoded audio as the body, streamed as it is made; "
        "'sse': speech.audio.delta events with base64 audio, then speech.audio.done.",
    )
    keep_alive: KeepAlive = None


class Segment(BaseModel):
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float | None
    compression_ratio: float | None
    no_speech_prob: float | None


class Word(BaseModel):
    word: str
    start: float
    end: float


class DurationUsage(BaseModel):
    type: Literal["duration"] = "duration"
    seconds: float


class Transcription(BaseModel):
    text: str
    usage: DurationUsage | None = None


class VerboseTranscription(BaseModel):
    task: Literal["transcribe", "translate"]
    language: str
    duration: float
    text: str
    segments: list[Segment] | None = None
    words: list[Word] | None = Field(None, description="timestamp_granularities[]=word")
    usage: DurationUsage | None = None


def _clock(t: float, sep: str) -> str:
    ms = int(round(t * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def render_srt(segments: list[dict[str, Any]]) -> str:
    return "".join(
        f"{i}\n{_clock(s['start'], ',')} --> {_clock(s['end'], ',')}\n{s['text'].strip()}\n\n"
        for i, s in enumerate(segments, 1)
    )


def render_vtt(segments: list[dict[str, Any]]) -> str:
    return "WEBVTT\n\n" + "".join(
        f"{_clock(s['start'], '.')} --> {_clock(s['end'], '.')}\n{s['text'].strip()}\n\n"
        for s in segments
    )
