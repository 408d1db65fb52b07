"""OpenAI wire schemas (the subset mlxd serves) and their translation to SamplingParams."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator

from mlxd.api.tooling import check_tool_calls
from mlxd.api.wire import (
    CacheSalt,
    KeepAlive,
    LogitBias,
    MaxTokens,
    MinP,
    ModelName,
    Penalty,
    Priority,
    RepetitionPenalty,
    Seed,
    Temperature,
    TopP,
    WireModel,
    is_token_ids,
)
from mlxd.config import ReasoningEffort
from mlxd.core.errors import InvalidRequest
from mlxd.core.types import AudioInput, ImageInput, SamplingParams

Stop = str | Annotated[list[str], Field(max_length=4)] | None
TokenId = Annotated[int, Field(ge=0)]


class _Req(WireModel):
    pass


class StreamOptions(_Req):
    include_usage: bool = False


class SamplingFields(_Req):
    # OpenAI documents these nullable (null: the default); the rest default to None anyway
    NULL_IS_DEFAULT = frozenset({"n", "stream"})

    model: ModelName = "default"
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = Field(None, ge=-1, description="0 or -1 (vLLM's value): off.")
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    logit_bias: dict[str, LogitBias] | None = None
    stop: Stop = None
    n: int = Field(1, ge=1, le=64, description="Choices to generate, one sequence each.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    keep_alive: KeepAlive = Field(
        None, description="mlxd extension, Ollama semantics: how long the model stays loaded."
    )
    cache_salt: CacheSalt = None
    priority: Priority | None = None
    return_tokens_as_token_ids: bool = Field(
        False,
        description=(
            "vLLM extension: with logprobs, each token (and top alternative) is named "
            "'token_id:<id>' instead of its text, so that tokens whose text is not unique "
            "(byte pieces of one character) can be told apart."
        ),
    )

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if isinstance(v, list) and any(not s for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    def sampling(
        self, *, max_tokens: int | None, logprobs: bool, top_logprobs: int
    ) -> SamplingParams:
        bias: dict[int, float] | None = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise InvalidRequest(
                    "logit_bias keys must be token ids", param="logit_bias"
                ) from None
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            logit_bias=bias,
            stop=stop,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(WireModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


IMAGE_PART_TYPES = ("image_url", "input_image", "image")
AUDIO_PART_TYPES = ("input_audio", "audio", "audio_url")


def _image_source(part: ContentPart, param: str) -> str:
    """The URL or base64 of an image part: OpenAI's ``image_url`` (a string or
    ``{"url": ...}``), the Responses API's ``input_image``, or ``{"type": "image", "image"}``."""
    extra = part.model_extra or {}
    for key in ("image_url", "image", "url"):
        v = extra.get(key)
        if isinstance(v, dict):
            v = v.get("url")
        if isinstance(v, str) and v:
            return v
    raise InvalidRequest(
        "an image part needs an image_url (a data: URL, base64 or an http(s) URL)", param=param
    )


def _audio_part(part: ContentPart, param: str) -> tuple[str, str | None]:
    """``{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"}}``."""
    if part.type != "input_audio":
        raise InvalidRequest(
            f"audio content parts must be 'input_audio' with base64 data (got '{part.type}')",
            param=param,
        )
    body = (part.model_extra or {}).get("input_audio")
    if not isinstance(body, dict):
        body = {}
    data = body.get("data")
    if not isinstance(data, str) or not data:
        raise InvalidRequest(
            "an input_audio part needs input_audio.data (base64 audio)", param=param
        )
    fmt = body.get("format")
    return data, fmt if isinstance(fmt, str) else None


class ChatMessage(WireModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    NULL_IS_DEFAULT = SamplingFields.NULL_IS_DEFAULT | {"logprobs"}

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM extension: extra chat-template variables (enable_thinking...)."
    )
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="A thinking model's reasoning budget (engine.reasoning_effort_budgets)."
    )
    thinking_token_budget: int | None = Field(
        None,
        ge=0,
        description="vLLM's: reasoning tokens before the thinking part is closed (wins over "
        "reasoning_effort).",
    )

    def to_sampling(self) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs=true", param="top_logprobs")
        return self.sampling(
            max_tokens=self.max_completion_tokens or self.max_tokens,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
        )

    def _parts(self, types: Any) -> Iterator[tuple[Any, str]]:
        """Every message's content parts of ``types``, in order, each with its name."""
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if part.type in types:
                        yield part, f"messages[{i}].content[{j}]"

    def images(self) -> list[ImageInput] | None:
        """The images of every message, in order, each named by its message part."""
        out = [
            ImageInput(_image_source(part, param), param)
            for part, param in self._parts(IMAGE_PART_TYPES)
        ]
        return out or None

    def audio(self) -> list[AudioInput] | None:
        """The audio clips of every message, in order, each named by its message part."""
        out = [
            AudioInput(*_audio_part(part, param), param)
            for part, param in self._parts(AUDIO_PART_TYPES)
        ]
        return out or None

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as chat templates expect them: text content as a plain string.

        A message with images or audio keeps a list of ``{"type": "text", "text"}``,
        ``{"type": "image"}`` and ``{"type": "audio"}`` parts in order (the media
        themselves: :meth:`images`, :meth:`audio`); only vision models accept images, and
        only those with an audio tower audio (the runtime answers 400 for the others).
        """
        out = []
        for i, m in enumerate(self.messages):
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                texts, parts = [], []
                for part in m.content:
                    if part.type in ("text", "input_text") and part.text is not None:
                        texts.append(part.text)
                        parts.append({"type": "text", "text": part.text})
                    elif part.type in IMAGE_PART_TYPES:
                        parts.append({"type": "image"})
                    elif part.type in AUDIO_PART_TYPES:
                        parts.append({"type": "audio"})
                    else:
                        raise InvalidRequest(
                            f"unsupported content part type '{part.type}'",
                            param=f"messages[{i}].content",
                        )
                d["content"] = "".join(texts) if len(parts) == len(texts) else parts
            elif m.content is None:
                d["content"] = ""
            if d["role"] == "developer":
                d["role"] = "system"
            if "tool_calls" in d:
                d["tool_calls"] = check_tool_calls(d["tool_calls"], f"messages[{i}].tool_calls")
            out.append(d)
        return out


class CompletionRequest(SamplingFields):
    NULL_IS_DEFAULT = SamplingFields.NULL_IS_DEFAULT | {"echo"}

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=1)
    suffix: str | None = None

    def to_sampling(self) -> SamplingParams:
        if self.echo:
            raise InvalidRequest("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        return self.sampling(
            max_tokens=self.max_tokens,
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
        )

    def single_prompt(self) -> tuple[str | None, list[int] | None]:
        p = self.prompt
        if isinstance(p, list):
            if len(p) == 0:
                raise InvalidRequest("prompt must not be empty", param="prompt")
            if is_token_ids(p):
                return None, list(p)
            if len(p) != 1:
                raise InvalidRequest("only one prompt per request is supported", param="prompt")
            first = p[0]
            return (None, list(first)) if isinstance(first, list) else (first, None)
        return p, None


class GenerateBody(_Req):
    """The simple dialect: prompt in, text out."""

    prompt: str = Field(min_length=1)
    model: ModelName = "default"
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 0.7
    top_p: TopP = 1.0
    top_k: int | None = Field(None, ge=-1)
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    stop: Stop = None
    stream: bool = False
    chat: bool | None = Field(
        None,
        description="true: wrap the prompt in the model's chat template as one user "
        "turn (400 if it has none). Unset: the template when the model has one.",
    )
    raw: bool = Field(
        False, description="Send the prompt to the model as is, without the chat template."
    )
    keep_alive: KeepAlive = None
    cache_salt: CacheSalt = None
    priority: Priority | None = None

    def templated(self, model_has_template: bool) -> bool:
        """Whether the prompt goes through the chat template.

        By default yes when the model has one, as ``mlx_lm.generate`` and Ollama's
        /api/generate do: an instruction-tuned model given a bare prompt tends to answer
        with end-of-turn at once (an empty text).
        """
        if self.raw and self.chat:
            raise InvalidRequest("raw and chat exclude each other", param="raw")
        if self.raw or self.chat is False:
            return False
        return bool(self.chat) or model_has_template

    def to_sampling(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=stop,
        )
