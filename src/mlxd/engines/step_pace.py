"""engine.max_step_tokens 'auto' on the CPU: a step's prefill sized from what steps cost.

Running streams get their next token when a step ends, so a step that carries a prefill
chunk should cost a bounded multiple of a decode step. A long prompt's prefill, in turn,
waits one decode step per chunk, so its chunks should not be much smaller than that bound
either. No fixed number serves every model: a 256-token chunk costs a tiny model about
one decode step, and SmolLM2-135M on 2 CPU cores fifteen (a 2 s step against 130 ms). A
chunk's cost is not proportional to its tokens either: a forward pass reads every weight
whatever its length (SmolLM2-135M: about a decode step's worth), and attention grows with
the context the prompt has reached.

:class:`StepPace` steers instead of modelling: decode-only steps give a decode step's
cost (a moving average); after each step with a chunk beside decoding rows, the next
chunk is this one scaled by how far its cost over a decode step was from :data:`STALL`
decode steps (growing by at most a quarter a step, shrinking by at most half). With
nothing decoding there is nobody to hold back, and prompts get mlx-lm's chunks
(``prefill_step_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

# the least a prompt being prefilled gets per step, however full the decode batch is
MIN_PREFILL_TOKENS = 16
# a step with a chunk aims at 1 + STALL decode steps: streams' gaps stay within 4x, and
# with the chunk in the decode pass (engines/mixed_step.py) a prompt waits about
# 1 + 1/STALL times its prefill alone
STALL = 2.25
# how much one step may grow or shrink the next chunk: growth is slow, since a prompt's
# tokens cost more as its context grows, and a shrink is quick
MOST_GROWTH = 1.25
MOST_SHRINK = 0.5


@dataclass
class StepPace:
    """The chunk a step beside decoding rows may carry, steered by measured step times
    (see the module docstring). ``chunk`` starts at ``fallback``; ``most`` is the largest."""

    fallback: int
    most: int
    mixed: bool = False  # the chunk goes into the decode pass (engines/mixed_step.py)
    decode_s: float | None = None  # a decode-only step's wall time (moving average)
    chunk: float = 0.0  # prefill tokens for the next step beside decoding rows
    steered: bool = False  # a step with a chunk beside decoding rows has been measured
    alone_token_s: float | None = None  # a prompt token's cost in a prefill-only step

    def __post_init__(self) -> None:
        self.chunk = float(max(self.fallback, MIN_PREFILL_TOKENS))

    def prefill_tokens(self, decode_tokens: int) -> int | None:
        """The prefill tokens a step with ``decode_tokens`` decode tokens may carry; None:
        no bound (nothing decodes)."""
        if decode_tokens <= 0:
            return None
        if self.decode_s is None:
            return max(self.fallback - decode_tokens, MIN_PREFILL_TOKENS)
        if not self.steered and self.alone_token_s:
            # a first guess from prefill alone; halved when the chunk is a pass of its own,
            # whose fixed costs are not in it
            guess = (1.0 if self.mixed else 0.5) * STALL * self.decode_s / self.alone_token_s
            return int(min(max(guess, MIN_PREFILL_TOKENS), self.most))
        return int(self.chunk)

    def observe(self, decode_tokens: int, prefill_tokens: int, seconds: float) -> None:
        """A step's wall time, with what it carried: decode-only steps update the decode
        step's cost; a step with a chunk beside decoding rows steers the next chunk."""
        if seconds <= 0:
            return
        if not prefill_tokens:
            if decode_tokens:
                w = 0.2 if self.decode_s is not None else 1.0
                self.decode_s = (1 - w) * (self.decode_s or 0.0) + w * seconds
            return
        if not decode_tokens:
            self.alone_token_s = seconds / prefill_tokens
            return  # nothing was held back: no measure of the bound
        if self.decode_s is None:
            return
        if not self.steered:
            self.chunk = float(prefill_tokens)
            self.steered = True
        over = max(seconds - self.decode_s, 1e-4)
        change = min(max(STALL * self.decode_s / over, MOST_SHRINK), MOST_GROWTH)
        scaled = prefill_tokens * change
        # under the aim, a chunk cut short by its prompt's end does not shrink the next
        chunk = max(scaled, self.chunk) if change >= 1 else scaled
        self.chunk = min(max(chunk, MIN_PREFILL_TOKENS), self.most)

    def as_dict(self) -> dict[str, float | None]:
        return {
            "decode_step_ms": None if self.decode_s is None else round(self.decode_s * 1e3, 3),
            "prefill_chunk": round(self.chunk),
        }
