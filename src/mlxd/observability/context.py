"""Per-request facts (model, tokens, key name) for the access log and the rate limiter.

The outermost ASGI middleware binds the request's ``scope["state"]`` dict here; anything
below it on the same request (a handler, the runtime's Generation, an encoder) records
facts with :func:`note` / :func:`add_usage` without knowing about HTTP. Tasks and async
generators started for the request inherit the binding (contextvars are copied into new
tasks, and the dict itself is shared), so streaming bodies report too.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any

_state: ContextVar[dict[str, Any] | None] = ContextVar("mlxd_request_state", default=None)


def bind(state: dict[str, Any]) -> Token:
    return _state.set(state)


def unbind(token: Token) -> None:
    _state.reset(token)


def current() -> dict[str, Any] | None:
    return _state.get()


def note(**facts: Any) -> None:
    """Record facts about the current request (no-op outside a request)."""
    st = _state.get()
    if st is not None:
        st.update(facts)


def add_usage(model: str | None, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
    """Add tokens to the current request's totals (a request may run several sequences)."""
    st = _state.get()
    if st is None:
        return
    if model:
        st["model"] = model
    st["prompt_tokens"] = st.get("prompt_tokens", 0) + int(prompt_tokens)
    st["completion_tokens"] = st.get("completion_tokens", 0) + int(completion_tokens)


def note_first(**facts: Any) -> None:
    """Record facts the request does not have yet (its first response id, first token)."""
    st = _state.get()
    if st is not None:
        for k, v in facts.items():
            st.setdefault(k, v)


def add_finish(reason: str) -> None:
    """A sequence of the current request ended for ``reason`` (several with ``n`` > 1)."""
    st = _state.get()
    if st is not None:
        st.setdefault("finish_reasons", []).append(reason)
