"""How every route reads its JSON body: whatever the Content-Type, and never into a 500.

Ollama's and TEI's documented ``curl`` calls send no JSON content type (``curl -d`` sends
``application/x-www-form-urlencoded``), and FastAPI only parses a body as JSON when the
header says so: the route then answered 400 "Input should be a valid dictionary" while
others, which parsed their own body, accepted it. :class:`JSONBodyRoute` is the one way:
every router uses it, the route keeps its pydantic body parameter (so validation and the
OpenAPI request-body documentation stay FastAPI's), and the route class makes the body read
as JSON before FastAPI looks at it.

It also refuses two bodies that used to fail later with a 500:

* nesting deeper than :data:`MAX_DEPTH` (5,000 nested arrays made Python's parser raise
  RecursionError; shallower but deep bodies can still exhaust the stack of code that walks
  a JSON schema or a tool's arguments);
* a lone UTF-16 surrogate (``"a\\ud800b"``): valid JSON syntax, but not text any tokenizer
  or UTF-8 encoder accepts.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.routing import APIRoute
from starlette.types import Message, Receive, Scope, Send

from mlxd.core.errors import InvalidRequest

MAX_DEPTH = 128  # arrays and objects inside each other; OpenAI tool schemas need far fewer

# A surrogate escape (\uD800-\uDFFF) or surrogate code point encoded as UTF-8 bytes (Python's
# parser accepts both): only then is the decoded body searched for an unpaired one.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of decoded JSON, counted without recursion, stopping past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def _has_lone_surrogate(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_json_body(raw: bytes) -> None:
    """Raise InvalidRequest for a body nested too deep or carrying a lone surrogate.

    The body is decoded here only when a cheap look at the bytes says it might be one of
    those (more brackets than the limit, or a surrogate escape); invalid JSON is left to
    FastAPI, which reports it as such.
    """
    deep = raw.count(b"[") + raw.count(b"{") > MAX_DEPTH
    if not deep and not _MAYBE_SURROGATE.search(raw):
        return
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidRequest(
            f"the request body nests arrays and objects deeper than {MAX_DEPTH} levels"
        ) from None
    except ValueError:
        return
    if deep and _depth(data, MAX_DEPTH) > MAX_DEPTH:
        raise InvalidRequest(
            f"the request body nests arrays and objects deeper than {MAX_DEPTH} levels"
        )
    if _has_lone_surrogate(data):
        raise InvalidRequest(
            "the request body contains a lone UTF-16 surrogate "
            "(\\ud800-\\udfff without its pair), which is not text"
        )


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break  # the client left; FastAPI sees an empty body
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


class JSONBodyRoute(APIRoute):
    """An APIRoute whose body is JSON whatever the Content-Type (see the module docstring).

    The body is read once, checked, and handed to FastAPI with ``application/json`` as its
    type; after it, ``receive`` is the client's again (disconnect detection relies on it).
    """

    json_body = True  # False: a multipart form route (file uploads) reads its own body

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.json_body or self.body_field is None or scope["type"] != "http":
            await super().handle(scope, receive, send)
            return
        raw = await _read_body(receive)
        check_json_body(raw)
        scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        scope["headers"].append((b"content-type", b"application/json"))
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await super().handle(scope, replay, send)
