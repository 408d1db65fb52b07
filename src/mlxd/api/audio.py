"""OpenAI's audio endpoints: transcriptions, translations and speech.

* ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: a multipart form with
  ``file`` (any format FFmpeg reads), ``model``, ``language``, ``prompt``,
  ``response_format`` (json, text, srt, vtt, verbose_json with segments), ``temperature``,
  ``timestamp_granularities[]`` (segment, word) and ``stream`` (server-sent
  ``transcript.text.delta`` events, one per window (of at most 30 s) with its whole text, then
  ``transcript.text.done``), served by a Whisper model.
* ``POST /v1/audio/speech``: ``input``, ``voice``, ``response_format`` (mp3, opus, aac, flac,
  wav, pcm), ``speed``; the audio body streams piece by piece as the model makes it.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypedDict

from fastapi import APIRouter, File, Form, Request, Response, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse

from mlxd.api.audio_schemas import (
    SpeechBody,
    TranscriptFormat,
    Transcription,
    VerboseTranscription,
    render_srt,
    render_vtt,
)
from mlxd.api.common import runtime
from mlxd.api.docs import SSE, ok
from mlxd.api.errors import error_payload
from mlxd.api.routing import ApiRoute, UploadRoute
from mlxd.api.streaming import DisconnectAwareStream, sse, sse_response, until_disconnect
from mlxd.api.wire import ModelName
from mlxd.core.errors import InvalidRequest, MlxdError
from mlxd.frontend.audio import MEDIA_TYPES
from mlxd.frontend.speech import Transcript

uploads = APIRouter(route_class=UploadRoute)
router = APIRouter(route_class=ApiRoute)


def _usage(t: Transcript) -> dict[str, Any]:
    return {"type": "duration", "seconds": t.duration}


def _reply(t: Transcript, fmt: str, segments: bool = True) -> Response:
    if fmt == "text":
        return PlainTextResponse(t.text + "\n")
    if fmt == "srt":
        return PlainTextResponse(render_srt(t.segments))
    if fmt == "vtt":
        return PlainTextResponse(render_vtt(t.segments), media_type="text/vtt")
    if fmt == "verbose_json":
        out: dict[str, Any] = {
            "task": t.task,
            "language": t.language,
            "duration": t.duration,
            "text": t.text,
        }
        if segments:  # OpenAI: asking for words alone leaves the segments out
            out["segments"] = t.segments
        if t.words is not None:
            out["words"] = t.words
        return JSONResponse({**out, "usage": _usage(t)})
    return JSONResponse({"text": t.text, "usage": _usage(t)})


class _Options(TypedDict):
    """The transcription options both speech calls take."""

    task: str
    language: str | None
    prompt: str | None
    temperature: float
    keep_alive: str | None


async def _transcribe(
    request: Request,
    task: str,
    file: UploadFile,
    model: str | None,
    language: str | None,
    prompt: str | None,
    fmt: str,
    temperature: float,
    granularities: list[str] | None,
    stream: bool,
    keep_alive: str | None = None,
) -> Response:
    if not 0.0 <= temperature <= 1.0:
        raise InvalidRequest("temperature must be between 0 and 1", param="temperature")
    for g in granularities or []:
        if g not in ("segment", "word"):
            raise InvalidRequest(
                f"timestamp_granularities: unknown value {g!r}", param="timestamp_granularities"
            )
    if granularities and fmt != "verbose_json":
        raise InvalidRequest(
            "timestamp_granularities needs response_format=verbose_json",
            param="timestamp_granularities",
        )
    data = await file.read()
    speech = runtime(request).speech
    args = _Options(
        task=task, language=language, prompt=prompt, temperature=temperature, keep_alive=keep_alive
    )
    words = "word" in (granularities or [])
    if stream:
        if fmt not in ("json", "text"):
            raise InvalidRequest(
                "stream=true returns text events; use response_format json or text", param="stream"
            )
        events = await until_disconnect(request, speech.transcribe_stream(model, data, **args))
        return sse_response(_transcript_events(events))
    t = await until_disconnect(request, speech.transcribe(model, data, words=words, **args))
    return _reply(t, fmt, segments="segment" in (granularities or ["segment"]))


async def _transcript_events(events: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[str]:
    try:
        async for kind, value in events:
            if kind == "delta":
                yield sse({"type": "transcript.text.delta", "delta": value})
            else:
                yield sse(
                    {"type": "transcript.text.done", "text": value.text, "usage": _usage(value)}
                )
    except MlxdError as exc:
        yield sse(error_payload(exc))


Granularities = Annotated[list[str] | None, Form(alias="timestamp_granularities[]")]


@uploads.post(
    "/v1/audio/transcriptions",
    responses=ok(
        Transcription | VerboseTranscription,
        (SSE, "transcript.text.delta / transcript.text.done events"),
    ),
)
async def transcriptions(
    request: Request,
    file: Annotated[UploadFile, File(description="The audio (wav, mp3, flac, ogg, m4a, webm...)")],
    model: Annotated[ModelName | None, Form()] = None,
    language: Annotated[str | None, Form()] = None,
    prompt: Annotated[str | None, Form()] = None,
    response_format: Annotated[TranscriptFormat, Form()] = "json",
    temperature: Annotated[float, Form()] = 0.0,
    timestamp_granularities: Granularities = None,
    stream: Annotated[bool, Form()] = False,
    keep_alive: Annotated[
        str | None,
        Form(
            description="mlxd/Ollama extension: how long the model stays loaded after this request"
        ),
    ] = None,
) -> Response:
    return await _transcribe(
        request,
        "transcribe",
        file,
        model,
        language,
        prompt,
        response_format,
        temperature,
        timestamp_granularities,
        stream,
        keep_alive,
    )


@uploads.post("/v1/audio/translations", responses=ok(Transcription))
async def translations(
    request: Request,
    file: Annotated[UploadFile, File(description="The audio (wav, mp3, flac, ogg, m4a, webm...)")],
    model: Annotated[ModelName | None, Form()] = None,
    prompt: Annotated[str | None, Form()] = None,
    response_format: Annotated[TranscriptFormat, Form()] = "json",
    temperature: Annotated[float, Form()] = 0.0,
    keep_alive: Annotated[str | None, Form()] = None,
) -> Response:
    return await _transcribe(
        request,
        "translate",
        file,
        model,
        None,
        prompt,
        response_format,
        temperature,
        None,
        False,
        keep_alive,
    )


@router.post(
    "/v1/audio/speech",
    responses={
        200: {
            "content": {
                t: {"schema": {"type": "string", "format": "binary"}} for t in MEDIA_TYPES.values()
            }
        }
    },
)
async def speech(request: Request, body: SpeechBody) -> Response:
    fmt = body.response_format
    name, chunks = await until_disconnect(
        request,
        runtime(request).speech.speak(
            body.model,
            body.input,
            voice=body.voice,
            fmt=fmt,
            speed=body.speed,
            keep_alive=body.keep_alive,
        ),
    )
    if body.stream_format == "sse":
        return sse_response(_speech_events(chunks))
    return DisconnectAwareStream(
        chunks, media_type=MEDIA_TYPES[fmt], headers={"X-Model": name, "Cache-Control": "no-cache"}
    )


async def _speech_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    try:
        async for c in chunks:
            yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(c).decode()})
        yield sse({"type": "speech.audio.done", "usage": {}})
    except MlxdError as exc:
        yield sse(error_payload(exc))
