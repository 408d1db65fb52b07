"""The web dashboard and playground: static files served by mlxd itself (api/ui.py).

The page (``static/``) is plain ES modules with two vendored libraries (``static/vendor/``,
see VENDORED.md there): no build step, no Node at run time, nothing fetched from a CDN, so
it works offline and the wheel carries it as package data.

Which paths belong to the UI is decided here, for the layers that must know without
importing the UI's router: the security middleware lets the page's own files load without
a key (the data they fetch needs one), and the access history leaves the UI's own polling
out of the request list and the charts.
"""

from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).parent / "static"

# The page and its files: public (they hold no data). /ui/api/* is not among them.
PAGE_PATHS = frozenset({"/", "/ui", "/ui/"})
STATIC_PREFIX = "/ui/static/"


def is_public_ui_path(path: str) -> bool:
    return path in PAGE_PATHS or path.startswith(STATIC_PREFIX)


def is_ui_route(route: str) -> bool:
    """The UI's own routes (the page, its files, its data), by path or route template."""
    return route in PAGE_PATHS or route.startswith("/ui/")
