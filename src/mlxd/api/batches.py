"""OpenAI's Files and Batch APIs: ``/v1/files`` and ``/v1/batches``.

Files are uploaded as a multipart form (``file``, ``purpose``), kept in
``$MLXD_HOME/files/`` with their metadata in SQLite (api/batchdb.py), and belong to the
API key that uploaded them (api/owner.py): for any other key a file or batch is "not found",
exactly like a missing one. A batch runs every line of a ``purpose: batch`` JSONL file
through the route its ``endpoint`` names (api/batch_runner.py) and writes an output file
and an error file of its own.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse
from pydantic import Field, field_validator

from mlxd.api.batch_runner import BatchRunner, Interactive, InteractiveGauge
from mlxd.api.batchdb import BatchDB, new_id
from mlxd.api.owner import principal
from mlxd.api.routing import ApiRoute, UploadRoute
from mlxd.api.wire import WireModel
from mlxd.config import mlxd_home
from mlxd.core.errors import InvalidRequest, MlxdError, PayloadTooLarge, Unavailable

log = logging.getLogger(__name__)
uploads = APIRouter(route_class=UploadRoute)
router = APIRouter(route_class=ApiRoute)

# OpenAI's purposes; only "batch" files may be a batch's input.
PURPOSES = frozenset({"assistants", "batch", "fine-tune", "vision", "user_data", "evals"})
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
WINDOW_S = 24 * 3600


class NotFound(MlxdError):
    """A file or batch that does not exist, or belongs to another key (the same answer)."""

    status = 404
    code = "not_found"
    type = "invalid_request_error"


class Conflict(MlxdError):
    """The object is in a state that does not allow the action (cancel a finished batch)."""

    status = 409
    code = "conflict"
    type = "invalid_request_error"


def open_db(app: Any) -> BatchDB:
    """The app's database (opened on first use, in ``$MLXD_HOME``); 503 when it cannot be
    opened (a home that is not writable), which leaves every other route serving."""
    db: BatchDB | None = getattr(app.state, "batch_db", None)
    if db is None:
        try:
            db = app.state.batch_db = BatchDB(mlxd_home())
        except (OSError, sqlite3.Error) as exc:
            log.error("the Batch API's database cannot be opened: %s", exc)
            raise Unavailable(f"the batch database cannot be opened: {exc}") from exc
    return db


def install(app: Any) -> None:
    """The routes, and the gauge of interactive requests the runner yields to."""
    app.include_router(uploads)
    app.include_router(router)
    app.state.interactive = Interactive()
    app.add_middleware(InteractiveGauge, interactive=app.state.interactive)


def start_runner(app: Any) -> BatchRunner | None:
    """The jobs' runner of this front end, started; None without a database."""
    try:
        runner = BatchRunner(app, open_db(app), getattr(app.state, "interactive", None))
    except Unavailable:
        return None
    app.state.batch_runner = runner
    runner.start()
    return runner


def batch_db(request: Request) -> BatchDB:
    return open_db(request.app)


def _owner(request: Request) -> str:
    who = principal(request)
    if not who.owner:
        raise NotFound("no such object")
    return who.owner


def _page(data: list[dict], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


# -- files ---------------------------------------------------------------------------------------


def _store_upload(src: Any, dest: Path, limit: int) -> int:
    """Copy an upload to ``dest`` (via a temporary name); its size, or -1 past ``limit``."""
    tmp = dest.with_name(dest.name + ".part")
    size = 0
    try:
        with tmp.open("wb") as out:
            src.seek(0)
            while chunk := src.read(1 << 20):
                size += len(chunk)
                if size > limit:
                    return -1
                out.write(chunk)
        tmp.replace(dest)
        return size
    finally:
        tmp.unlink(missing_ok=True)


@uploads.post("/v1/files")
async def create_file(
    request: Request,
    file: Annotated[UploadFile, File()],
    purpose: Annotated[str, Form()],
) -> dict[str, Any]:
    owner = _owner(request)
    if purpose not in PURPOSES:
        raise InvalidRequest(
            f"purpose must be one of {', '.join(sorted(PURPOSES))}", param="purpose"
        )
    db = batch_db(request)
    limit = request.app.state.settings.batch.max_file_bytes
    fid = new_id("file-")
    size = await asyncio.to_thread(_store_upload, file.file, db.file_path(fid), limit)
    if size < 0:
        raise PayloadTooLarge(
            f"file larger than {limit} bytes (batch.max_file_bytes)", param="file"
        )
    name = Path(file.filename or "upload").name[:255] or "upload"
    try:
        return await asyncio.to_thread(db.add_file, fid, owner, purpose, name, size)
    except BaseException:
        db.file_path(fid).unlink(missing_ok=True)
        raise


@router.get("/v1/files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    owner = _owner(request)
    data, more = await asyncio.to_thread(
        batch_db(request).list_files, owner, purpose, limit, after, order == "asc"
    )
    return _page(data, more)


async def _file(request: Request, file_id: str) -> dict:
    found = await asyncio.to_thread(batch_db(request).get_file, _owner(request), file_id)
    if found is None:
        raise NotFound(f"no file with id '{file_id}'", param="file_id")
    return found


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request) -> dict[str, Any]:
    return await _file(request, file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> FileResponse:
    meta = await _file(request, file_id)
    path = batch_db(request).file_path(file_id)
    if not path.is_file():
        raise NotFound(f"no file with id '{file_id}'", param="file_id")
    return FileResponse(path, media_type="application/octet-stream", filename=meta["filename"])


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
    if not await asyncio.to_thread(batch_db(request).delete_file, _owner(request), file_id):
        raise NotFound(f"no file with id '{file_id}'", param="file_id")
    return {"id": file_id, "object": "file", "deleted": True}


# -- batches -------------------------------------------------------------------------------------


class BatchCreate(WireModel):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if v not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}")
        return v

    @field_validator("completion_window")
    @classmethod
    def _window(cls, v: str) -> str:
        if v != "24h":
            raise ValueError('completion_window must be "24h"')
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for k, val in (v or {}).items():
            if len(k) > 64 or len(val) > 512:
                raise ValueError("metadata keys hold at most 64 characters, values 512")
        return v


def new_batch(body: BatchCreate) -> dict[str, Any]:
    now = int(time.time())
    return {
        "id": new_id("batch_"),
        "object": "batch",
        "endpoint": body.endpoint,
        "errors": None,
        "input_file_id": body.input_file_id,
        "completion_window": body.completion_window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + WINDOW_S,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": body.metadata,
    }


@router.post("/v1/batches")
async def create_batch(body: BatchCreate, request: Request) -> dict[str, Any]:
    owner = _owner(request)
    db = batch_db(request)
    found = await asyncio.to_thread(db.get_file, owner, body.input_file_id)
    if found is None:
        raise NotFound(f"no file with id '{body.input_file_id}'", param="input_file_id")
    if found["purpose"] != "batch":
        raise InvalidRequest(
            f"file '{body.input_file_id}' has purpose '{found['purpose']}', not 'batch'",
            param="input_file_id",
        )
    job = new_batch(body)
    await asyncio.to_thread(db.add_job, owner, job)
    runner = getattr(request.app.state, "batch_runner", None)
    if runner is not None:
        runner.wake()
    return job


@router.get("/v1/batches")
async def list_batches(
    request: Request,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> dict[str, Any]:
    owner = _owner(request)
    data, more = await asyncio.to_thread(batch_db(request).list_jobs, owner, limit, after)
    return _page(data, more)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request) -> dict[str, Any]:
    job = await asyncio.to_thread(batch_db(request).get_job, _owner(request), batch_id)
    if job is None:
        raise NotFound(f"no batch with id '{batch_id}'", param="batch_id")
    return job


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
    job = await asyncio.to_thread(batch_db(request).cancel_job, _owner(request), batch_id)
    if job is None:
        raise NotFound(f"no batch with id '{batch_id}'", param="batch_id")
    if job["status"] not in ("cancelling", "cancelled"):
        raise Conflict(f"a batch with status '{job['status']}' cannot be cancelled")
    runner = getattr(request.app.state, "batch_runner", None)
    if runner is not None:
        runner.wake()
    return job
