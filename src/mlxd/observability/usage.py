"""Usage per API key name and model, by the hour, kept in SQLite (``$MLXD_HOME/mlxd.sqlite3``).

Each front end counts in memory (:meth:`UsageStore.record`, on the event loop, no I/O) and
writes its counts every few seconds and at shutdown (:meth:`UsageStore.flush`) as upserts
that add to the row: several front ends (``--api-workers``) and restarts add up instead of
overwriting each other. The key's *name* is stored, never the key. Rows older than the
retention are deleted on each flush. The database is shared with other tables of the
server (WAL, each user its own connection and its own tables).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOUR = 3600
DAY = 86400

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_hourly (
    hour INTEGER NOT NULL,
    key_name TEXT NOT NULL,
    model TEXT NOT NULL,
    requests INTEGER NOT NULL DEFAULT 0,
    errors INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (hour, key_name, model)
);
"""

_UPSERT = """
INSERT INTO usage_hourly (hour, key_name, model, requests, errors, input_tokens, output_tokens)
VALUES (?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (hour, key_name, model) DO UPDATE SET
    requests = requests + excluded.requests,
    errors = errors + excluded.errors,
    input_tokens = input_tokens + excluded.input_tokens,
    output_tokens = output_tokens + excluded.output_tokens
"""


@dataclass
class Counts:
    requests: int = 0
    errors: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


class UsageStore:
    """The usage table of one database file; ``retention_days`` bounds what it keeps."""

    def __init__(self, path: Path, retention_days: int = 90) -> None:
        self.path = Path(path)
        self.retention_s = retention_days * DAY
        self._pending: dict[tuple[int, str, str], Counts] = {}
        self._lock = threading.Lock()  # flushes run in a thread; records on the loop
        self._db_lock = threading.Lock()  # one connection, used from worker threads
        self._db: sqlite3.Connection | None = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA busy_timeout=30000")
            db.executescript(_SCHEMA)
            self._db = db
        return self._db

    def record(
        self,
        key_name: str,
        model: str,
        input_tokens: int,
        output_tokens: int,
        error: bool,
        now: float | None = None,
    ) -> None:
        """Count one request (in memory until the next flush)."""
        hour = int((time.time() if now is None else now) // HOUR * HOUR)
        with self._lock:
            c = self._pending.setdefault((hour, key_name, model), Counts())
            c.requests += 1
            c.errors += int(error)
            c.input_tokens += int(input_tokens)
            c.output_tokens += int(output_tokens)

    def flush(self, now: float | None = None) -> None:
        """Write what was counted since the last flush and delete rows past the retention."""
        with self._lock:
            pending, self._pending = self._pending, {}
        now = time.time() if now is None else now
        try:
            with self._db_lock, self._conn() as db:
                db.executemany(
                    _UPSERT,
                    [
                        (h, k, m, c.requests, c.errors, c.input_tokens, c.output_tokens)
                        for (h, k, m), c in pending.items()
                    ],
                )
                db.execute("DELETE FROM usage_hourly WHERE hour < ?", (now - self.retention_s,))
        except sqlite3.Error:
            with self._lock:  # counted again at the next flush, not lost
                for k, c in pending.items():
                    mine = self._pending.setdefault(k, Counts())
                    mine.requests += c.requests
                    mine.errors += c.errors
                    mine.input_tokens += c.input_tokens
                    mine.output_tokens += c.output_tokens
            raise

    def query(
        self,
        start: float,
        end: float,
        group_by: Iterable[str] = ("key", "model"),
        bucket: str = "hour",
    ) -> list[dict[str, Any]]:
        """Totals of the hours in [start, end), per bucket and the ``group_by`` columns."""
        cols = {"key": "key_name", "model": "model"}
        groups = [cols[g] for g in group_by]
        size = DAY if bucket == "day" else HOUR
        select = [f"(hour / {size}) * {size} AS bucket", *groups]
        sql = (
            f"SELECT {', '.join(select)}, SUM(requests), SUM(errors), SUM(input_tokens), "
            f"SUM(output_tokens) FROM usage_hourly WHERE hour >= ? AND hour < ? "
            f"GROUP BY {', '.join(['bucket', *groups])} ORDER BY {', '.join(['bucket', *groups])}"
        )
        with self._db_lock:
            rows = self._conn().execute(sql, (int(start), int(end))).fetchall()
        out = []
        for row in rows:
            item: dict[str, Any] = {"start": int(row[0])}
            for name, value in zip(group_by, row[1 : 1 + len(groups)], strict=True):
                item[name] = value
            r, e, i, o = row[1 + len(groups) :]
            item.update(requests=r, errors=e, input_tokens=i, output_tokens=o)
            out.append(item)
        return out

    def close(self) -> None:
        with self._db_lock:
            if self._db is not None:
                self._db.close()
                self._db = None
