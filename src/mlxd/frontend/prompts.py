"""What a front end checks and builds before a request goes to the engine core: operator
limits, images, the prompt's tokens and grammar, and the sampling parameters fitted to the
model's context. Pure functions of the settings, the model's facts and the request."""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import replace
from typing import Any

from mlxd.config import Settings
from mlxd.core.errors import ContextLengthExceeded, InvalidRequest, PayloadTooLarge
from mlxd.core.types import AudioInput, GenerateRequest, SamplingParams
from mlxd.enginecore import protocol as p


def check_limits(settings: Settings, req: GenerateRequest) -> None:
    """Operator limits (security.max_tokens_limit, max_inputs): 400 before any work."""
    sec = settings.security
    n = req.sampling.max_tokens
    if sec.max_tokens_limit is not None and n is not None and n > sec.max_tokens_limit:
        raise InvalidRequest(
            f"max_tokens is {n}, more than this server allows ({sec.max_tokens_limit})",
            param="max_tokens",
        )
    if req.messages is not None and len(req.messages) > sec.max_inputs:
        raise InvalidRequest(
            f"{len(req.messages)} messages, more than this server allows ({sec.max_inputs})",
            param="messages",
        )


def check_images(settings: Settings, name: str, kind: str | None, req: GenerateRequest) -> None:
    """400 for too many images or audio clips, or either to a model known not to take
    them (no load, nothing decoded yet)."""
    images = req.images or []
    limit = settings.vision.max_images_per_request
    if len(images) > limit:
        raise InvalidRequest(
            f"{len(images)} images, more than this server accepts in one request ({limit})",
            param=_field(images[limit].param),
        )
    clips = req.audio or []
    limit = settings.audio.max_clips_per_request
    if len(clips) > limit:
        raise InvalidRequest(
            f"{len(clips)} audio clips, more than this server accepts in "
            f"one request ({limit}; audio.max_clips_per_request)",
            param=clips[limit].param,
        )
    if kind is not None and kind != "vision":
        media = images or req.audio or []
        what = "images" if images else "audio"
        raise InvalidRequest(
            f"model '{name}' does not accept {what} (it is not a vision model)",
            param=_field(media[0].param),
        )


def check_text_only_features(name: str, req: GenerateRequest) -> None:
    """Tools and structured output need a text engine: never silently ignored."""
    if req.constraint is not None:
        raise InvalidRequest(
            f"model '{name}' does not support structured output yet", param="response_format"
        )
    if req.tools and req.tool_choice != "none":
        raise InvalidRequest(f"model '{name}' does not support tools yet", param="tools")


async def vision_input(
    settings: Settings, name: str, kind: str, req: GenerateRequest, sample_rate: int = 0
) -> p.VisionInput:
    """Images fetched to bytes and audio decoded to samples at the model's ``sample_rate``
    (0: the model takes no audio), so the core gets media it only has to process."""
    if kind != "vision":
        media = req.images or req.audio or []
        what = "images" if req.images else "audio"
        raise InvalidRequest(
            f"model '{name}' does not accept {what} (it is not a vision model)",
            param=_field(media[0].param),
        )
    from mlxd.core.images import image_bytes

    vs = settings.vision
    refs = req.images or []
    data = [await asyncio.to_thread(image_bytes, ref, vs) for ref in refs]
    clips = req.audio or []
    if clips and sample_rate <= 0:
        raise InvalidRequest(
            f"model '{name}' does not accept audio (it has no audio encoder)",
            param=_field(clips[0].param),
        )
    audio = [await asyncio.to_thread(audio_samples, settings, clip, sample_rate) for clip in clips]
    return p.VisionInput(
        messages=req.messages,
        prompt=req.prompt,
        prompt_tokens=req.prompt_tokens,
        images=data,
        image_params=[r.param for r in refs],
        template_kwargs=req.template_kwargs,
        audio=audio,
        audio_params=[c.param for c in clips],
    )


def audio_samples(settings: Settings, clip: AudioInput, rate: int) -> bytes:
    """One ``input_audio`` clip as mono float32 samples at ``rate`` (little-endian bytes):
    413 past audio.max_upload_bytes or audio.max_duration_s, 400 for bad base64 or audio."""
    from mlxd.frontend.audio import decode_audio

    limit = settings.audio.max_upload_bytes
    if len(clip.data) // 4 * 3 > limit:
        raise PayloadTooLarge(
            f"the audio is larger than this server accepts ({limit} bytes; audio.max_upload_bytes)",
            param=clip.param,
        )
    try:
        raw = base64.b64decode(clip.data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest("input_audio.data is not valid base64", param=clip.param) from exc
    samples = decode_audio(raw, rate, max_seconds=settings.audio.max_duration_s, param=clip.param)
    return samples.astype("<f4", copy=False).tobytes()


def tokenize_and_prepare(proc: Any, req: GenerateRequest) -> tuple[list[int], Any]:
    tokens = proc.tokenize(req)
    return tokens, proc.prepare(req, tokens)


def fit_to_context(
    settings: Settings, info: p.ModelInfo, req: GenerateRequest, n_prompt: int
) -> SamplingParams:
    ctx = info.context_length or 4096
    sp = req.sampling
    if n_prompt >= ctx:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens, but the prompt has "
            f"{n_prompt} tokens.",
            param="messages" if req.messages is not None else "prompt",
        )
    vocab = info.vocab_size
    if sp.logit_bias and vocab and any(not 0 <= t < vocab for t in sp.logit_bias):
        raise InvalidRequest(
            "logit_bias names a token id outside the vocabulary", param="logit_bias"
        )
    room = ctx - n_prompt
    cap = settings.security.max_tokens_limit or room
    if sp.max_tokens is None:
        return replace(sp, max_tokens=min(settings.engine.default_max_tokens, room, cap))
    if sp.max_tokens < 0:  # "until the context is full"
        return replace(sp, max_tokens=min(room, cap))
    if sp.max_tokens > room:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{n_prompt + sp.max_tokens} tokens ({n_prompt} in the prompt, {sp.max_tokens} "
            "for the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
        )
    return sp


def _field(param: str) -> str:
    """``messages[0].content[1]`` -> ``messages[0].content``: the field, for 'wrong model'."""
    return param[: param.rindex("[")] if param.endswith("]") and "[" in param else param
