"""Tool calls and thinking in generated text: the model family's syntax, parsed as it streams.

mlx-lm knows each family's tool-call syntax (``mlx_lm/tool_parsers/``: the start and end
markers and a parser for the text between them) and its thinking markers; its
``TokenizerWrapper`` picks them from the chat template and vocabulary. This module is the
streaming side: :class:`OutputSplitter` turns the text of one sequence into answer text,
reasoning text and parsed calls, holding back only text that could still become a marker.

A model whose tokenizer names no tool parser gets the Hermes/Qwen2.5 syntax
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) and, when its chat template
does not render tools itself, a system prompt that describes them (:func:`fallback_messages`).

Pure Python: nothing here touches MLX, so it may run on any thread.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlxd.core.types import ToolCall

log = logging.getLogger(__name__)

#: Families whose text between the markers is one JSON object {"name", "arguments"}: the
#: grammar engine can then constrain a whole call (name and arguments schema).
JSON_FORMATS = frozenset({"json_tools", "fallback"})


def _parse_json_call(text: str, tools: Any = None) -> Any:
    return json.loads(text.strip())


@dataclass(frozen=True)
class ToolFormat:
    name: str  # the mlx-lm parser module ("json_tools", "qwen3_coder", ...) or "fallback"
    start: str
    end: str  # "" when a call runs to the end of the output (mistral)
    parse: Callable[[str, Any], Any]
    native: bool  # the chat template renders tools (and tool calls) itself

    @property
    def json_body(self) -> bool:
        return self.name in JSON_FORMATS


def tool_format(tokenizer: Any) -> ToolFormat:
    """The tool-call syntax of ``tokenizer`` (an mlx-lm TokenizerWrapper)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(v) for v in template.values())
    native = isinstance(template, str) and "tools" in template
    if getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_parser is not None:
        parser = tokenizer.tool_parser
        name = getattr(parser, "__module__", "").rsplit(".", 1)[-1] or "custom"
        return ToolFormat(
            name, tokenizer.tool_call_start, tokenizer.tool_call_end or "", parser, native
        )
    return ToolFormat("fallback", "<tool_call>", "</tool_call>", _parse_json_call, native)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _arguments_text(args: Any) -> str:
    if isinstance(args, str):
        try:
            json.loads(args)
            return args
        except ValueError:
            return json.dumps(args, ensure_ascii=False)
    return json.dumps({} if args is None else args, ensure_ascii=False)


def parse_calls(fmt: ToolFormat, text: str, tools: list[dict] | None) -> list[ToolCall] | None:
    """The calls in the text between one pair of markers; None if it does not parse."""
    try:
        parsed = fmt.parse(text, tools)
    except Exception as exc:  # noqa: BLE001 - parsers raise ValueError, JSONDecodeError...
        log.info("unparseable tool call (%s: %s): %.200r", type(exc).__name__, exc, text)
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        out.append(
            ToolCall(
                id=item.get("id") or new_call_id(),
                name=item["name"],
                arguments=_arguments_text(item.get("arguments")),
            )
        )
    return out or None


class OutputSplitter:
    """Splits one sequence's streamed text into (answer, reasoning, tool calls).

    ``think`` is the model's (start, end) thinking markers, ``reasoning`` whether the output
    starts inside a thinking part (the prompt opened one); ``fmt`` the tool syntax when
    tools are enabled for this request. Whitespace-only answer text is held until more
    answer text follows (it is dropped if the model called tools, and after a thinking part
    or a call the answer's leading whitespace is dropped), so a tool-calling turn does not
    come back with a stray newline as its content.
    """

    def __init__(
        self,
        *,
        think: tuple[str, str] | None = None,
        reasoning: bool = False,
        fmt: ToolFormat | None = None,
        tools: list[dict] | None = None,
        parallel: bool = True,
    ) -> None:
        self.think = think if think and think[0] and think[1] else None
        self.fmt = fmt
        self.tools = tools
        self.parallel = parallel
        self.state = "reasoning" if (reasoning and self.think) else "content"
        self._buf = ""
        self._tool_text = ""
        self._ws = ""  # whitespace-only answer text held back
        self._lstrip = self.state == "reasoning"
        self.calls: list[ToolCall] = []

    @property
    def active(self) -> bool:
        return self.think is not None or self.fmt is not None

    def _markers(self) -> list[tuple[str, str]]:
        if self.state == "reasoning":
            return [(self.think[1], "content")] if self.think else []
        if self.state == "tool":
            return [(self.fmt.end, "content")] if self.fmt and self.fmt.end else []
        out = []
        if self.think:
            out.append((self.think[0], "reasoning"))
        if self.fmt and (self.parallel or not self.calls):
            out.append((self.fmt.start, "tool"))
        return out

    def feed(self, text: str) -> tuple[str, str, list[ToolCall]]:
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        self._buf += text
        while self._buf:
            markers = self._markers()
            hit, marker, nxt = -1, "", ""
            for m, to in markers:
                i = self._buf.find(m)
                if i != -1 and (hit == -1 or i < hit):
                    hit, marker, nxt = i, m, to
            if hit == -1:
                keep = _held(self._buf, [m for m, _ in markers])
                cut = len(self._buf) - keep
                self._emit(self._buf[:cut], content, reasoning)
                self._buf = self._buf[cut:]
                break
            self._emit(self._buf[:hit], content, reasoning)
            self._buf = self._buf[hit + len(marker) :]
            was, parsed = self.state, []
            if was == "tool":
                parsed = self._finish_call(content)
                calls.extend(parsed)
            self.state = nxt
            if nxt == "content" and (was == "reasoning" or parsed):
                self._lstrip = True
        return "".join(content), "".join(reasoning), calls

    def flush(self, cut: bool = False) -> tuple[str, str, list[ToolCall]]:
        """At the end of generation: held text, and a call whose end marker never came.

        ``cut``: the length limit ended the output. A call it cut short is incomplete:
        neither a call nor answer text (its markup would leak), and a held beginning of
        the call marker is dropped with it."""
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        fmt = self.fmt
        if not (
            cut
            and fmt is not None
            and self.state == "content"
            and self._buf
            and fmt.start.startswith(self._buf)
        ):
            self._emit(self._buf, content, reasoning)
        self._buf = ""
        if self.state == "tool":
            assert fmt is not None
            if cut and fmt.end:  # cut before its end marker
                self._tool_text = ""
            else:
                calls.extend(self._finish_call(content, final=True, drop=cut))
            self.state = "content"
        if self._ws and not (self.calls or calls):
            content.append(self._ws)
        self._ws = ""
        return "".join(content), "".join(reasoning), calls

    def _emit(self, text: str, content: list[str], reasoning: list[str]) -> None:
        if not text:
            return
        if self.state == "reasoning":
            reasoning.append(text)
        elif self.state == "tool":
            self._tool_text += text
        else:
            if self._lstrip:
                text = text.lstrip()
                if not text:
                    return
                self._lstrip = False
            body = text.rstrip()
            if not body:
                self._ws += text
                return
            # trailing whitespace waits: it is dropped if a call follows
            content.append(self._ws + body)
            self._ws = text[len(body) :]

    def _finish_call(
        self, out: list[str], final: bool = False, drop: bool = False
    ) -> list[ToolCall]:
        """Parse the collected call text; text that is no call goes to ``out`` (the answer),
        unless ``drop``."""
        raw, self._tool_text = self._tool_text, ""
        assert self.fmt is not None
        calls = parse_calls(self.fmt, raw, self.tools)
        if calls is None and drop:
            return []
        if calls is None:
            out.append(self._ws + self.fmt.start + raw + ("" if final else self.fmt.end))
            self._ws = ""
            return []
        if not self.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]
        self.calls.extend(calls)
        return calls


def _held(buf: str, markers: list[str]) -> int:
    """Length of the longest suffix of ``buf`` that could still begin a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:n]):
                best = n
                break
    return best


def template_messages(messages: list[dict]) -> list[dict]:
    """Earlier tool calls as chat templates expect them: ``arguments`` as a mapping (the
    OpenAI wire carries a JSON string; templates write ``arguments | tojson``)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for tc in calls:
                tc = dict(tc)
                fn = dict(tc.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        pass
                tc["function"] = fn
                fixed.append(tc)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


# -- the fallback for chat templates that know no tools ----------------------------------------

FALLBACK_SYSTEM = (
    "You can call functions. The available functions, as JSON schemas:\n<tools>\n{tools}\n"
    "</tools>\nTo call a function, answer with one JSON object per call inside tags:\n"
    '<tool_call>\n{{"name": "<function-name>", "arguments": {{<arguments>}}}}\n</tool_call>'
)


def fallback_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """For a template without tool support: tools described in the system prompt, earlier
    calls written in the fallback syntax, tool results as user turns."""
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            parts = [m.get("content") or ""]
            for tc in m.pop("tool_calls"):
                fn = tc.get("function", tc)
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        pass
                parts.append(
                    "<tool_call>\n"
                    + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
                    + "\n</tool_call>"
                )
            m["content"] = "\n".join(p for p in parts if p)
        elif m.get("role") == "tool":
            m = {
                "role": "user",
                "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>",
            }
        out.append(m)
    if tools:
        desc = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        text = FALLBACK_SYSTEM.format(tools=desc)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}".strip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
