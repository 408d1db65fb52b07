"""The web UI in a real browser: Playwright driving Debian's Chromium against a real
``mlxd serve`` (a subprocess, API keys configured) with the tiny fixtures.

One server and one browser for the module, a fresh tab for each test: each test opens
its view and makes the traffic and the store it looks at, so they pass in any order and
alone. The browser download
hosts are unreachable here, so Playwright drives the system's Chromium
(``executable_path``); .ci/run installs it, and on CI its absence fails these tests.

``MLXD_UI_SCREENSHOTS=DIR`` also saves a screenshot of each view there (docs/ui/ holds the
web UI page's); that run pulls the store's models from /tmp/mlxd-models/ (their "source" in the
store table), not from pytest's long temporary paths.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from conftest import require, require_chromium  # noqa: E402

require("playwright")

from conftest import free_port, wait_healthy  # noqa: E402
from fixtures.tiny_models import make_tiny_chat_model  # noqa: E402
from store.fake_hub import FakeHub  # noqa: E402

CHROMIUM = require_chromium()

KEY = "ui-secret-key"
HUB_REPO = "acme/tiny-chat"
VLM = "tiny-qwen2-vl"
EMBED = "tiny-embed"
RERANK = "tiny-ce"
SLOW = "long-llama"
TOOLS = "tool-qwen2"
THINK = "thinking-qwen3"
SHOTS = os.environ.get("MLXD_UI_SCREENSHOTS")


def png(seed: int = 0, size: tuple[int, int] = (32, 24)) -> bytes:
    from PIL import Image

    rng = np.random.RandomState(seed)
    arr = rng.randint(0, 255, size=(size[1], size[0], 3)).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


class Served:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path) -> None:
        self.url, self.proc, self.log = url, proc, log

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}
        )


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Iterator[FakeHub]:
    # ~22 MB of weights: huggingface_hub reads downloads in 10 MB chunks, so a bigger file
    # is what makes it report progress between "nothing" and "all"
    model = make_tiny_chat_model(
        tmp_path_factory.mktemp("hub") / "tiny-chat", "llama", hidden_size=384, num_layers=3, seed=3
    )
    h = FakeHub().start()
    h.add_dir(HUB_REPO, model)
    h.slow = 0.0002  # per 4 KiB: a second or two for the weights
    yield h
    h.stop()


@pytest.fixture(scope="module")
def served(
    tmp_path_factory, tiny_llama, long_llama, tool_qwen2, thinking_qwen3, hub
) -> Iterator[Served]:
    require("mlx_vlm")
    from fixtures.tiny_vlm import make_tiny_qwen2_vl

    base = tmp_path_factory.mktemp("ui")
    from fixtures.tiny_encoders import make_tiny_bert_embedder, make_tiny_cross_encoder

    from mlxd.config import ModelSettings
    from mlxd.store.local import ModelStore
    from mlxd.store.pull import pull

    # where the store's models are pulled from: the store table shows it as their source,
    # so the screenshots' run uses a short path a reader can take in
    src = Path(tempfile.gettempdir()) / "mlxd-models" if SHOTS else base / "src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir()
    models = base / "home" / "models"  # into the store, as `mlxd pull DIR` puts them
    for name, make in (
        (VLM, make_tiny_qwen2_vl),
        (EMBED, make_tiny_bert_embedder),
        (RERANK, make_tiny_cross_encoder),
    ):
        pull(ModelStore(models), str(make(src / name)), ModelSettings(dir=models), as_name=name)
    # a slower model: its tokens come over a second or more, so the page shows them arrive;
    # a template that speaks tools (Qwen2.5's syntax); a template that opens a thinking
    # part (<think> in the vocabulary, as Qwen3-Thinking)
    for name, model in ((SLOW, long_llama), (TOOLS, tool_qwen2), (THINK, thinking_qwen3)):
        shutil.copytree(model, src / name)
        pull(ModelStore(models), str(src / name), ModelSettings(dir=models), as_name=name)
    shutil.copytree(tiny_llama, src / "tiny-llama")  # the default: the store lists it too
    port = free_port()
    env = dict(
        os.environ,
        MLXD_HOME=str(base / "home"),
        MLXD_API_KEYS=f"ui-tester:{KEY}",
        HF_ENDPOINT=hub.url,
        HF_HOME=str(base / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    env.pop("HF_HUB_OFFLINE", None)
    log = base / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlxd",
                "serve",
                "--model",
                str(src / "tiny-llama"),
                "--port",
                str(port),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    srv = Served(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_healthy(srv.url, proc, 120, lambda: log.read_text()[-3000:])
        yield srv
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(src, ignore_errors=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    assert CHROMIUM, "chromium is not installed (.ci/run installs Debian's chromium)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture()
def page(browser, served):
    """A fresh tab with the key in its session storage (as the key form leaves it), every
    console error and page error recorded."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    ctx.add_init_script(f"sessionStorage.setItem('mlxd-api-key', {json.dumps(KEY)})")
    pg = ctx.new_page()
    pg.errors = []
    pg.on("console", lambda m: m.type == "error" and pg.errors.append(m.text))
    pg.on("pageerror", lambda e: pg.errors.append(f"page error: {e}"))
    pg.set_default_timeout(30_000)
    yield pg
    ctx.close()


def playground(page, served: Served) -> None:
    """Open the playground's chat, empty (a fresh tab's)."""
    page.goto(served.url + "/#playground")
    page.locator("textarea[name=prompt]").wait_for()


def shot(page, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / f"{name}.png"), full_page=True)


def access_log(served: Served) -> list[str]:
    """The access-log lines the server wrote (text format: time, level, logger, line)."""
    marker = " INFO mlxd.access: "
    return [ln.split(marker, 1)[1] for ln in served.log.read_text().splitlines() if marker in ln]


def settle(served: Served, timeout: float = 60) -> dict:
    """/health once no request is in flight and no model has one running (a cancelled
    stream's slot freed)."""
    deadline = time.time() + timeout
    with served.client() as c:  # without a key /health says only whether it is up
        while True:
            h = c.get("/health").json()
            if h["requests_in_flight"] == 0 and all(m.get("running", 0) == 0 for m in h["models"]):
                return h
            assert time.time() < deadline, h
            time.sleep(0.1)


def test_without_a_key_the_page_asks_for_one_and_shows_nothing(browser, served):
    ctx = browser.new_context(viewport={"width": 960, "height": 400})  # its screenshot's size
    pg = ctx.new_page()
    try:
        pg.goto(served.url + "/")
        pg.get_by_text("API key needed").wait_for()
        assert pg.locator("[data-testid=facts]").count() == 0  # no server data shown
        shot(pg, "api-key")
        assert httpx.get(served.url + "/ui/api/overview").status_code == 401
        pg.fill("input[name=api-key]", "not-the-key")
        pg.click("text=Use key")
        pg.locator("[data-testid=key-error]").wait_for()
        assert "refused" in pg.inner_text("[data-testid=key-error]")
        assert pg.locator("[data-testid=facts]").count() == 0
        pg.fill("input[name=api-key]", KEY)
        pg.click("text=Use key")
        pg.locator("[data-testid=facts]").wait_for()
        # kept for this tab's session only
        assert pg.evaluate("sessionStorage.getItem('mlxd-api-key')") == KEY
        assert pg.evaluate("localStorage.length") == 0
    finally:
        ctx.close()


def test_overview_loads_without_console_errors(page, served):
    page.goto(served.url + "/")
    facts = page.locator("[data-testid=facts]")
    facts.wait_for()
    # version, backend, BLAS (its name, the details are on the Server card), uptime, status
    assert re.fullmatch(
        r"v\d+\.\d+\S* · backend cpu · BLAS \w+ · up (\d+[dhm] )?\d+[hms]"
        r" · ok · forget key",
        facts.inner_text(),
    ), facts.inner_text()
    page.locator("[data-testid=loaded] tr[data-model=tiny-llama]").wait_for()
    row = page.inner_text("[data-testid=loaded] tr[data-model=tiny-llama]")
    assert "chat" in row and "yes" in row  # the default model is pinned
    page.locator(f"[data-testid=store] tr[data-model={VLM}]").wait_for()
    assert "budget" in page.inner_text("[data-testid=memory]")
    page.goto(served.url + "/ui/")  # the same page at /ui/
    page.locator("[data-testid=facts]").wait_for()
    assert page.errors == []


def test_chat_streams_tokens_into_the_page(page, served):
    playground(page, served)
    page.select_option("select[name=model]", SLOW)
    page.fill("input[name=max_tokens]", "400")
    page.fill("input[name=temperature]", "0")
    # the reply's text, every time it changes: streaming shows it growing
    page.evaluate("""() => { window.__seen = [];
        new MutationObserver(() => {
          const r = document.querySelector('[data-testid=reply] .content');
          if (r) window.__seen.push([performance.now(), r.textContent]); })
        .observe(document.querySelector('[data-testid=messages]'),
                 {subtree: true, childList: true, characterData: true}); }""")
    box = page.locator("textarea[name=prompt]")
    box.fill("hello")
    box.press("Shift+Enter")  # a new line, not a send
    box.type("there")
    assert page.locator("[data-testid=reply]").count() == 0
    assert box.input_value() == "hello\nthere"
    box.press("Enter")
    page.locator("[data-testid=reply-stats]").wait_for()
    stats = page.inner_text("[data-testid=reply-stats]")
    assert "+ 400 completion tokens" in stats and "tok/s" in stats, stats
    seen = [(t, s) for t, s in page.evaluate("window.__seen") if s]
    final = page.inner_text("[data-testid=reply] .content")
    assert all(final.startswith(s) for _, s in seen)
    # the text arrived in pieces: the page showed several growing parts of it before all
    assert len({s for _, s in seen if s != final}) >= 3, seen
    shot(page, "playground")


def test_copy_as_snippets(page, served):
    from playwright.sync_api import expect

    playground(page, served)
    page.select_option("select[name=model]", SLOW)
    page.fill("input[name=max_tokens]", "400")
    snippet = page.locator("[data-testid=snippet] pre")
    page.click("button:text-is('curl')")
    expect(snippet).to_contain_text("/v1/chat/completions")
    assert "$MLXD_API_KEY" in snippet.inner_text() and SLOW in snippet.inner_text()
    page.click("button:text-is('Python')")
    expect(snippet).to_contain_text("from openai import OpenAI")
    assert "max_tokens=400" in snippet.inner_text()
    page.click("button:text-is('Ollama')")
    expect(snippet).to_contain_text("/api/chat")
    assert '"num_predict": 400' in snippet.inner_text()


def test_json_schema_mode_constrains_the_reply(page, served):
    playground(page, served)
    page.select_option("select[name=model]", "tiny-llama")
    page.fill("input[name=max_tokens]", "48")
    page.check("input[name=schema-on]")
    page.fill(
        "textarea[name=schema]",
        json.dumps(
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["answer"],
                "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
            }
        ),
    )
    page.fill("textarea[name=prompt]", "Is the sky blue?")
    page.press("textarea[name=prompt]", "Enter")
    page.locator("[data-testid=reply-stats]").wait_for()
    # random weights, and still the schema's JSON: the grammar held while decoding
    assert json.loads(page.inner_text("[data-testid=reply] .content"))["answer"] in ("yes", "no")


def test_tool_calls_are_shown_apart_from_the_answer(page, served):
    playground(page, served)
    page.select_option("select[name=model]", TOOLS)
    page.fill("input[name=max_tokens]", "64")
    page.fill("input[name=temperature]", "0")  # sampled, the grammar's whitespace can fill 64
    page.check("input[name=tools-on]")
    page.fill(
        "textarea[name=tools]",
        json.dumps(
            [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "parameters": {
                            "type": "object",
                            "required": ["city"],
                            "additionalProperties": False,
                            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                        },
                    },
                }
            ]
        ),
    )
    page.select_option("select[name=tool-choice]", "required")  # the grammar writes a call
    page.uncheck("input[name=parallel-tools]")  # one, then the reply ends
    page.fill("textarea[name=prompt]", "Weather in Paris?")
    page.press("textarea[name=prompt]", "Enter")
    page.locator("[data-testid=reply-stats]").wait_for()
    assert page.locator("[data-testid=tool-calls]").count() == 1, page.inner_text(
        "[data-testid=reply]"
    )
    calls = page.inner_text("[data-testid=tool-calls]")
    assert calls.startswith("tool call: get_weather(")
    args = json.loads(calls.removeprefix("tool call: get_weather(")[:-1])
    assert args["city"] in ("Paris", "Rome")
    assert "<tool_call>" not in page.inner_text("[data-testid=reply] .content")
    assert "tool_calls" in page.inner_text("[data-testid=reply-stats]")  # finish reason


def test_reasoning_streams_into_its_own_panel(page, served):
    playground(page, served)
    page.select_option("select[name=model]", THINK)
    page.fill("input[name=max_tokens]", "300")
    page.fill("input[name=temperature]", "0")
    # the reasoning and the answer, every time the page changes them
    page.evaluate("""() => { window.__think = [];
        new MutationObserver(() => {
          const r = document.querySelector('[data-testid=reply] .reasoning');
          const c = document.querySelector('[data-testid=reply] .content');
          window.__think.push([performance.now(), r ? r.textContent : '',
                               c ? c.textContent : '']); })
        .observe(document.querySelector('[data-testid=messages]'),
                 {subtree: true, childList: true, characterData: true}); }""")
    page.fill("textarea[name=prompt]", "Why is the sky blue?")
    page.press("textarea[name=prompt]", "Enter")
    page.locator("[data-testid=reply-stats]").wait_for()
    assert "+ 300 completion tokens" in page.inner_text("[data-testid=reply-stats]")
    panel = page.locator("[data-testid=reply] [data-testid=reasoning]")
    final = panel.locator(".reasoning").text_content()
    # the model never closes its thinking part: all of the reply is reasoning, shown open
    # in its panel, none of it in the answer, and no marker shown
    assert final.strip() and panel.get_attribute("open") is not None
    assert page.text_content("[data-testid=reply] .content") == ""
    assert "<think>" not in final and "</think>" not in final
    assert panel.locator("summary").inner_text() == "reasoning"
    seen = page.evaluate("window.__think")
    assert all(answer == "" for _, _, answer in seen), seen
    seen = [(t, s) for t, s, _ in seen if s]
    assert all(final.startswith(s) for _, s in seen)
    # streamed: the page showed several growing parts of it before all of it
    assert len({s for _, s in seen if s != final}) >= 3, seen
    shot(page, "reasoning")
    assert page.errors == []


def test_system_prompt_sampling_fields_and_stop_strings(page, served):
    playground(page, served)
    page.select_option("select[name=model]", "tiny-llama")
    page.fill("textarea[name=system]", "Answer in one line.")
    page.fill("input[name=temperature]", "1")  # sampled: the seed decides the text
    page.fill("input[name=top_p]", "0.9")
    page.fill("input[name=seed]", "1234")
    page.fill("input[name=max_tokens]", "24")

    def ask() -> tuple[dict, str, str]:
        """One fresh exchange: the request the page sent, the reply, its stats line."""
        page.click("text=Clear")
        page.fill("textarea[name=prompt]", "Say something.")
        with page.expect_request(
            lambda r: r.method == "POST" and r.url.endswith("/v1/chat/completions")
        ) as sent:
            page.press("textarea[name=prompt]", "Enter")
        page.locator("[data-testid=reply-stats]").wait_for()
        return (
            sent.value.post_data_json,
            page.text_content("[data-testid=reply] .content"),
            page.inner_text("[data-testid=reply-stats]"),
        )

    body, first, stats = ask()
    assert body["messages"] == [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "Say something."},
    ]
    assert (body["temperature"], body["top_p"], body["seed"], body["max_tokens"]) == (
        1,
        0.9,
        1234,
        24,
    )
    assert "stop" not in body and "· length ·" in stats, stats
    assert ask()[1] == first  # the same seed, the same text
    # a stop string from the middle of that text: the same reply, cut before it
    k = next(
        i
        for i in range(len(first) // 2, len(first) - 3)
        if not any(c.isspace() for c in first[i : i + 3])
    )
    stop = first[k : k + 3]
    page.fill("textarea[name=stop]", f"{stop}\n\n")  # blank lines are no stop strings
    body, cut, stats = ask()
    assert body["stop"] == [stop]
    assert cut == first[: first.index(stop)] and "· stop ·" in stats, (first, stop, cut)
    page.click("button:text-is('Ollama')")  # the snippet carries them, by Ollama's names
    page.locator("[data-testid=snippet] pre").wait_for()
    argv = shlex.split(page.inner_text("[data-testid=snippet] pre"))  # as a shell reads it
    options = json.loads(argv[argv.index("-d") + 1])["options"]
    assert options == {
        "temperature": 1,
        "top_p": 0.9,
        "seed": 1234,
        "num_predict": 24,
        "stop": [stop],
    }
    assert page.errors == []


def test_an_image_reaches_the_vision_model(page, served, tmp_path):
    def images_seen() -> float:
        text = httpx.get(served.url + "/metrics", timeout=10).text
        m = re.search(rf'^mlxd:vision_images_total\{{model="{VLM}"\}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    before = images_seen()
    playground(page, served)
    page.select_option("select[name=model]", VLM)
    # drag and drop, and paste, each attach an image
    page.evaluate(
        """async (b64) => {
        const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
        const file = () => new File([bytes], 'x.png', {type: 'image/png'});
        const dt = new DataTransfer(); dt.items.add(file());
        document.querySelector('.composer').dispatchEvent(
            new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true}));
        const dt2 = new DataTransfer(); dt2.items.add(file());
        document.querySelector('textarea[name=prompt]').dispatchEvent(
            new ClipboardEvent('paste', {clipboardData: dt2, bubbles: true, cancelable: true}));
    }""",
        __import__("base64").b64encode(png(1)).decode(),
    )
    page.wait_for_function(
        "() => document.querySelectorAll('[data-testid=attached] img').length === 2"
    )
    page.locator("[data-testid=attached] img").first.click()  # a click removes one
    page.wait_for_function(
        "() => document.querySelectorAll('[data-testid=attached] img').length === 1"
    )
    f = tmp_path / "pic.png"
    f.write_bytes(png(2))
    page.set_input_files("input[name=image]", str(f))  # and the file picker adds one
    page.wait_for_function(
        "() => document.querySelectorAll('[data-testid=attached] img').length === 2"
    )
    page.fill("input[name=max_tokens]", "4")
    page.fill("textarea[name=prompt]", "What is in the pictures?")
    page.press("textarea[name=prompt]", "Enter")
    page.locator("[data-testid=reply-stats]").wait_for(timeout=120_000)
    assert page.locator("[data-testid=reply] .err").count() == 0
    assert page.locator(".msg.user img").count() == 2
    assert images_seen() == before + 2
    assert page.errors == []


def test_stop_ends_the_reply_and_frees_the_slot(page, served):
    playground(page, served)
    page.select_option("select[name=model]", SLOW)
    page.fill("input[name=max_tokens]", "4000")  # the slow model: tens of seconds of it
    page.fill("textarea[name=prompt]", "Tell me a long story.")
    page.press("textarea[name=prompt]", "Enter")
    page.wait_for_function(  # under way: some of the reply is on the page
        "() => (document.querySelector('[data-testid=reply] .content') || {}).textContent"
    )
    page.click("button:text-is('Stop')")
    stats = page.locator("[data-testid=reply-stats]")
    stats.wait_for()
    assert re.search(r"· stopped · request \w+$", stats.inner_text()), stats.inner_text()
    assert page.locator("button:text-is('Stop')").count() == 0
    assert page.locator("[data-testid=reply] .err").count() == 0
    # no usage chunk comes after a Stop: the reply links the server's record, which counts
    # the tokens it sent before the client went, fewer than asked for
    link = page.locator("[data-testid=reply-request]")
    rid = link.get_attribute("href").removeprefix("#requests/")
    deadline = time.time() + 60
    with served.client() as c:
        while not (
            mine := [
                r for r in c.get("/ui/api/requests").json()["requests"] if r["request_id"] == rid
            ]
        ):
            assert time.time() < deadline, f"no record of {rid}"
            time.sleep(0.1)
    assert mine[0]["model"] == SLOW and 0 < mine[0]["completion_tokens"] < 4000, mine
    settle(served)  # the slot is free: nothing running on the server
    link.click()  # and the link opens that record
    line = page.locator("[data-testid=log-line]")
    line.wait_for()
    assert f"rid={rid}" in line.inner_text()
    assert f"tokens={mine[0]['prompt_tokens']}+{mine[0]['completion_tokens']}" in line.inner_text()
    assert page.errors == []


def test_pull_shows_progress_and_the_model_appears(page, served, hub):
    with served.client() as c:  # not in the store (an earlier test may have pulled it)
        c.request("DELETE", "/api/delete", json={"model": HUB_REPO})
        assert HUB_REPO not in {m["name"] for m in c.get("/api/tags").json()["models"]}
    page.goto(served.url + "/#overview")
    # every text the progress display shows, as the page changes it
    page.evaluate("""() => { window.__pull = [];
        new MutationObserver(() => {
          const el = document.querySelector('[data-testid=pull-progress]');
          const t = el && el.innerText;
          if (t && t !== window.__pull[window.__pull.length - 1]) window.__pull.push(t);
        }).observe(document.body, {subtree: true, childList: true, characterData: true}); }""")
    page.fill("input[name=pull]", HUB_REPO)
    page.click("button:text-is('Pull')")
    page.wait_for_function(
        "() => document.querySelector('[data-testid=pull-progress]').innerText"
        ".startsWith('success')",
        timeout=120_000,
    )
    seen = page.evaluate("window.__pull")
    firsts = [t.split()[0] for t in seen]
    assert firsts[0] in ("starting", "pulling") and firsts[-1] == "success", seen
    # the long phase is shown as it goes; a short one (verifying a small file takes
    # milliseconds) may arrive in the same network chunk as the next and Preact renders
    # only the later state, so the test does not demand to see it. "pulling" is such a
    # phase: the server holds the pull's first event until its second (a pull that fails
    # before then answers with its error's status), and sends them together
    assert "downloading" in firsts, seen
    # bytes done of the total, shown part-way ("10.0 MB / 21.6 MB")
    parts = [re.search(r"([\d.]+) (\w+) / ([\d.]+) (\w+)", t) for t in seen]
    partial = [
        m.group(0) for m in parts if m and m.group(1, 2) != m.group(3, 4) and float(m.group(1)) > 0
    ]
    assert partial, seen
    page.locator(f"[data-testid=store] tr[data-model='{HUB_REPO}']").wait_for()
    shot(page, "overview")
    assert page.errors == []


def test_remove_and_unload_ask_then_the_rows_go(page, served, hub):
    with served.client() as c:

        def tags() -> set[str]:
            return {m["name"] for m in c.get("/api/tags").json()["models"]}

        def loaded() -> set[str]:
            return {m["name"] for m in c.get("/health").json()["models"]}

        # a model in the store to remove, a loaded one to unload
        if HUB_REPO not in tags():
            r = c.post("/api/pull", json={"model": HUB_REPO, "stream": False}, timeout=300)
            assert r.status_code == 200, r.text
        r = c.post(
            "/v1/chat/completions",
            json={"model": VLM, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200, r.text
        page.goto(served.url + "/#overview")
        # the expiry column: never for the pinned default, the keep-alive left for others
        expires = page.locator(f"[data-testid=loaded] tr[data-model={VLM}] td").nth(4)
        m = re.fullmatch(r"in (\d+)m \d+s", expires.inner_text())
        assert m and int(m.group(1)) <= 30, expires.inner_text()  # keep_alive: 30m
        assert (
            page.locator("[data-testid=loaded] tr[data-model=tiny-llama] td").nth(4).inner_text()
            == "never"
        )
        row = page.locator(f"[data-testid=store] tr[data-model='{HUB_REPO}']")
        asked: list[str] = []
        page.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))
        row.locator("button:text-is('Remove')").click()
        assert asked == [f"Remove {HUB_REPO} from the store?"]
        assert HUB_REPO in tags() and row.count() == 1  # "Cancel" kept it
        page.once("dialog", lambda d: d.accept())
        row.locator("button:text-is('Remove')").click()
        row.wait_for(state="detached")
        assert HUB_REPO not in tags()
        assert VLM in loaded()
        page.locator(f"[data-testid=loaded] tr[data-model={VLM}] button:text-is('Unload')").click()
        page.locator(f"[data-testid=loaded] tr[data-model={VLM}]").wait_for(state="detached")
        assert VLM not in loaded()
        assert VLM in tags()  # unloaded, still in the store
        assert page.locator(f"[data-testid=store] tr[data-model={VLM}]").count() == 1
    assert page.errors == []


def chart_sums(page) -> dict[str, float]:
    """Every chart series' sum over the window, by "chart/series"."""
    return page.evaluate("""() => Object.fromEntries(
        [...document.querySelectorAll('[data-chart] [data-series]')].map((e) =>
          [e.closest('[data-chart]').dataset.chart + '/' + e.dataset.series,
           parseFloat(e.dataset.sum)]))""")


def test_charts_update_after_traffic(page, served):
    page.goto(served.url + "/#overview")
    page.locator("[data-testid=charts]").wait_for()
    # what the charts held before this test's traffic: wait for a point sampled after now,
    # so that no earlier request can still arrive and pass for this test's
    now = time.time()
    page.wait_for_function(
        f"() => parseFloat(document.querySelector('[data-testid=charts]').dataset.last) > {now}"
    )
    before = chart_sums(page)
    points = int(page.get_attribute("[data-chart=tokens]", "data-points"))
    # two slow streams held open (the queue chart must see them running), and traffic from
    # outside the page: it counts too
    release, errors = threading.Event(), []

    def hold() -> None:
        try:
            with (
                served.client() as c,
                c.stream(
                    "POST",
                    "/v1/chat/completions",
                    json={
                        "model": SLOW,
                        "max_tokens": 4000,
                        "stream": True,
                        "messages": [{"role": "user", "content": "a long one"}],
                    },
                ) as r,
            ):
                assert r.status_code == 200
                for _ in r.iter_lines():
                    if release.is_set():
                        break
        except Exception as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    held = [threading.Thread(target=hold) for _ in range(2)]
    for t in held:
        t.start()
    try:
        with served.client() as c:
            for _ in range(3):
                r = c.post(
                    "/v1/chat/completions",
                    json={
                        "model": "tiny-llama",
                        "max_tokens": 8,
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                )
                assert r.status_code == 200
            assert c.post(
                "/v1/chat/completions", json={"model": "nope", "messages": []}
            ).status_code in (400, 404)
        # above: the tokens, first tokens and running requests of the new points; the
        # three answered chats and the one refused
        above = {
            k: before[k]
            for k in ("tokens/generated", "tokens/prompt", "ttft/mean TTFT", "queue/running")
        }
        above |= {
            "status/2xx": before["status/2xx"] + 2.5,
            "status/4xx": before["status/4xx"] + 0.5,
        }
        page.wait_for_function(
            """(above) => {
            const now = {};
            for (const e of document.querySelectorAll('[data-chart] [data-series]'))
              now[e.closest('[data-chart]').dataset.chart + '/' + e.dataset.series] =
                parseFloat(e.dataset.sum);
            return Object.keys(above).every((k) => now[k] > above[k]); }""",
            arg=above,
        )
    finally:
        release.set()
        for t in held:
            t.join(30)
    assert errors == []
    assert float(page.get_attribute("[data-chart=queue] [data-series=running]", "data-peak")) >= 1
    assert int(page.get_attribute("[data-chart=tokens]", "data-points")) > points
    settle(served)  # the held streams, closed, are cancelled on the server


def test_requests_view_lists_filters_and_links_the_log_line(page, served):
    with served.client() as c:  # its own traffic: a chat, a refusal, an embedding
        assert (
            c.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny-llama",
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            ).status_code
            == 200
        )
        assert c.post(
            "/v1/chat/completions", json={"model": "nope", "messages": []}
        ).status_code in (400, 404)
        assert c.post("/v1/embeddings", json={"model": EMBED, "input": "x"}).status_code == 200
        # a caller without this key's identity: its request is not this key's to see
        assert (
            c.get(
                "/v1/models",
                headers={"Authorization": "Bearer not-a-key", "X-Request-ID": "ui-someone-else"},
            ).status_code
            == 401
        )
    page.goto(served.url + "/#requests")
    table = page.locator("[data-testid=requests]")
    table.locator("tr[data-rid]").first.wait_for()
    rows = table.locator("tr[data-rid]")
    text = table.inner_text()
    assert "/v1/chat/completions" in text and "tiny-llama" in text and "ui-tester" in text
    # ui-tester is not an admin key: it is told it sees its own requests, and only those
    assert "Only this key's requests" in page.inner_text("[data-testid=requests-scope]")
    assert "ui-someone-else" not in table.evaluate(
        "t => [...t.querySelectorAll('tr[data-rid]')].map(r => r.dataset.rid)"
    )
    # the page itself, its files and its own polling are left out
    assert "/ui/" not in text and "unmatched" not in text
    page.select_option("select[name=status]", "4xx")
    page.wait_for_function(  # the status column (the first number) of every row shown
        "() => { const rows = [...document.querySelectorAll("
        "'[data-testid=requests] tr[data-rid]')]; return rows.length >= 1 && "
        "rows.every(r => r.querySelector('td.num').innerText.startsWith('4')); }"
    )
    page.select_option("select[name=status]", "all")
    page.fill("input[name=filter]", EMBED)
    page.wait_for_function(  # only the rows that name it
        "(name) => { const rows = [...document.querySelectorAll("
        "'[data-testid=requests] tr[data-rid]')]; return rows.length >= 1 && "
        "rows.every(r => r.innerText.includes(name)); }",
        arg=EMBED,
    )
    page.fill("input[name=filter]", "")
    first = rows.first
    rid = first.get_attribute("data-rid")
    first.locator("a").click()
    line = page.inner_text("[data-testid=log-line]")
    assert f"rid={rid}" in line and "key=ui-tester" in line
    assert line in access_log(served)  # the very line the server logged
    assert page.url.endswith(f"#requests/{rid}")
    shot(page, "requests")
    # a link opened in a fresh page opens its request's row; a client's own request id
    # may hold any text, "/", "#" and spaces too, and the link still carries it
    odd = "ui check/1 #a"
    with served.client() as c:
        assert c.get("/v1/models", headers={"X-Request-ID": odd}).status_code == 200
    fresh = page.context.new_page()
    try:
        fresh.goto(f"{served.url}/#requests/{quote(odd, safe='')}")
        fresh.locator("[data-testid=log-line]").wait_for()
        assert fresh.get_attribute("[data-testid=requests] tr.sel", "data-rid") == odd
        assert fresh.inner_text("[data-testid=log-line]") in access_log(served)
        assert 'rid="ui check/1 #a"' in fresh.inner_text("[data-testid=log-line]")
        # and one followed on a page already showing the list (a pasted link) opens too
        fresh.evaluate("(rid) => { location.hash = '#requests/' + rid; }", rid)
        fresh.wait_for_function(
            "(rid) => document.querySelector('[data-testid=requests] tr.sel')?.dataset.rid === rid",
            arg=rid,
        )
    finally:
        fresh.close()
    assert page.errors == []


def test_embeddings_similarity_matrix_and_rerank(page, served):
    page.goto(served.url + "/#playground")
    page.click("[data-tab=embed]")
    page.select_option("select[name=embed-model]", EMBED)
    page.fill("textarea[name=sentences]", "a cat\na kitten\nthe stock market")
    page.click("button[name=run-embed]")
    page.locator("[data-testid=similarity], .card .err").first.wait_for()
    assert page.locator(".card .err").count() == 0, page.inner_text(".card .err")
    matrix = page.locator("[data-testid=similarity]")
    cells = [
        [float(td.inner_text()) for td in row.locator("td").all()]
        for row in matrix.locator("tr").all()[1:]
    ]
    assert len(cells) == 3 and all(len(r) == 3 for r in cells)
    assert all(abs(cells[i][i] - 1) < 1e-3 for i in range(3))  # cosine of itself
    assert all(abs(cells[i][j] - cells[j][i]) < 1e-3 for i in range(3) for j in range(3))
    page.click("[data-tab=rerank]")
    page.select_option("select[name=rerank-model]", RERANK)
    page.click("button[name=run-rerank]")
    page.locator("[data-testid=rerank], .card .err").first.wait_for()
    assert page.locator(".card .err").count() == 0, page.inner_text(".card .err")
    table = page.locator("[data-testid=rerank]")
    scores = [float(r.locator("td").first.inner_text()) for r in table.locator("tr").all()[1:]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    shot(page, "rerank")
    page.click("[data-tab=embed]")
    page.click("button[name=run-embed]")
    matrix.wait_for()
    shot(page, "embeddings")
    assert page.errors == []
