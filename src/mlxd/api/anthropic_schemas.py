"""Anthropic Messages wire schemas (the subset mlxd serves) and their translation to core
types: content blocks -> chat-template messages, tools -> OpenAI function tools."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from mlxd.api.tooling import check_call, function_tool, tool_names
from mlxd.api.wire import (
    CacheSalt,
    KeepAlive,
    MaxTokens,
    ModelName,
    Priority,
    Temperature,
    TopP,
    WireModel,
)
from mlxd.core.errors import InvalidRequest
from mlxd.core.types import ImageInput, SamplingParams


class _Req(WireModel):
    pass


class AnthropicMessage(_Req):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(_Req):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" (or absent); server tools are not served


class MessagesBase(_Req):
    model: ModelName = "default"
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", ...}}
    keep_alive: KeepAlive = None  # mlxd extension (Ollama semantics)

    def template_messages(self, images: list[ImageInput] | None = None) -> list[dict[str, Any]]:
        """Chat-template messages; image blocks become ``{"type": "image"}`` parts, their
        sources appended to ``images`` in order (only vision models accept them)."""
        out: list[dict[str, Any]] = []
        system = _text_of(self.system, "system") if self.system is not None else ""
        if system:
            out.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            where = f"messages[{i}].content"
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            texts: list[str] = []
            parts: list[dict[str, Any]] = []  # in order, when the message has images
            calls: list[dict] = []
            for j, block in enumerate(m.content):
                kind = block.get("type")
                if kind == "text":
                    texts.append(str(block.get("text", "")))
                    parts.append({"type": "text", "text": texts[-1]})
                elif kind == "image":
                    if images is None:
                        raise InvalidRequest("this model does not accept images", param=where)
                    images.append(
                        ImageInput(_image_source(block, f"{where}[{j}]"), f"{where}[{j}]")
                    )
                    parts.append({"type": "image"})
                elif kind == "tool_use" and m.role == "assistant":
                    args = block.get("input")
                    if args is not None and not isinstance(args, dict):
                        raise InvalidRequest(
                            f"{where}[{j}].input must be an object", param=f"{where}[{j}].input"
                        )
                    if not isinstance(block.get("id", ""), str):
                        raise InvalidRequest(
                            f"{where}[{j}].id must be a string", param=f"{where}[{j}].id"
                        )
                    calls.append(
                        {
                            "id": block.get("id") or "",
                            "type": "function",
                            "function": check_call(block.get("name"), args, f"{where}[{j}]"),
                        }
                    )
                elif kind == "tool_result" and m.role == "user":
                    out.append(
                        {
                            "role": "tool",
                            "tool_call_id": block.get("tool_use_id", ""),
                            "content": _text_of(block.get("content", ""), where),
                        }
                    )
                elif kind in ("thinking", "redacted_thinking"):
                    continue  # earlier reasoning is not sent back to the model
                else:
                    raise InvalidRequest(
                        f"unsupported content block type '{kind}' in a {m.role} message",
                        param=where,
                    )
            if parts or calls or not any(b.get("type") == "tool_result" for b in m.content):
                has_image = any(p["type"] == "image" for p in parts)
                msg: dict[str, Any] = {
                    "role": m.role,
                    "content": parts if has_image else "".join(texts),
                }
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
        return out

    def openai_tools(self) -> list[dict] | None:
        if not self.tools:
            return None
        tools = []
        for i, t in enumerate(self.tools):
            if t.type not in (None, "custom"):
                raise InvalidRequest(
                    f"tools[{i}]: server tools ('{t.type}') are not supported", param=f"tools[{i}]"
                )
            tools.append(
                function_tool(
                    t.name,
                    t.description,
                    t.input_schema or {"type": "object", "properties": {}},
                    param=f"tools[{i}]",
                )
            )
        return tools

    def choice(self, tools: list[dict] | None) -> tuple[tuple[str, str | None], bool | None]:
        """((tool choice, name), parallel) from ``tool_choice``."""
        tc = self.tool_choice
        if not tc:
            return ("auto", None), None
        parallel = False if tc.get("disable_parallel_tool_use") else None
        kind = tc.get("type")
        if kind == "auto":
            return ("auto", None), parallel
        if kind == "none":
            return ("none", None), parallel
        if kind == "any":
            if not tools:
                raise InvalidRequest("tool_choice 'any' needs tools", param="tool_choice")
            return ("required", None), parallel
        if kind == "tool":
            name = tc.get("name")
            if name not in tool_names(tools):
                raise InvalidRequest(
                    f"tool_choice names '{name}', which is not among the tools", param="tool_choice"
                )
            return ("function", name), parallel
        raise InvalidRequest(f"unknown tool_choice type '{kind}'", param="tool_choice")

    def template_kwargs(self) -> dict | None:
        if not self.thinking:
            return None
        return {"enable_thinking": self.thinking.get("type") == "enabled"}

    def thinking_budget(self) -> int | None:
        """``thinking.budget_tokens`` when thinking is enabled; 0 when it is disabled (a
        template that opens a thinking part anyway gets it closed at once)."""
        if not self.thinking:
            return None
        kind = self.thinking.get("type")
        if kind == "disabled":
            return 0
        if kind != "enabled":
            raise InvalidRequest(
                "thinking.type must be 'enabled' or 'disabled'", param="thinking.type"
            )
        n = self.thinking.get("budget_tokens")
        if n is None:
            return None
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidRequest(
                "thinking.budget_tokens must be a whole number >= 0",
                param="thinking.budget_tokens",
            )
        return n


class MessagesRequest(MessagesBase):
    max_tokens: MaxTokens
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Temperature | None = Field(None, le=1.0)
    top_p: TopP | None = None
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    cache_salt: CacheSalt = None
    priority: Priority | None = None  # vLLM's, as on the OpenAI routes

    def sampling(self) -> SamplingParams:
        stops = tuple(s for s in (self.stop_sequences or []) if s)
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=stops,
        )

    @property
    def user(self) -> str | None:
        uid = (self.metadata or {}).get("user_id")
        return str(uid) if uid is not None else None


class CountTokensRequest(MessagesBase):
    pass


def _image_source(block: dict[str, Any], param: str) -> str:
    """An image block's source as a ``data:`` URL (base64) or its URL."""
    src = block.get("source") or {}
    if src.get("type") == "base64" and isinstance(src.get("data"), str):
        return f"data:{src.get('media_type') or 'image/png'};base64,{src['data']}"
    if src.get("type") == "url" and isinstance(src.get("url"), str):
        return src["url"]
    raise InvalidRequest("an image block needs a base64 or url source", param=param)


def _text_of(content: Any, where: str) -> str:
    """A system prompt or tool result: a string or a list of text blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, dict) and block.get("type") == "text":
                parts.append(str(block.get("text", "")))
            elif isinstance(block, dict) and block.get("type") == "image":
                raise InvalidRequest("this model does not accept images", param=where)
            else:
                parts.append(json.dumps(block) if not isinstance(block, str) else block)
        return "".join(parts)
    return json.dumps(content)
