"""A benchmark side kept loaded in a process of its own and asked one JSON line at a time.

The engine-alone baselines (serve_compare.py --interleave, speculative.py --engine-alone)
load a model once and then answer requests in turns with running servers: the script
prints ``READY`` when loaded and one ``RESULT <json>`` line per JSON line it reads.
"""

from __future__ import annotations

import json
import subprocess
import tempfile


class LineProcess:
    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True
        )
        self._read("READY")

    def _read(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        self.err.seek(0)
        raise RuntimeError("the engine process ended: " + self.err.read()[-2000:])

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read("RESULT "))

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.err.close()
