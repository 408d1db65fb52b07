"""How a front end notices its engine core's process exiting (frontend/client.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import zmq

from mlxd.enginecore import protocol as p
from mlxd.frontend import client as client_mod


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfd_open is Linux's")
def test_a_core_process_exit_is_noticed_at_once_through_its_pidfd(tmp_path, monkeypatch):
    """The core's heartbeat names its pid; when that process exits (killed, not yet reaped:
    a zombie, as a crashed core is until its supervisor waits for it) the front end
    declares it dead within milliseconds, with no polling: here the poll is made blind
    (``pid_alive`` always says yes) and the heartbeat deadline is a minute away."""
    monkeypatch.setattr(client_mod, "pid_alive", lambda pid: True)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    async def main() -> None:
        client = client_mod.CoreClient(tmp_path, dead_after=60.0)
        await client.start()
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(client.address)
        try:
            push.send(p.encoder().encode(p.Heartbeat(epoch=1, pid=proc.pid, ready=True)))
            for _ in range(200):
                if client.alive:
                    break
                await asyncio.sleep(0.01)
            assert client.serving and client.core_pid == proc.pid
            proc.kill()  # nobody waits for it: it stays a zombie
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            while client.alive and loop.time() - t0 < 2.0:
                await asyncio.sleep(0.005)
            assert not client.alive and client.deaths == 1
            assert loop.time() - t0 < 1.0
            assert client._pidfd is None  # closed with the death
        finally:
            push.close(0)
            await client.close()

    try:
        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()
