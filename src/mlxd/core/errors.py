"""Errors with stable codes; each dialect renders them in its own wire shape."""

from __future__ import annotations


class MlxdError(Exception):
    """Base error. ``status`` is the HTTP status that tells the truth about the failure."""

    status: int = 500
    code: str = "internal_error"
    type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}


class InvalidRequest(MlxdError):
    status = 400
    code = "invalid_request"
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class TemplateTimeout(InvalidRequest):
    """The prompt's chat template did not finish rendering within server.template_timeout_s:
    the messages (or the template they meet) are too expensive to render."""

    code = "template_timeout"


class GrammarError(InvalidRequest):
    """The grammar engine could not follow the request's schema or grammar while generating
    (a resource limit of llguidance): what was generated is no valid answer."""

    code = "grammar_error"


class ModelNotFound(MlxdError):
    status = 404
    code = "model_not_found"
    type = "invalid_request_error"


class QueueFull(MlxdError):
    status = 429
    code = "queue_full"
    type = "rate_limit_error"


class Unavailable(MlxdError):
    status = 503
    code = "service_unavailable"
    type = "server_error"


class ModelUnusable(InvalidRequest):
    """The name exists where it points (a hub repository), but holds no model this server
    can serve (no config.json, no safetensors weights)."""

    code = "model_unusable"


class UpstreamUnavailable(MlxdError):
    """A source this server fetches from (the model hub, a package index) could not be
    reached or answered wrongly: a bad gateway, neither the caller's fault nor this
    server's."""

    status = 502
    code = "upstream_unavailable"
    type = "server_error"


class UpstreamTimeout(UpstreamUnavailable):
    status = 504
    code = "upstream_timeout"


class HubOffline(Unavailable):
    """This server is set not to reach the hub (``HF_HUB_OFFLINE``): what is not on this
    machine cannot be fetched."""

    code = "hub_offline"


class NotInstalled(MlxdError):
    """The request is fine, but this server lacks the optional part that serves it (an
    extra such as ``mlxd[audio]``): the operator's to fix, not the caller's."""

    status = 501
    code = "not_installed"
    type = "server_error"


class ModelLoadError(MlxdError):
    status = 500
    code = "model_load_failed"
    type = "server_error"


class EngineError(MlxdError):
    status = 500
    code = "engine_error"
    type = "server_error"


class InsufficientStorage(MlxdError):
    """The model alone is larger than the memory budget: no eviction can make it fit."""

    status = 507
    code = "model_too_large"
    type = "server_error"


class ShuttingDown(Unavailable):
    """The server drains (SIGTERM): the same code whether the request met the drain at the
    door (api/middleware.py) or a moment later, on its way to the engine. One message and
    Retry-After for every place that refuses work while draining."""

    code = "shutting_down"
    MESSAGE = "the server is shutting down; retry on another instance"
    RETRY_AFTER = "5"

    def __init__(
        self, message: str = MESSAGE, *, param: str | None = None, headers: dict | None = None
    ):
        super().__init__(message, param=param, headers=headers or {"Retry-After": self.RETRY_AFTER})


class OutOfMemory(Unavailable):
    """The device ran out of memory for this request; the server itself keeps serving."""

    code = "out_of_memory"


class PayloadTooLarge(MlxdError):
    status = 413
    code = "request_too_large"
    type = "invalid_request_error"


class Forbidden(MlxdError):
    """A valid key that may not do this (an admin key's route)."""

    status = 403
    code = "forbidden"
    type = "permission_error"
