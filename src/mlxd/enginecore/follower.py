"""``python -m mlxd.enginecore.follower RUN_DIR EPOCH BIND``: rank 1..N-1 of a tensor- or
pipeline-parallel engine core (see group.py and engines/tensor_parallel.py).

It joins the group, then applies rank 0's commands in order on its main thread: loads
(sharded, or this rank's layers), batch mutations and steps, whose collectives (and, when
pipelined, sends and receives) meet rank 0's. A reader thread
takes commands off the pipe meanwhile, so that rank 0's pings are heard even during a long
load or step: silence for ``SILENCE_S`` means rank 0 is gone (another host's follower has
no supervisor to end it), and the follower exits. Any failure to replay a command also
ends it: the group is out of step, and only a restart of every rank mends that.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("mlxd.enginecore.follower")


def main(run_dir: str, epoch: int, bind: str) -> None:
    import msgspec
    import zmq

    from mlxd import blas
    from mlxd.config import Settings
    from mlxd.enginecore.group import SILENCE_S, init_rank
    from mlxd.observability.logs import setup_logging

    settings: Settings = pickle.loads((Path(run_dir) / "settings.pkl").read_bytes())
    blas.preload(settings.backend.blas)  # before anything imports MLX
    setup_logging(settings.log.level, settings.log.format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(bind)
    cmds: queue.SimpleQueue = queue.SimpleQueue()
    heard = [time.monotonic()]

    def read() -> None:
        dec = msgspec.msgpack.Decoder()
        while True:
            if not sock.poll(500):
                if time.monotonic() - heard[0] > SILENCE_S:
                    log.error("no word from rank 0 for %.0fs; the follower exits", SILENCE_S)
                    os._exit(1)
                continue
            msg = dec.decode(sock.recv())
            heard[0] = time.monotonic()
            if msg[0] != "ping":
                cmds.put(msg)

    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=read, name="mlxd-tp-read", daemon=True).start()
    threading.Thread(target=watch_parent, name="mlxd-tp-parent", daemon=True).start()

    from mlxd.engines import llm, tensor_parallel  # imported now: the first load is sooner

    group = init_rank(settings)
    tensor_parallel.setup(group, None, settings.engine.parallel_mode)
    replay = tensor_parallel.Replayer(llm.LLMEngine)
    log.info(
        "%s follower rank %d (epoch %d, pid %d) ready",
        tensor_parallel.mode_name(),
        group.rank(),
        epoch,
        os.getpid(),
    )
    while True:
        cmd = cmds.get()
        try:
            replay.apply(cmd)
        except Exception:  # noqa: BLE001 - out of step: end, so that the group restarts
            log.exception("follower rank %d could not replay %r; exiting", group.rank(), cmd[0])
            os._exit(3)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
