"""Who a request acts for, and so who owns what it stores.

:class:`mlxd.api.security.SecurityMiddleware` puts a :class:`Principal` in the request state
(``principal``) for every caller it lets in: with API keys, the matched key's; with none
configured, :data:`LOCAL_OPERATOR` (one owner, the local operator). Whatever a caller
stores (stored responses today) is tagged with ``principal.owner`` and answers only to it:
another key's object is "not found", exactly like a missing one, so its existence never
leaks. ``admin`` widens only what a key may *audit* (the web UI's request log), never whose
objects it may read or change.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from mlxd.core.types import DEFAULT_PRIORITY

LOCAL_OWNER = "local"


def owner_id(digest: bytes) -> str:
    """A key's stable owner id: a hash of its SHA-256 digest under a label of its own.

    Not the key's name (two configurations may give one name to different keys), not the
    key, and not the digest compared at the door (the id may be logged or persisted)."""
    return hashlib.sha256(b"mlxd-owner:" + digest).hexdigest()[:32]


@dataclass(frozen=True)
class Principal:
    """The caller a request acts for."""

    owner: str
    admin: bool = False
    name: str | None = None
    priority: int = DEFAULT_PRIORITY  # the default of its requests (lower runs first)
    weight: float = 1.0  # its share of an engine among keys waiting at one priority

    def owns(self, owner: str | None) -> bool:
        """May read, continue or delete an object stored by ``owner``."""
        return bool(owner) and owner == self.owner

    def may_audit(self, owner: str | None) -> bool:
        """May see a record (the request log's) of a request made by ``owner``."""
        return self.admin or self.owns(owner)


# No keys configured: every caller is the one local operator, who sees everything.
LOCAL_OPERATOR = Principal(LOCAL_OWNER, admin=True)
# A request the middleware did not admit as anyone (a public route without a key).
NOBODY = Principal("", admin=False)


def principal(request: Any) -> Principal:
    """The request's principal (a Starlette Request); :data:`NOBODY` where none was set,
    so that a route reached without one owns nothing and sees nothing."""
    found = getattr(request.state, "principal", None)
    return found if isinstance(found, Principal) else NOBODY
