"""The web UI's usage view in a real browser (Debian's Chromium through Playwright) against
a real `mlxd serve` with two API keys: an admin key sees each key's tokens; another key is
told the view is for admins."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from conftest import require

require("playwright")

from conftest import free_port, require_chromium, wait_healthy  # noqa: E402

CHROMIUM = require_chromium()

ADMIN, OTHER = "ui-admin-key", "ui-other-key"


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama) -> Iterator[str]:
    base = tmp_path_factory.mktemp("ui-usage")
    port = free_port()
    env = dict(
        os.environ,
        MLXD_HOME=str(base / "home"),
        MLXD_API_KEYS=f"boss:{ADMIN} admin,carol:{OTHER}",
        HF_HUB_OFFLINE="1",
    )
    log = base / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlxd",
                "serve",
                "--model",
                str(tiny_llama),
                "--port",
                str(port),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 120, lambda: log.read_text()[-3000:])
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    assert CHROMIUM, "chromium is not installed (.ci/run installs Debian's chromium)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _page(browser, key: str):
    ctx = browser.new_context(viewport={"width": 1200, "height": 800})
    ctx.add_init_script(f"sessionStorage.setItem('mlxd-api-key', {json.dumps(key)})")
    pg = ctx.new_page()
    pg.errors = []
    pg.on("pageerror", lambda e: pg.errors.append(f"page error: {e}"))
    pg.set_default_timeout(30_000)
    return ctx, pg


def _chat(url: str, key: str, max_tokens: int) -> None:
    r = httpx.post(
        url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": "default",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text


def test_usage_view_shows_each_keys_tokens(browser, served) -> None:
    _chat(served, ADMIN, 3)
    _chat(served, OTHER, 2)
    _chat(served, OTHER, 2)
    ctx, page = _page(browser, ADMIN)
    try:
        page.goto(served + "/#usage")
        page.locator("[data-testid=usage] tr[data-key=carol]").wait_for()
        page.select_option("select[name=group]", "key")
        carol = page.locator("[data-testid=usage] tr[data-key=carol]")
        page.wait_for_function(
            "() => document.querySelectorAll('[data-testid=usage] tr[data-key]').length === 2"
        )
        cells = [c.strip() for c in carol.locator("td").all_inner_texts()]
        assert cells[:5] == ["carol", "2", "0", cells[3], "4"], cells
        boss = page.locator("[data-testid=usage] tr[data-key=boss] td").all_inner_texts()
        assert boss[1].strip() == "1" and boss[4].strip() == "3", boss
        assert "total" in page.inner_text("[data-testid=usage]")
        assert not page.errors, page.errors
    finally:
        ctx.close()


def test_usage_view_tells_a_non_admin_key_it_is_for_admins(browser, served) -> None:
    ctx, page = _page(browser, OTHER)
    try:
        page.goto(served + "/#usage")
        msg = page.locator("[data-testid=usage-error]")
        msg.wait_for()
        assert "403" in msg.inner_text() and "admin" in msg.inner_text()
        assert page.locator("[data-testid=usage]").count() == 0
        assert not page.errors, page.errors
    finally:
        ctx.close()
