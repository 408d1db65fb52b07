"""The route class every mlxd router uses: one way to read bodies (api/body.py) and one
way to document errors (api/docs.py)."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any, TypedDict

from fastapi.datastructures import DefaultPlaceholder
from pydantic import BaseModel

from mlxd.api.body import JSONBodyRoute
from mlxd.api.docs import error_responses
from mlxd.api.security import ALWAYS_PUBLIC


class RouteOptions(TypedDict, total=False):
    """Route keyword arguments that several routes share, spread with ``**``."""

    include_in_schema: bool


class ApiRoute(JSONBodyRoute):
    """A route whose OpenAPI entry lists the errors it can answer, in its dialect's shape
    (a route's own ``responses`` win), and never FastAPI's 422: validation is a 400 here."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        body = takes_body(endpoint) or not self.json_body  # form routes always take a body
        errors = error_responses(path, body, public=path in ALWAYS_PUBLIC)
        kwargs["responses"] = {**errors, **(kwargs.get("responses") or {})}
        if isinstance(kwargs.get("response_model"), DefaultPlaceholder):
            # documented bodies come from `responses`; a return annotation is for mypy only
            kwargs["response_model"] = None
        super().__init__(path, endpoint, **kwargs)


def _is_model(t: Any) -> bool:
    if isinstance(t, type):
        return issubclass(t, BaseModel)
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return any(_is_model(a) for a in typing.get_args(t))
    return False


def takes_body(endpoint: Callable[..., Any]) -> bool:
    """Whether the handler has a pydantic body parameter (FastAPI reads one from the body)."""
    hints = typing.get_type_hints(endpoint, include_extras=False)
    return any(_is_model(t) for name, t in hints.items() if name != "return")


class UploadRoute(ApiRoute):
    """An ApiRoute whose body is a multipart form (file uploads): FastAPI parses it."""

    json_body = False
