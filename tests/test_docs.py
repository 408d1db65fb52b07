"""The README and docs/ as executable documentation.

Every ``yaml`` block is loaded by the real config loader, every ``curl`` command is sent (its
method, path, headers and body) to one live server whose store holds tiny stand-ins under the
documented model names, every Python client snippet runs against that server, every relative
link resolves, and docs/configuration.md is what scripts/gen_config_docs.py prints. A block
that cannot run here says why in a ``<!-- not-run: REASON -->`` line just before it; a block
whose documented answer is not a 2xx states it with ``<!-- status: CODE -->``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import wave
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest
from conftest import LiveServer, make_settings

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*(not-run|status):\s*(.*?)\s*-->")
SHELLS = {"bash", "sh", "shell", "console"}
# linked before they are written (the threat model, the contributor guide): checked like any
# other link as soon as they exist
LINKED_AHEAD = {ROOT / "docs" / "security.md", ROOT / "CONTRIBUTING.md"}


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str
    not_run: str | None
    status: int | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """Fenced code blocks with the markers on the lines just above them."""
    out: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang, body = i, m.group(2).lower(), []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i][len(m.group(1)) :])
            i += 1
        i += 1
        marks: dict[str, str] = {}
        j = start - 1
        while j >= 0 and (MARKER.search(lines[j]) or not lines[j].strip()):
            for kind, value in MARKER.findall(lines[j]):
                marks.setdefault(kind, value)
            j -= 1
        status = marks.get("status")
        out.append(
            Block(
                page,
                start + 1,
                lang,
                "\n".join(body) + "\n",
                marks.get("not-run"),
                int(status) if status else None,
            )
        )
    return out


ALL = [b for p in PAGES for b in blocks(p)]


def curl_commands(text: str) -> list[list[str]]:
    """The curl commands of a shell block, continuation lines joined, comments dropped."""
    out, command = [], ""
    for line in text.splitlines():
        command += line + "\n"
        if line.rstrip().endswith("\\"):
            continue
        try:  # a quoted body may span lines: read on until its quote closes
            argv = shlex.split(
                command.replace("\\\n", " ").strip().removeprefix("$ "), comments=True
            )
        except ValueError:
            continue
        if argv and argv[0] == "curl":
            out.append(argv)
        command = ""
    assert not command.strip(), f"unbalanced quotes in a shell block: {command[:200]}"
    return out


def is_curl(b: Block) -> bool:
    return b.lang in SHELLS and bool(curl_commands(b.text))


def is_client(b: Block) -> bool:
    return b.lang == "python" and re.search(r"(localhost|127\.0\.0\.1):8000", b.text) is not None


YAML = [b for b in ALL if b.lang in ("yaml", "yml") and b.not_run is None]
CURL = [b for b in ALL if is_curl(b) and b.not_run is None]
CLIENT = [b for b in ALL if is_client(b) and b.not_run is None]


def ids(bs: list[Block]) -> list[str]:
    return [b.where for b in bs]


# -- markers and links -----------------------------------------------------------------------


def test_markers_give_a_reason_and_sit_on_examples():
    for b in ALL:
        if b.not_run is not None:
            assert b.not_run, f"{b.where}: a not-run marker needs a reason"
            assert b.lang in ("yaml", "yml") or is_curl(b) or is_client(b), (
                f"{b.where}: a not-run marker on a block that would not run anyway"
            )


def test_readme_keeps_its_two_setup_commands():
    """The two commands a newcomer copies: serve from a fresh checkout, and test it."""
    shell = [b.text.strip() for b in blocks(ROOT / "README.md") if b.lang in SHELLS]
    assert (
        "python3 -m venv .venv && .venv/bin/pip install -e '.[cpu]' && .venv/bin/mlxd serve"
        in shell
    )
    assert "bash scripts/test.sh" in shell


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if m and not in_code:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for link in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = link.partition("#")
        target = (page.parent / unquote(path)).resolve() if path else page
        if not target.exists() and target not in LINKED_AHEAD:
            broken.append(f"{link}: no such file")
        elif (
            anchor
            and target.is_file()
            and target.suffix == ".md"
            and anchor not in _anchors(target)
        ):
            broken.append(f"{link}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_configuration_page_is_generated_from_the_settings():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_configuration_page_names_every_setting():
    """Every key, nested ones and list or mapping items included, has a heading and a
    description (a Field(description=...) in config.py)."""
    import typing

    from pydantic import BaseModel

    from mlxd.config import Settings

    page = (ROOT / "docs" / "configuration.md").read_text()

    def walk(model: type[BaseModel], path: str) -> None:
        for key, field in model.model_fields.items():
            here = f"{path}.{key}" if path else key
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, here)
                continue
            if path:
                assert f"### `{here}`" in page, f"{here} missing from docs/configuration.md"
                assert field.description, f"{here} has no description"
            origin, args = typing.get_origin(ann), typing.get_args(ann)
            item = args[-1] if origin in (list, dict) and args else None
            if isinstance(item, type) and issubclass(item, BaseModel):
                walk(item, here + ("[]" if origin is list else ".<name>"))

    walk(Settings, "")


# -- YAML ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", YAML, ids=ids(YAML))
def test_yaml_example_loads(block, tmp_path, monkeypatch):
    """Each config example loads with the loader `mlxd serve --config` uses."""
    from mlxd.config import load_settings

    for k in list(os.environ):
        if k.startswith("MLXD_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("MLXD_HOME", str(tmp_path / "home"))
    cfg = tmp_path / "config.yaml"
    cfg.write_text(block.text)
    load_settings(cfg)


# -- curl and clients against one server -----------------------------------------------------


def _wav(path: Path, seconds: float = 1.0, rate: int = 16000) -> None:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory, tool_qwen2):
    """The documented model names, each a tiny model of the same kind. Rerank requests that
    name no model go to a tiny cross-encoder: the tiny chat model has no single-token
    yes/no to serve as an LLM reranker."""
    from fixtures.tiny_audio import make_tiny_soprano, make_tiny_whisper
    from fixtures.tiny_encoders import make_tiny_bert_embedder, make_tiny_cross_encoder
    from fixtures.tiny_vlm import make_tiny_qwen2_vl

    from mlxd.store.local import ModelStore
    from mlxd.store.pull import pull

    home = tmp_path_factory.mktemp("docs-home")
    src = tmp_path_factory.mktemp("docs-src")
    settings = make_settings(
        home,
        "smollm2-135m-instruct",
        audio={
            "default_stt": "whisper-tiny",
            "default_tts": "soprano-80m",
            "max_tokens_per_window": 8,
            "tts_max_tokens": 6,
        },
        models={"default_reranker": "bge-reranker-base"},
        engine={"default_max_tokens": 16},
    )
    store = ModelStore(settings.models_dir)

    def minilm_sized(out: Path) -> Path:
        return make_tiny_bert_embedder(out, hidden=384, layers=1)

    for name, make in (
        ("all-minilm-l6-v2", minilm_sized),
        ("bge-reranker-base", make_tiny_cross_encoder),
        ("qwen2-vl-2b", make_tiny_qwen2_vl),
        ("whisper-tiny", make_tiny_whisper),
        ("soprano-80m", make_tiny_soprano),
    ):
        pull(store, str(make(src / name)), settings.models, as_name=name)
    pull(store, str(tool_qwen2), settings.models, as_name="smollm2-135m-instruct")
    files = tmp_path_factory.mktemp("docs-files")
    _wav(files / "speech.wav")
    srv = LiveServer(settings).start()
    srv.files = files
    yield srv
    srv.stop()


def _request(argv: list[str], files_dir: Path) -> dict:
    """httpx arguments for one curl command line (the options the docs use)."""
    method, url, headers, data, form = None, None, {}, None, []
    args = iter(argv[1:])
    for a in args:
        if a in ("-X", "--request"):
            method = next(args)
        elif a in ("-H", "--header"):
            k, _, v = next(args).partition(":")
            headers[k.strip()] = v.strip()
        elif a in ("-d", "--data", "--data-raw", "--data-binary"):
            data = next(args)
        elif a in ("-F", "--form"):
            form.append(next(args))
        elif a in ("-o", "--output"):
            next(args)
        elif a == "-I" or a == "--head":
            method = "HEAD"
        elif re.fullmatch(r"-[sSNfiLv]+|--silent|--no-buffer|--fail|--show-error", a):
            pass
        elif a.startswith("-"):
            raise AssertionError(f"curl option {a} is not understood by tests/test_docs.py")
        else:
            assert url is None, f"two URLs in {argv}"
            url = a
    assert url is not None, f"no URL in {argv}"
    parts = urlsplit(url if "://" in url else "http://" + url)
    assert parts.port in (8000, None) and parts.hostname in ("localhost", "127.0.0.1"), url
    kw: dict = {"headers": headers}
    if data is not None:
        kw["content"] = data.encode()
    if form:
        fields, uploads = {}, {}
        for f in form:
            k, _, v = f.partition("=")
            if v.startswith("@"):
                name = v[1:].split(";")[0]
                uploads[k] = (name, (files_dir / name).read_bytes())
            else:
                fields[k] = v
        kw["data"], kw["files"] = fields, uploads or None
    method = method or ("POST" if data is not None or form else "GET")
    return {"method": method, "url": parts.path + (f"?{parts.query}" if parts.query else ""), **kw}


@pytest.mark.parametrize("block", CURL, ids=ids(CURL))
def test_curl_example_answers(block, docs_server):
    expected = block.status
    with docs_server.client(timeout=300) as http:
        for argv in curl_commands(block.text):
            r = http.request(**_request(argv, docs_server.files))
            shown = f"{block.where}: {' '.join(argv)[:200]} -> {r.status_code} {r.text[:300]}"
            if expected is None:
                assert 200 <= r.status_code < 300, shown
            else:
                assert r.status_code == expected, shown


@pytest.mark.parametrize("block", CLIENT, ids=ids(CLIENT))
def test_client_snippet_runs(block, docs_server, tmp_path):
    """The official clients' snippets run as written, pointed at the test server."""
    code = re.sub(r"http://(localhost|127\.0\.0\.1):8000", docs_server.url, block.text)
    script = tmp_path / "snippet.py"
    script.write_text(code)
    r = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=docs_server.files,
        timeout=300,
    )
    assert r.returncode == 0, f"{block.where}:\n{r.stdout}\n{r.stderr}"
