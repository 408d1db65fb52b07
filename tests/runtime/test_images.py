"""Image sources, remote-fetch safety and decoding (core/images.py), without a server."""

from __future__ import annotations

import base64
import http.server
import io
import ipaddress
import threading

import pytest
from conftest import require  # noqa: E402

require("PIL")

from PIL import Image  # noqa: E402

from mlxd.config import VisionSettings  # noqa: E402
from mlxd.core import images  # noqa: E402
from mlxd.core.errors import InvalidRequest  # noqa: E402
from mlxd.core.types import ImageInput  # noqa: E402


def _png(size=(32, 24), fmt="PNG", mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 128 if mode == "L" else (10, 200, 30)).save(buf, format=fmt)
    return buf.getvalue()


def _ref(src: str) -> ImageInput:
    return ImageInput(src, "messages[0].content[0]")


VS = VisionSettings()


def test_data_urls_and_raw_base64_decode_to_the_same_bytes():
    data = _png()
    b64 = base64.b64encode(data).decode()
    assert images.image_bytes(_ref(f"data:image/png;base64,{b64}"), VS) == data
    assert images.image_bytes(_ref(b64), VS) == data
    assert images.image_bytes(_ref(b64.rstrip("=")), VS) == data  # padding optional
    url_safe = base64.urlsafe_b64encode(data).decode()
    assert images.image_bytes(_ref(url_safe), VS) == data
    jpeg = _png(fmt="JPEG")
    assert images.image_bytes(_ref(base64.b64encode(jpeg).decode()), VS) == jpeg  # "/9j/..."


@pytest.mark.parametrize(
    "src, words",
    [
        ("/etc/passwd", "local file paths"),
        ("./cat.png", "local file paths"),
        ("~/cat.png", "local file paths"),
        ("C:\\cats\\a.png", "local file paths"),
        ("file:///etc/passwd", "unsupported image URL scheme"),
        ("ftp://host/x.png", "unsupported image URL scheme"),
        ("data:image/png,rawbytes", "base64"),
        ("data:image/png;base64", "no comma"),
        ("data:image/png;base64,%%%", "not valid base64"),
        ("not an image at all!", "neither"),
        ("", "empty"),
        ("https://example.com/x.png", "allow_remote_images"),
    ],
)
def test_refused_sources_are_400_naming_the_part(src, words):
    with pytest.raises(InvalidRequest) as info:
        images.image_bytes(_ref(src), VS)
    assert words in info.value.message and info.value.param == "messages[0].content[0]"


def test_byte_limit_applies_to_inline_images():
    vs = VisionSettings(max_image_bytes=1024)
    with pytest.raises(InvalidRequest, match="larger than"):
        images.image_bytes(_ref(base64.b64encode(b"x" * 4096).decode()), vs)


def test_decode_converts_to_rgb_and_reports_broken_images():
    img = images.decode_image(_png(mode="L"), "p", VS)
    assert img.mode == "RGB" and img.size == (32, 24)
    for bad in (b"", b"GIF89a", _png()[:60], b"\x89PNG\r\n\x1a\n" + b"\x00" * 50):
        with pytest.raises(InvalidRequest, match="could not be decoded") as info:
            images.decode_image(bad, "messages[1].content[2]", VS)
        assert info.value.param == "messages[1].content[2]"


def test_oversized_images_resize_or_reject():
    big = _png((300, 200))
    small = images.decode_image(big, "p", VisionSettings(max_image_pixels=60 * 40))
    assert small.size[0] * small.size[1] <= 60 * 40
    assert abs(small.size[0] / small.size[1] - 1.5) < 0.1  # the aspect ratio is kept
    jpeg = images.decode_image(
        _png((800, 600), "JPEG"), "p", VisionSettings(max_image_pixels=100 * 75)
    )
    assert jpeg.size[0] * jpeg.size[1] <= 100 * 75
    with pytest.raises(InvalidRequest, match="300x200"):
        images.decode_image(
            big, "p", VisionSettings(max_image_pixels=60 * 40, oversize_images="reject")
        )


@pytest.mark.parametrize(
    "addr, public",
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("0.0.0.0", False),
        ("::1", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("::ffff:127.0.0.1", False),
        ("224.0.0.1", False),
    ],
)
def test_public_address_check(addr, public):
    assert images._is_public(ipaddress.ip_address(addr)) is public


class _Redirector(http.server.BaseHTTPRequestHandler):
    target = ""

    def do_GET(self):  # noqa: N802
        self.send_response(302)
        self.send_header("Location", self.target)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_redirects_are_checked_hop_by_hop(monkeypatch):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Redirector)
    port = httpd.server_address[1]
    _Redirector.target = f"http://127.0.0.2:{port}/img.png"
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    # pretend 127.0.0.1 is a public host: its redirect to another loopback address is refused
    monkeypatch.setattr(images, "_is_public", lambda ip: str(ip) == "127.0.0.1")
    vs = VisionSettings(allow_remote_images=True, fetch_timeout_s=2)
    try:
        with pytest.raises(InvalidRequest, match=r"non-public address \(127\.0\.0\.2\)"):
            images.fetch_image(f"http://127.0.0.1:{port}/start", "p", vs)
        _Redirector.target = f"http://127.0.0.1:{port}/again"
        with pytest.raises(InvalidRequest, match="too many redirects"):
            images.fetch_image(f"http://127.0.0.1:{port}/start", "p", vs)
        with pytest.raises(InvalidRequest, match="credentials"):
            images.fetch_image(f"http://u:p@127.0.0.1:{port}/x", "p", vs)
    finally:
        httpd.shutdown()


def test_connection_failures_and_timeouts_are_400():
    vs = VisionSettings(allow_remote_images=True, allow_private_addresses=True, fetch_timeout_s=0.5)
    import socket

    silent = socket.socket()  # accepts, never answers: the read times out
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        with pytest.raises(InvalidRequest, match="fetching the image failed"):
            images.fetch_image(f"http://127.0.0.1:{silent.getsockname()[1]}/x", "p", vs)
    finally:
        silent.close()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(InvalidRequest, match="fetching the image failed"):
        images.fetch_image(f"http://127.0.0.1:{port}/x", "p", vs)
