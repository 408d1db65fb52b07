"""The device worker survives an engine whose cancel raises (runtime/worker.py)."""

from __future__ import annotations

import time

from mlxd.runtime.worker import DeviceWorker


class _Engine:
    name = "flaky"
    kind = "chat"

    def __init__(self) -> None:
        self.added: list = []

    def add(self, seq) -> None:
        self.added.append(seq)

    def cancel(self, seq) -> None:
        raise RuntimeError("cancel exploded")

    def has_work(self) -> bool:
        return False

    def next_deadline(self):
        return None

    def step(self) -> list:
        return []

    def fail_all(self, exc) -> list:
        return []

    def close(self) -> None:
        pass


class _Seq:
    handle = None


def test_a_cancel_that_raises_does_not_kill_the_worker():
    w = DeviceWorker()
    w.start()
    try:
        engine = _Engine()
        w.attach(engine)
        w.cancel(engine, _Seq())
        w.submit(engine, _Seq())  # the worker still takes commands afterwards
        assert w.call(lambda: len(engine.added)).result(5) == 1
        time.sleep(0.05)
        assert w.alive and not w.dead
    finally:
        w.stop()
