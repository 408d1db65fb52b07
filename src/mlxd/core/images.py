"""Images in requests: where they may come from, fetching (front ends) and decoding (the core).

Everything here blocks and runs in a thread (``asyncio.to_thread``): never on the event loop
and never on the device worker.

Sources (``vision.*`` settings bound each):

* ``data:image/...;base64,...`` URLs and raw base64: decoded, at most ``max_image_bytes``.
* ``http(s)://`` URLs, only with ``allow_remote_images``. The host is resolved once and the
  connection goes to the address that was checked (no DNS rebinding); loopback, private,
  link-local, multicast and reserved addresses are refused unless
  ``allow_private_addresses``, on every redirect hop too (at most ``max_redirects``).
  Connect and read time out after ``fetch_timeout_s``; the body stops at
  ``max_image_bytes``. No proxy, no cookies, no credentials.
* Local paths and ``file:`` URLs: always refused.

Decoding (Pillow) checks the pixel count from the header before decoding the pixels: beyond
``max_image_pixels`` the image is downscaled (``oversize_images: resize``, JPEGs decode at
reduced size directly) or refused. A broken image is a 400 naming its message part.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import math
import re
import socket
import ssl
import time
from typing import Any, Literal, Protocol
from urllib.parse import urljoin, urlsplit

from mlxd.core.errors import InvalidRequest
from mlxd.core.types import ImageInput


class VisionSettings(Protocol):
    """The ``vision.*`` settings read here (config.VisionSettings has them): core/ sits
    below config, so it names what it reads instead of importing the settings class."""

    allow_remote_images: bool
    allow_private_addresses: bool
    fetch_timeout_s: float
    max_redirects: int
    max_image_bytes: int
    max_image_pixels: int
    oversize_images: Literal["resize", "reject"]


_BASE64_CHARS = re.compile(r"^[A-Za-z0-9+/=_\-\s]+$")
_REDIRECTS = (301, 302, 303, 307, 308)
# An oversized image is decoded whole before it is shrunk (JPEG excepted: it decodes at a
# reduced scale); beyond this many pixels that costs too much memory, so it is refused.
_MAX_DECODE_PIXELS = 64_000_000


def image_bytes(ref: ImageInput, vs: VisionSettings) -> bytes:
    src, param = ref.source.strip(), ref.param
    if not src:
        raise InvalidRequest(f"{param}: the image is empty", param=param)
    low = src[:16].lower()
    if low.startswith("data:"):
        return _data_url(src, param, vs)
    if low.startswith(("http://", "https://")):
        if not vs.allow_remote_images:
            raise InvalidRequest(
                f"{param}: remote image URLs are not fetched by this server (vision."
                "allow_remote_images is off); send the image inline as a data: URL or base64",
                param=param,
            )
        return fetch_image(src, param, vs)
    if "://" in src[:16] or low.startswith("file:"):
        raise InvalidRequest(
            f"{param}: unsupported image URL scheme; use data:, base64 or http(s)", param=param
        )
    if _looks_like_path(src):
        raise InvalidRequest(
            f"{param}: local file paths are not accepted; send the image as a data: URL or base64",
            param=param,
        )
    data = _base64(src, param, vs)
    if data is None:
        raise InvalidRequest(
            f"{param}: the image is neither a data: URL, base64 nor an http(s) URL", param=param
        )
    return data


def _looks_like_path(s: str) -> bool:
    """A file path, not base64 (of the images, only JPEG's base64 starts with "/9j/")."""
    if s.startswith(("./", "../", "~", "\\")) or re.match(r"^[A-Za-z]:[\\/]", s):
        return True
    return s.startswith("/") and not s.startswith("/9j/") and len(s) < 4096


def _check_size(n: int, param: str, vs: VisionSettings) -> None:
    if n > vs.max_image_bytes:
        raise InvalidRequest(
            f"{param}: the image is larger than this server accepts ({vs.max_image_bytes} bytes)",
            param=param,
        )


def _base64(s: str, param: str, vs: VisionSettings) -> bytes | None:
    """The decoded bytes, or None when ``s`` is not base64 at all."""
    if not _BASE64_CHARS.match(s[:4096]):
        return None
    _check_size(len(s) * 3 // 4 - 4, param, vs)
    compact = "".join(s.split())
    compact += "=" * (-len(compact) % 4)
    try:
        if "-" in compact or "_" in compact:
            return base64.urlsafe_b64decode(compact)
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        return None


def _data_url(src: str, param: str, vs: VisionSettings) -> bytes:
    head, sep, payload = src.partition(",")
    if not sep:
        raise InvalidRequest(f"{param}: malformed data: URL (no comma)", param=param)
    if ";base64" not in head.lower():
        raise InvalidRequest(f"{param}: data: URLs must be base64 encoded", param=param)
    data = _base64(payload, param, vs)
    if data is None:
        raise InvalidRequest(f"{param}: the data: URL is not valid base64", param=param)
    return data


# -- remote fetch -------------------------------------------------------------------------------


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to the address that was checked, whatever DNS says a moment later."""

    def __init__(self, host: str, port: int, ip: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._ip = ip

    def connect(self) -> None:
        self.sock = socket.create_connection((self._ip, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, ip: str, timeout: float) -> None:
        # the default context, as HTTPSConnection makes it: verified against the host name
        self._tls = ssl.create_default_context()
        super().__init__(host, port, timeout=timeout, context=self._tls)
        self._ip = ip

    def connect(self) -> None:
        sock = socket.create_connection((self._ip, self.port), self.timeout)
        self.sock = self._tls.wrap_socket(sock, server_hostname=self.host)


def _is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(ip, "ipv4_mapped", None)
    if mapped is not None:
        ip = mapped
    return ip.is_global and not ip.is_multicast


def _resolve(host: str, port: int, param: str) -> list[str]:
    try:
        literal = ipaddress.ip_address(host.strip("[]"))
        return [str(literal)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise InvalidRequest(
            f"{param}: cannot resolve the image host '{host}' ({exc})", param=param
        ) from exc
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def fetch_image(url: str, param: str, vs: VisionSettings) -> bytes:
    deadline = time.monotonic() + 3 * vs.fetch_timeout_s
    for _ in range(vs.max_redirects + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequest(f"{param}: only http(s) image URLs are fetched", param=param)
        if parts.username or parts.password:
            raise InvalidRequest(f"{param}: image URLs must not carry credentials", param=param)
        host = parts.hostname
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise InvalidRequest(f"{param}: bad port in the image URL", param=param) from exc
        addrs = _resolve(host, port, param)
        if not vs.allow_private_addresses:
            for a in addrs:
                if not _is_public(ipaddress.ip_address(a)):
                    raise InvalidRequest(
                        f"{param}: the image host '{host}' is a non-public address ({a}); "
                        "this server does not fetch from loopback or private networks "
                        "(vision.allow_private_addresses)",
                        param=param,
                    )
        cls = _PinnedHTTPSConnection if parts.scheme == "https" else _PinnedHTTPConnection
        conn = cls(host, port, addrs[0], vs.fetch_timeout_s)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request(
                "GET",
                target,
                headers={"User-Agent": "mlxd", "Accept": "image/*", "Accept-Encoding": "identity"},
            )
            resp = conn.getresponse()
            if resp.status in _REDIRECTS:
                location = resp.getheader("Location")
                if not location:
                    raise InvalidRequest(f"{param}: the image URL redirected nowhere", param=param)
                url = urljoin(url, location)
                continue
            if resp.status != 200:
                raise InvalidRequest(
                    f"{param}: fetching the image failed: HTTP {resp.status}", param=param
                )
            length = resp.getheader("Content-Length")
            if length and length.isdigit():
                _check_size(int(length), param, vs)
            chunks, total = [], 0
            while True:
                if time.monotonic() > deadline:
                    raise InvalidRequest(f"{param}: fetching the image took too long", param=param)
                chunk = resp.read1(65536)  # one recv at most: the deadline holds
                if not chunk:
                    break
                total += len(chunk)
                _check_size(total, param, vs)
                chunks.append(chunk)
            return b"".join(chunks)
        except InvalidRequest:
            raise
        except (OSError, http.client.HTTPException) as exc:  # timeouts, refused, TLS
            raise InvalidRequest(
                f"{param}: fetching the image failed ({type(exc).__name__}: {exc})", param=param
            ) from exc
        finally:
            conn.close()
    raise InvalidRequest(f"{param}: too many redirects fetching the image", param=param)


# -- decoding --------------------------------------------------------------------------------


def decode_image(data: bytes, param: str, vs: VisionSettings) -> Any:
    """An RGB PIL image within ``max_image_pixels`` (downscaled or refused beyond it)."""
    try:
        from PIL import Image, ImageOps
    except ImportError as exc:  # pragma: no cover - Pillow comes with the [vision] extra
        raise InvalidRequest(
            "this server cannot decode images (Pillow is not installed)", param=param
        ) from exc
    limit = vs.max_image_pixels
    try:
        img: Image.Image = Image.open(io.BytesIO(data))
        w, h = img.size
        if w <= 0 or h <= 0:
            raise ValueError("empty image")
        target = None
        if w * h > limit:
            if vs.oversize_images == "reject":
                raise InvalidRequest(
                    f"{param}: the image is {w}x{h} pixels, more than this server accepts "
                    f"({limit} pixels; vision.max_image_pixels)",
                    param=param,
                )
            scale = math.sqrt(limit / (w * h))
            target = (max(1, int(w * scale)), max(1, int(h * scale)))
            img.draft("RGB", target)  # JPEG: decode at a reduced size directly
            if img.size[0] * img.size[1] > max(16 * limit, _MAX_DECODE_PIXELS):
                raise InvalidRequest(
                    f"{param}: the image is {w}x{h} pixels, far more than this server "
                    f"accepts ({limit} pixels); downscale it before sending",
                    param=param,
                )
        img.load()
        img = ImageOps.exif_transpose(img)
        if img.mode != "RGB":
            img = img.convert("RGB")
        if target is not None and img.size[0] * img.size[1] > limit:
            img = img.resize(target, Image.Resampling.LANCZOS)
        return img
    except InvalidRequest:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoder failure on user data is a 400
        raise InvalidRequest(
            f"{param}: the image could not be decoded ({type(exc).__name__}: {exc})", param=param
        ) from exc
