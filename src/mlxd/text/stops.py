"""Text-level stop strings that are never emitted, also when split across tokens."""

from __future__ import annotations


class StopMatcher:
    """Holds back exactly the text that could still turn into a stop string.

    Text that cannot begin any stop string is released at once, so streaming latency only
    suffers while the output really looks like the start of a stop string.
    """

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._buf = ""
        self.matched: str | None = None  # the stop string that was hit

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        self._buf += text
        hit = -1
        for s in self.stops:
            i = self._buf.find(s)
            if i != -1 and (hit == -1 or i < hit):
                hit = i
                self.matched = s
        if hit != -1:
            out, self._buf = self._buf[:hit], ""
            return out, True
        hold = self._held_suffix()
        cut = len(self._buf) - hold
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return out

    def _held_suffix(self) -> int:
        buf = self._buf
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
