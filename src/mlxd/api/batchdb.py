"""The Batch API's state in SQLite: uploaded files, batch jobs, each job's lines, the lease.

One database per home (``$MLXD_HOME/mlxd.sqlite3``, WAL, shared with other tables of the
server's), tables of its own created if missing, and a schema version row of its own. A
line's result is written in the same transaction that marks it done and counts it, so after
a crash a line is either done (written once) or still pending (run again). File contents
live beside it in ``$MLXD_HOME/files/<id>``.

Every call is short and synchronous; the routes and the runner call it on a thread.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batch_schema (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batch_files (
    n INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batch_jobs (
    n INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    status TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS batch_jobs_status ON batch_jobs (status);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    custom_id TEXT,
    request TEXT,
    done INTEGER NOT NULL DEFAULT 0,
    ok INTEGER NOT NULL DEFAULT 0,
    result TEXT,
    PRIMARY KEY (batch_id, line)
);
CREATE TABLE IF NOT EXISTS batch_lease (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    expires REAL NOT NULL
);
"""

# A job in one of these still needs the runner.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class BatchDB:
    """The database and the files folder of one home."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.files_dir = home / "files"  # made by the first upload
        home.mkdir(parents=True, exist_ok=True)
        self.path = home / "mlxd.sqlite3"
        # one connection, used from worker threads one at a time
        self._conn = sqlite3.connect(
            self.path, timeout=30, check_same_thread=False, isolation_level=None
        )
        self._lock = threading.Lock()
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(_SCHEMA)  # each statement idempotent
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                row = self._conn.execute("SELECT version FROM batch_schema").fetchone()
                if row is None:
                    self._conn.execute(
                        "INSERT INTO batch_schema (version) VALUES (?)", (SCHEMA_VERSION,)
                    )
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _tx(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(conn, *args)`` in one write transaction."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                out = fn(self._conn, *args)
                self._conn.execute("COMMIT")
                return out
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    # -- files -----------------------------------------------------------------------------
    def file_path(self, file_id: str) -> Path:
        self.files_dir.mkdir(parents=True, exist_ok=True)
        return self.files_dir / file_id

    def add_file(self, file_id: str, owner: str, purpose: str, filename: str, size: int) -> dict:
        created = int(time.time())
        self._tx(
            lambda c: c.execute(
                "INSERT INTO batch_files (id, owner, purpose, filename, bytes, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (file_id, owner, purpose, filename, size, created),
            )
        )
        return file_object((file_id, purpose, filename, size, created))

    def get_file(self, owner: str, file_id: str) -> dict | None:
        rows = self._read(
            "SELECT id, purpose, filename, bytes, created_at FROM batch_files "
            "WHERE id = ? AND owner = ?",
            (file_id, owner),
        )
        return file_object(rows[0]) if rows else None

    def list_files(
        self, owner: str, purpose: str | None, limit: int, after: str | None, ascending: bool
    ) -> tuple[list[dict], bool]:
        sql = "SELECT id, purpose, filename, bytes, created_at FROM batch_files WHERE owner = ?"
        args: list[Any] = [owner]
        if purpose:
            sql += " AND purpose = ?"
            args.append(purpose)
        if after:
            cmp = ">" if ascending else "<"
            sql += f" AND n {cmp} (SELECT n FROM batch_files WHERE id = ? AND owner = ?)"
            args += [after, owner]
        sql += f" ORDER BY n {'ASC' if ascending else 'DESC'} LIMIT ?"
        args.append(limit + 1)
        rows = self._read(sql, tuple(args))
        return [file_object(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, owner: str, file_id: str) -> bool:
        cur = self._tx(
            lambda c: c.execute(
                "DELETE FROM batch_files WHERE id = ? AND owner = ?", (file_id, owner)
            )
        )
        if cur.rowcount:
            self.file_path(file_id).unlink(missing_ok=True)
        return bool(cur.rowcount)

    # -- jobs ------------------------------------------------------------------------------
    def add_job(self, owner: str, job: dict) -> None:
        self._tx(
            lambda c: c.execute(
                "INSERT INTO batch_jobs (id, owner, status, data) VALUES (?, ?, ?, ?)",
                (job["id"], owner, job["status"], json.dumps(job)),
            )
        )

    def get_job(self, owner: str | None, batch_id: str) -> dict | None:
        if owner is None:
            rows = self._read("SELECT data FROM batch_jobs WHERE id = ?", (batch_id,))
        else:
            rows = self._read(
                "SELECT data FROM batch_jobs WHERE id = ? AND owner = ?", (batch_id, owner)
            )
        return json.loads(rows[0][0]) if rows else None

    def job_owner(self, batch_id: str) -> str | None:
        rows = self._read("SELECT owner FROM batch_jobs WHERE id = ?", (batch_id,))
        return rows[0][0] if rows else None

    def list_jobs(self, owner: str, limit: int, after: str | None) -> tuple[list[dict], bool]:
        sql = "SELECT data FROM batch_jobs WHERE owner = ?"
        args: list[Any] = [owner]
        if after:
            sql += " AND n < (SELECT n FROM batch_jobs WHERE id = ? AND owner = ?)"
            args += [after, owner]
        sql += " ORDER BY n DESC LIMIT ?"
        args.append(limit + 1)
        rows = self._read(sql, tuple(args))
        return [json.loads(r[0]) for r in rows[:limit]], len(rows) > limit

    def active_jobs(self) -> list[str]:
        marks = ",".join("?" * len(ACTIVE))
        rows = self._read(f"SELECT id FROM batch_jobs WHERE status IN ({marks}) ORDER BY n", ACTIVE)
        return [r[0] for r in rows]

    def update_job(self, batch_id: str, **changes: Any) -> dict:
        """Apply ``changes`` to a job's object (read and written in one transaction)."""

        def run(c: sqlite3.Connection) -> dict:
            return _update(c, batch_id, changes)

        out: dict = self._tx(run)
        return out

    def cancel_job(self, owner: str, batch_id: str) -> dict | None:
        """Move an unfinished job to ``cancelling``; a finished one is returned unchanged."""

        def run(c: sqlite3.Connection) -> dict | None:
            row = c.execute(
                "SELECT data FROM batch_jobs WHERE id = ? AND owner = ?", (batch_id, owner)
            ).fetchone()
            if row is None:
                return None
            job = json.loads(row[0])
            if job["status"] in ("validating", "in_progress"):
                return _update(
                    c, batch_id, {"status": "cancelling", "cancelling_at": int(time.time())}
                )
            return job

        out: dict | None = self._tx(run)
        return out

    # -- lines -----------------------------------------------------------------------------
    def start_job(
        self, batch_id: str, lines: list[tuple[int, str | None, str | None, Any]]
    ) -> dict:
        """Store a validated job's lines (line number, custom_id, request JSON, or an error
        result for a line that failed validation) and move it to ``in_progress``."""

        def run(c: sqlite3.Connection) -> dict:
            c.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))
            failed = 0
            for line, custom_id, request, error in lines:
                if error is None:
                    c.execute(
                        "INSERT INTO batch_lines (batch_id, line, custom_id, request) "
                        "VALUES (?, ?, ?, ?)",
                        (batch_id, line, custom_id, request),
                    )
                else:
                    failed += 1
                    c.execute(
                        "INSERT INTO batch_lines (batch_id, line, custom_id, done, ok, result) "
                        "VALUES (?, ?, ?, 1, 0, ?)",
                        (batch_id, line, custom_id, json.dumps(error)),
                    )
            counts = {"total": len(lines), "completed": 0, "failed": failed}
            return _update(
                c,
                batch_id,
                {
                    "status": "in_progress",
                    "in_progress_at": int(time.time()),
                    "request_counts": counts,
                },
                only_if="validating",
            )

        out: dict = self._tx(run)
        return out

    def pending_lines(self, batch_id: str) -> list[tuple[int, str | None, str]]:
        rows = self._read(
            "SELECT line, custom_id, request FROM batch_lines "
            "WHERE batch_id = ? AND done = 0 ORDER BY line",
            (batch_id,),
        )
        return [(r[0], r[1], r[2]) for r in rows]

    def finish_line(self, batch_id: str, line: int, ok: bool, result: dict) -> bool:
        """Record a line's result and count it, once: False when it was already done."""

        def run(c: sqlite3.Connection) -> bool:
            cur = c.execute(
                "UPDATE batch_lines SET done = 1, ok = ?, result = ? "
                "WHERE batch_id = ? AND line = ? AND done = 0",
                (int(ok), json.dumps(result), batch_id, line),
            )
            if not cur.rowcount:
                return False
            row = c.execute("SELECT data FROM batch_jobs WHERE id = ?", (batch_id,)).fetchone()
            counts = dict(json.loads(row[0])["request_counts"])
            counts["completed" if ok else "failed"] += 1
            _update(c, batch_id, {"request_counts": counts})
            return True

        out: bool = self._tx(run)
        return out

    def results(self, batch_id: str) -> list[tuple[int, str | None, str | None, int, int, str]]:
        """Every line: (line, custom_id, request, done, ok, result JSON or "")."""
        rows = self._read(
            "SELECT line, custom_id, request, done, ok, coalesce(result, '') FROM batch_lines "
            "WHERE batch_id = ? ORDER BY line",
            (batch_id,),
        )
        return [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows]

    def finish_job(
        self, batch_id: str, files: list[tuple[str, str, str, int]], owner: str, changes: dict
    ) -> dict:
        """Register the job's output files (id, purpose, filename, bytes), drop its lines and
        set its final state, in one transaction."""

        def run(c: sqlite3.Connection) -> dict:
            now = int(time.time())
            for fid, purpose, filename, size in files:
                c.execute(
                    "INSERT INTO batch_files (id, owner, purpose, filename, bytes, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (fid, owner, purpose, filename, size, now),
                )
            c.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))
            return _update(c, batch_id, changes)

        out: dict = self._tx(run)
        return out

    # -- the runner's lease ----------------------------------------------------------------
    def take_lease(self, holder: str, ttl: float) -> bool:
        """Hold (or keep) the runner's lease for ``ttl`` seconds; False while another
        process holds one that has not expired."""

        def run(c: sqlite3.Connection) -> bool:
            now = time.time()
            row = c.execute(
                "SELECT holder, expires FROM batch_lease WHERE name = 'runner'"
            ).fetchone()
            if row is not None and row[0] != holder and row[1] > now:
                return False
            c.execute(
                "INSERT OR REPLACE INTO batch_lease (name, holder, expires) "
                "VALUES ('runner', ?, ?)",
                (holder, now + ttl),
            )
            return True

        out: bool = self._tx(run)
        return out

    def drop_lease(self, holder: str) -> None:
        self._tx(
            lambda c: c.execute(
                "DELETE FROM batch_lease WHERE name = 'runner' AND holder = ?", (holder,)
            )
        )


def _update(
    c: sqlite3.Connection, batch_id: str, changes: dict, only_if: str | None = None
) -> dict:
    row = c.execute("SELECT data FROM batch_jobs WHERE id = ?", (batch_id,)).fetchone()
    job = json.loads(row[0])
    if only_if is not None and job["status"] != only_if:
        return job
    job.update(changes)
    c.execute(
        "UPDATE batch_jobs SET status = ?, data = ? WHERE id = ?",
        (job["status"], json.dumps(job), batch_id),
    )
    return job


def file_object(row: tuple) -> dict:
    """A file row in OpenAI's shape."""
    fid, purpose, filename, size, created = row
    return {
        "id": fid,
        "object": "file",
        "bytes": size,
        "created_at": created,
        "expires_at": None,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
    }


def holder_id() -> str:
    """This process's name in the lease: its pid and a random part (pids are reused)."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
