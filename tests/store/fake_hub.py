"""A tiny stand-in for the Hugging Face hub: just what ``snapshot_download`` talks to.

Serves, for repos held in memory:

* ``GET /api/models/ORG/NAME[/revision/REV]``: model info with ``siblings`` (sizes, LFS
  sha256), as ``HfApi.model_info(files_metadata=True)`` reads it;
* ``GET /api/models/ORG/NAME/tree/REV``: the recursive file listing;
* ``HEAD|GET /ORG/NAME/resolve/REV/PATH``: the file, with ``X-Repo-Commit``, ``ETag`` /
  ``X-Linked-Etag`` / ``X-Linked-Size`` headers and ``Range`` support;
* 404 with ``X-Error-Code: RepoNotFound`` for anything else.

``slow`` (seconds per 4 KiB chunk of ``.safetensors`` bodies) makes a download last long
enough to be killed halfway; ``log`` records every request.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}
        self.slow = 0.0
        self.log: list[tuple[str, str]] = []
        self.big_download_started = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add_repo(self, repo_id: str, files: dict[str, bytes]) -> str:
        sha = hashlib.sha1(repo_id.encode() + b"".join(sorted(files.values()))).hexdigest()
        self.repos[repo_id] = {"sha": sha, "files": dict(files)}
        return sha

    def add_dir(self, repo_id: str, model_dir: Path) -> str:
        files = {
            f.relative_to(model_dir).as_posix(): f.read_bytes()
            for f in sorted(model_dir.rglob("*"))
            if f.is_file()
        }
        return self.add_repo(repo_id, files)

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def gets(self, path_suffix: str) -> int:
        return sum(1 for m, p in self.log if m == "GET" and p.endswith(path_suffix))

    # -------------------------------------------------------------------------------- #
    def _entry(self, path: str, data: bytes) -> dict:
        lfs = path.endswith(".safetensors")
        out = {"type": "file", "oid": _git_oid(data), "size": len(data), "path": path}
        if lfs:
            out["lfs"] = {
                "oid": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "pointerSize": 134,
            }
        return out

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _json(self, obj, status=200) -> None:
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _not_found(self, code="RepoNotFound") -> None:
                body = json.dumps({"error": "Repository not found"}).encode()
                self.send_response(404)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", "Repository not found")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_HEAD(self) -> None:
                self._serve()

            def do_GET(self) -> None:
                self._serve()

            def _serve(self) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.log.append((self.command, path))
                m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?/?$", path)
                if m and m.group(1) in hub.repos:
                    repo = hub.repos[m.group(1)]
                    siblings = []
                    for p, data in sorted(repo["files"].items()):
                        e = hub._entry(p, data)
                        sib = {"rfilename": p, "size": e["size"], "blobId": e["oid"]}
                        if "lfs" in e:
                            sib["lfs"] = {
                                "sha256": e["lfs"]["oid"],
                                "size": e["size"],
                                "pointerSize": 134,
                            }
                        siblings.append(sib)
                    return self._json(
                        {
                            "id": m.group(1),
                            "modelId": m.group(1),
                            "sha": repo["sha"],
                            "private": False,
                            "siblings": siblings,
                            "tags": [],
                        }
                    )
                m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?$", path)
                if m and m.group(1) in hub.repos:
                    repo = hub.repos[m.group(1)]
                    return self._json([hub._entry(p, d) for p, d in sorted(repo["files"].items())])
                m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
                if m and m.group(1) in hub.repos:
                    repo = hub.repos[m.group(1)]
                    data = repo["files"].get(m.group(3))
                    if data is None:
                        return self._not_found("EntryNotFound")
                    return self._file(repo, m.group(3), data)
                return self._not_found()

            def _file(self, repo: dict, name: str, data: bytes) -> None:
                e = hub._entry(name, data)
                etag = e["lfs"]["oid"] if "lfs" in e else e["oid"]
                start = 0
                rng = self.headers.get("Range")
                if rng and self.command == "GET":
                    start = int(re.match(r"bytes=(\d+)-", rng).group(1))
                body = data[start:]
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", repo["sha"])
                self.send_header("ETag", f'"{etag}"')
                if "lfs" in e:
                    self.send_header("X-Linked-Etag", f'"{etag}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if self.command == "HEAD":
                    return
                slow = hub.slow if name.endswith(".safetensors") else 0.0
                try:
                    for i in range(0, len(body), 4096):
                        self.wfile.write(body[i : i + 4096])
                        if slow:
                            self.wfile.flush()
                            hub.big_download_started.set()
                            time.sleep(slow)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        return Handler
