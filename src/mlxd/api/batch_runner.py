"""Runs Batch API jobs in the front end: each line through the app itself, in-process.

Exactly one front end runs jobs: the one holding the lease row in SQLite (renewed every
few seconds, taken over when it expires, as after a crash). A line is sent to its route
through ``httpx.ASGITransport`` acting for the batch's owner (``mlxd.acting_for`` in the
ASGI scope, which only an in-process caller can set; api/security.py), so it meets the same
validation, templates and errors as over HTTP. A line's result is recorded once, with its
count, in one transaction (api/batchdb.py); a restart runs what was still pending.

Batch lines have the lowest priority: at most ``batch.max_concurrent`` in flight; an
interactive request's arrival stops the generation lines in flight (the route ends each as
for a client that left, 499; nothing is recorded; they are sent again later), none starts
for a second after it, and then one at most while interactive requests run.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxd.api.batchdb import BatchDB, holder_id, new_id
from mlxd.api.owner import LOCAL_OPERATOR, LOCAL_OWNER, Principal
from mlxd.core.types import BATCH_PRIORITY

log = logging.getLogger(__name__)

LEASE_TTL_S = 10.0
TICK_S = 2.0
GRACE_S = 1.0  # after an interactive request arrives, no batch line starts for this long
MAX_LINES = 50_000
# Answers that mean "not now": the line stays pending and is sent again.
RETRY_CODES = frozenset({"queue_full", "service_unavailable", "shutting_down"})
ACTING_FOR = "mlxd.acting_for"
# POSTs that run no model: uploads, batch calls, the model store's long operations
NOT_INTERACTIVE = ("/v1/files", "/v1/batches", "/api/pull", "/api/push", "/api/create")


# Set by a line's task around its request: setting the event makes the request's client
# "leave" (the route ends it as for a client that disconnects, 499).
_STOP: contextvars.ContextVar[asyncio.Event | None] = contextvars.ContextVar(
    "mlxd_batch_line_stop", default=None
)


class _ActingFor:
    """The app, called with the ASGI scope marked as acting for ``who``."""

    def __init__(self, app: ASGIApp, who: Principal) -> None:
        self.app, self.who = app, who

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stop = _STOP.get()
        body_done = False

        async def leave_on_stop() -> Message:
            nonlocal body_done
            if not body_done or stop is None:
                message = await receive()
                body_done = not message.get("more_body", False)
                return message
            got = asyncio.ensure_future(receive())
            halt = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({got, halt}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                halt.cancel()
            if got.done():
                return got.result()
            got.cancel()
            return {"type": "http.disconnect"}

        await self.app({**scope, ACTING_FOR: self.who}, leave_on_stop, send)


@dataclass
class Interactive:
    """The interactive requests in flight in this front end; ``on_arrival`` is called as
    each one comes in."""

    count: int = 0
    last_arrival: float = 0.0  # time.monotonic()
    on_arrival: Callable[[], None] | None = None


class InteractiveGauge:
    """Counts the interactive requests in flight (POSTs not sent by a batch, other than
    those of ``NOT_INTERACTIVE``) from the moment they arrive, before their template
    renders: the signal a batch yields to."""

    def __init__(self, app: ASGIApp, interactive: Interactive) -> None:
        self.app = app
        self.gauge = interactive

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        counted = (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and ACTING_FOR not in scope
            and not scope["path"].startswith(NOT_INTERACTIVE)
        )
        if not counted:
            await self.app(scope, receive, send)
            return
        self.gauge.count += 1
        self.gauge.last_arrival = time.monotonic()
        if self.gauge.on_arrival is not None:
            self.gauge.on_arrival()
        try:
            await self.app(scope, receive, send)
        finally:
            self.gauge.count -= 1


def _line_error(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def parse_lines(
    raw: bytes, endpoint: str
) -> tuple[list[tuple[int, str | None, str | None, Any]], list[dict[str, Any]]]:
    """A batch file's lines as (line number, custom_id, request JSON or None, error result or
    None), and the errors that fail the file as a whole (OpenAI's ``errors.data``)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return [], [{"code": "invalid_file", "message": "the file is not UTF-8 text"}]
    out: list[tuple[int, str | None, str | None, Any]] = []
    seen: dict[str, int] = {}
    fatal: list[dict[str, Any]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        cid: str | None = None
        try:
            obj = json.loads(line)
        except ValueError:
            out.append((n, None, None, _line_error(None, "invalid_json", "the line is not JSON")))
            continue
        if not isinstance(obj, dict):
            out.append((n, None, None, _line_error(None, "invalid_json", "not a JSON object")))
            continue
        if isinstance(obj.get("custom_id"), str) and obj["custom_id"]:
            cid = obj["custom_id"]
        problem = None
        if cid is None:
            problem = ("missing_custom_id", "custom_id must be a non-empty string")
        elif obj.get("method") != "POST":
            problem = ("invalid_method", 'method must be "POST"')
        elif obj.get("url") != endpoint:
            problem = ("invalid_url", f"url must be the batch's endpoint {endpoint}")
        elif not isinstance(obj.get("body"), dict):
            problem = ("invalid_body", "body must be a JSON object")
        elif obj["body"].get("stream"):
            problem = ("invalid_body", "stream is not supported in a batch")
        if problem is not None:
            out.append((n, cid, None, _line_error(cid, *problem)))
            continue
        assert cid is not None
        if cid in seen:
            fatal.append(
                {
                    "code": "duplicate_custom_id",
                    "message": f"custom_id '{cid}' also on line {seen[cid]}",
                    "param": "custom_id",
                    "line": n,
                }
            )
            continue
        seen[cid] = n
        out.append((n, cid, json.dumps(obj["body"]), None))
    if not out and not fatal:
        fatal.append({"code": "empty_file", "message": "the file holds no requests"})
    if len(out) > MAX_LINES:
        fatal.append({"code": "too_many_requests", "message": f"more than {MAX_LINES} lines"})
    return out, fatal


def _file_id(batch_id: str, kind: str) -> str:
    """The output or error file's id, the same on every try (a retried finish overwrites)."""
    return "file-" + uuid.uuid5(uuid.NAMESPACE_URL, f"mlxd:{batch_id}:{kind}").hex


class BatchRunner:
    """The jobs' task in one front end; idle unless it holds the lease."""

    def __init__(self, app: Any, db: BatchDB, gauge: Interactive | None = None) -> None:
        self.app = app
        self.gauge = gauge
        self.db = db
        self.settings = app.state.settings
        self.holder = holder_id()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._jobs: dict[str, asyncio.Task] = {}
        self._inflight = 0  # this runner's lines in flight
        self._gen_inflight = 0  # of those, generations (they count in the runtime's load)
        self._stops: set[asyncio.Event] = set()  # one per generation line whose request runs
        if gauge is not None:
            gauge.on_arrival = self.preempt
        self.held = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *self._jobs.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.held:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.db.drop_lease, self.holder)
        if getattr(self.app.state, "batch_db", None) is self.db:
            self.app.state.batch_db = None  # opened again if the app starts again
        await asyncio.to_thread(self.db.close)

    async def _loop(self) -> None:
        while True:
            try:
                self.held = await asyncio.to_thread(self.db.take_lease, self.holder, LEASE_TTL_S)
                if not self.held:
                    for t in self._jobs.values():
                        t.cancel()
                else:
                    for bid in await asyncio.to_thread(self.db.active_jobs):
                        if bid not in self._jobs:
                            task = asyncio.create_task(self._run(bid))
                            self._jobs[bid] = task
                            task.add_done_callback(self._forget)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a locked or failing database: try next tick
                log.exception("batch runner: cannot read the job list")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)

    def preempt(self) -> None:
        """An interactive request arrived: the lines whose requests run now stop (their
        sequences leave the engine's batch) and go back to their queue."""
        for stop in self._stops:
            stop.set()

    def _forget(self, task: asyncio.Task) -> None:
        for bid, t in list(self._jobs.items()):
            if t is task:
                del self._jobs[bid]

    # -- capacity ----------------------------------------------------------------------------
    def _cap(self) -> int:
        if self.settings.batch.max_concurrent:
            return int(self.settings.batch.max_concurrent)
        rt = self.app.state.runtime
        queued = self.settings.engine.max_queued_requests * max(1, len(rt.cores.clients))
        return max(1, (rt.admission_limit - queued) // 4)

    def _room(self) -> bool:
        """May one more line start: under the cap, and alone while interactive requests run."""
        rt = self.app.state.runtime
        if rt.draining:
            return False
        interactive = self.gauge.count if self.gauge is not None else 0
        if rt.front_ends is not None:  # --api-workers N: the others' requests, per heartbeat
            load = sum(c.core_load for c in rt.cores.clients)
            interactive = max(interactive, load - self._gen_inflight)
        if interactive <= 0:
            return self._inflight < self._cap()
        # none beside a request that just came (its prefill), then one: a long stream
        # must not stop the batch
        fresh = self.gauge is not None and time.monotonic() - self.gauge.last_arrival < GRACE_S
        return not fresh and self._inflight < 1

    async def _slot(self) -> None:
        while not self._room():
            await asyncio.sleep(0.01)
        self._inflight += 1

    # -- one job -----------------------------------------------------------------------------
    async def _run(self, batch_id: str) -> None:
        try:
            job = await asyncio.to_thread(self.db.get_job, None, batch_id)
            owner = await asyncio.to_thread(self.db.job_owner, batch_id)
            if job is None or owner is None:
                return
            if job["status"] == "validating":
                job = await self._validate(job, owner)
            if job["status"] in ("in_progress", "cancelling"):
                job = await self._execute(job, owner)
            await self._finish(job, owner)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - logged; the job is tried again on the next tick
            log.exception("batch %s: runner error", batch_id)
            await asyncio.sleep(TICK_S)

    async def _validate(self, job: dict, owner: str) -> dict:
        bid = job["id"]
        path = self.db.file_path(job["input_file_id"])
        meta = await asyncio.to_thread(self.db.get_file, owner, job["input_file_id"])
        if meta is None or not path.is_file():
            fatal: list[dict[str, Any]] = [
                {"code": "file_not_found", "message": "the input file was deleted"}
            ]
            lines: list = []
        else:
            raw = await asyncio.to_thread(path.read_bytes)
            lines, fatal = await asyncio.to_thread(parse_lines, raw, job["endpoint"])
        if fatal:
            for e in fatal:
                e.setdefault("param", None)
                e.setdefault("line", None)
            return await asyncio.to_thread(
                self.db.update_job,
                bid,
                status="failed",
                failed_at=int(time.time()),
                errors={"object": "list", "data": fatal},
            )
        return await asyncio.to_thread(self.db.start_job, bid, lines)

    async def _status(self, batch_id: str) -> str:
        job = await asyncio.to_thread(self.db.get_job, None, batch_id)
        return job["status"] if job else "cancelling"

    async def _execute(self, job: dict, owner: str) -> dict:
        bid = job["id"]
        who = LOCAL_OPERATOR if owner == LOCAL_OWNER else Principal(owner, name="batch")
        transport = httpx.ASGITransport(app=_ActingFor(self.app, who))
        running: set[asyncio.Task] = set()
        async with httpx.AsyncClient(
            transport=transport, base_url="http://127.0.0.1", timeout=None
        ) as client:
            try:
                queue = list(await asyncio.to_thread(self.db.pending_lines, bid))
                gen = job["endpoint"] != "/v1/embeddings"
                while queue or running:
                    if not queue:  # a line sent back (429, 503) lands in the queue again
                        await asyncio.wait(set(running), return_when=asyncio.FIRST_COMPLETED)
                        continue
                    if time.time() >= job["expires_at"] or await self._status(bid) != (
                        "in_progress"
                    ):
                        break
                    await self._slot()
                    task = asyncio.create_task(self._line(client, job, queue.pop(0), gen, queue))
                    running.add(task)
                    task.add_done_callback(running.discard)
                if running:
                    await asyncio.gather(*running, return_exceptions=True)
            finally:
                for t in running:
                    t.cancel()
        out: dict | None = await asyncio.to_thread(self.db.get_job, None, bid)
        return out or job

    async def _line(
        self,
        client: httpx.AsyncClient,
        job: dict,
        line: tuple[int, str | None, str],
        gen: bool,
        queue: list,
    ) -> None:
        n, cid, body = line
        if gen:
            self._gen_inflight += 1
        stop = asyncio.Event()
        try:
            if gen:
                self._stops.add(stop)
            token = _STOP.set(stop)
            try:
                r = await client.post(
                    job["endpoint"],
                    content=_at_batch_priority(body) if gen else body,
                    headers={"content-type": "application/json"},
                )
            except Exception as exc:  # noqa: BLE001 - the route crashed: this line fails
                result = _line_error(cid, "internal_error", f"{type(exc).__name__}: {exc}")
                await asyncio.to_thread(self.db.finish_line, job["id"], n, False, result)
                return
            finally:
                _STOP.reset(token)
                self._stops.discard(stop)
            if stop.is_set() and r.status_code == 499:
                queue.append(line)  # preempted: sent again later, nothing recorded
                return
            try:
                payload: Any = r.json()
            except ValueError:
                payload = r.text
            err = payload.get("error") if isinstance(payload, dict) else None
            code = err.get("code") if isinstance(err, dict) else None
            if r.status_code in (429, 503) and code in RETRY_CODES:
                queue.append(line)  # not now: sent again after a pause
                await asyncio.sleep(1.0)
                return
            ok = 200 <= r.status_code < 300
            result = {
                "id": new_id("batch_req_"),
                "custom_id": cid,
                "response": {
                    "status_code": r.status_code,
                    "request_id": r.headers.get("x-request-id", ""),
                    "body": payload,
                },
                "error": None,
            }
            await asyncio.to_thread(self.db.finish_line, job["id"], n, ok, result)
        finally:
            self._inflight -= 1
            if gen:
                self._gen_inflight -= 1

    async def _finish(self, job: dict, owner: str) -> None:
        """Write the output and error files and set the job's final state."""
        bid = job["id"]
        status = job["status"]
        if status not in ("in_progress", "cancelling", "finalizing"):
            return  # failed at validation: nothing to write
        now = int(time.time())
        if status == "cancelling":
            final = {"status": "cancelled", "cancelled_at": now}
        elif status == "in_progress" and await asyncio.to_thread(self.db.pending_lines, bid):
            if time.time() < job["expires_at"]:
                return  # stopped early (the runner stops): resumed later
            final = {"status": "expired", "expired_at": now}
        else:
            if status == "in_progress":
                job = await asyncio.to_thread(
                    self.db.update_job, bid, status="finalizing", finalizing_at=now
                )
            final = {"status": "completed", "completed_at": int(time.time())}
        rows = await asyncio.to_thread(self.db.results, bid)
        good: list[str] = []
        bad: list[str] = []
        expired = 0
        for _, cid, _, done, ok, result in rows:
            if done:
                (good if ok else bad).append(result)
            elif final["status"] == "expired":
                expired += 1
                bad.append(
                    json.dumps(_line_error(cid, "batch_expired", "the batch's window ended"))
                )
        files: list[tuple[str, str, str, int]] = []
        for kind, lines in (("output", good), ("error", bad)):
            if not lines:
                continue
            fid = _file_id(bid, kind)
            data = ("\n".join(lines) + "\n").encode()
            await asyncio.to_thread(self._write, fid, data)
            files.append((fid, f"batch_{kind}", f"{bid}_{kind}.jsonl", len(data)))
            final[f"{kind}_file_id"] = fid
        if expired:
            counts = dict(job["request_counts"])
            counts["failed"] += expired
            final["request_counts"] = counts
        await asyncio.to_thread(self.db.finish_job, bid, files, owner, final)

    def _write(self, fid: str, data: bytes) -> None:
        path = self.db.file_path(fid)
        tmp = path.with_name(path.name + ".part")
        tmp.write_bytes(data)
        tmp.replace(path)


def _at_batch_priority(body: str) -> str:
    """A generation line's body at the batch priority (core/types.py BATCH_PRIORITY), so the
    engine's scheduler admits interactive requests first and may preempt batch rows; a line
    that names its own priority keeps it."""
    obj = json.loads(body)
    if isinstance(obj, dict) and "priority" not in obj:
        obj["priority"] = BATCH_PRIORITY
        return json.dumps(obj)
    return body
