"""One admitted sequence as the front end sees it: token ids in, text events out.

The engine core sends token ids (one batched message per step for all of this front end's
requests); here they become text: the incremental detokenizer, stop strings (a hit aborts
the sequence in the core), the split into answer, reasoning and tool calls, token strings
for log-probabilities, and usage. All of it per request, in the front end's process, so
the device loop never pays for it and more front ends (``--api-workers``) scale it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

from mlxd.core.types import FinishReason, TokenEvent, TokenLogprob, TopLogprob, Usage
from mlxd.enginecore import protocol as p
from mlxd.observability import context
from mlxd.observability.metrics import GenerationObserver
from mlxd.text.stops import StopMatcher
from mlxd.text.thinking import ThinkTracker

# OpenAI's and vLLM's stand-in for a log-probability of -inf: JSON has no infinities.
LOGPROB_FLOOR = -9999.0


def _finite(x: float) -> float:
    return x if x == x and x > LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN != NaN


class Generation:
    """Iterate for events; leaving early (or :meth:`close`) cancels it in the core."""

    def __init__(
        self,
        runtime: Any,
        client: Any,
        model: str,
        processor: Any,
        tokens: list[int] | None,
        params: Any,
        plan: Any,
        add: p.Add,
    ) -> None:
        self._runtime = runtime
        self._client = client  # the engine core chosen for it (frontend/cores.py)
        self.model = model
        self._proc = processor
        self.prompt_tokens: Any = tokens if tokens is not None else []
        self.params = params
        self.plan = plan
        self._add = add
        self.rid = add.rid
        self._q: Any = None
        self._released = False
        self._done = False
        self._generated = 0
        think = plan.think if plan is not None else None
        self._think = ThinkTracker(think) if think is not None else None  # reasoning tokens
        self._detok = processor.detokenizer
        self._stops = StopMatcher(params.stop)
        now = time.perf_counter()
        self.t_submitted = self.t_acquired = self.t_accepted = self.t_first = self.t_done = now
        self.queue_seconds: float | None = None  # arrival -> first scheduled in a batch
        self.priority = add.priority
        self.key_name: str | None = None  # the API key's name, for metrics (never the key)
        self._obs: GenerationObserver | None = None

    async def start(self) -> None:
        """Send it to the core and wait for admission: a refusal raises here, before any
        output (a clean 4xx/5xx)."""
        self._q = self._client.open_stream(self.rid)
        self._client.add(self._add)
        try:
            first: p.SeqOut = await self._q.get()
        except BaseException:
            self._client.close_stream(self.rid, abort=True)
            raise
        if first.error is not None:
            self._client.close_stream(self.rid, abort=False)
            raise p.error_from_wire(first.error)
        self.t_accepted = time.perf_counter()
        if first.prompt_tokens >= 0 and len(self.prompt_tokens) != first.prompt_tokens:
            self.prompt_tokens = range(first.prompt_tokens)  # vision: the core's count
        self._runtime.inflight += 1
        self._obs = GenerationObserver(self)

    def durations_ns(self) -> dict[str, int]:
        """Ollama-style timings: load, prompt evaluation (to the first token), generation."""
        ns = 1_000_000_000
        return {
            "total_duration": int((self.t_done - self.t_submitted) * ns),
            "load_duration": int((self.t_acquired - self.t_submitted) * ns),
            "prompt_eval_duration": int(max(self.t_first - self.t_acquired, 0) * ns),
            "eval_duration": int(max(self.t_done - self.t_first, 0) * ns),
        }

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._client.close_stream(self.rid, abort=not self._done)
            if self._obs is not None:
                self._obs.close()
                self._runtime.inflight -= 1

    def close(self) -> None:
        """For a Generation that will never be iterated (or is left early)."""
        self._release()

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        first = True
        try:
            while True:
                out: p.SeqOut = await self._q.get()
                if first:
                    self.t_first = time.perf_counter()
                    first = False
                    context.note_first(ttft_s=self.t_first - self.t_submitted)
                if out.error is not None:
                    self._done = True
                    assert self._obs is not None
                    self._obs.event(0, "error")
                    raise p.error_from_wire(out.error)
                if out.queued_s >= 0 and self.queue_seconds is None:
                    self.queue_seconds = (self.t_accepted - self.t_submitted) + out.queued_s
                    context.note_first(queue_s=self.queue_seconds)
                event = self._event(out)
                assert self._obs is not None
                self._obs.event(len(event.token_ids), event.finish_reason)
                if event.finish_reason is not None:
                    self._done = out.finish_reason is not None  # else: a stop string
                    context.add_finish(event.finish_reason)
                    self.t_done = time.perf_counter()
                    yield event
                    return
                yield event
        finally:
            self._release()

    def _event(self, out: p.SeqOut) -> TokenEvent:
        # the wire carries the engine's own words, which are FinishReason's
        finish = cast("FinishReason | None", out.finish_reason)
        detok = self._detok
        n = len(out.token_ids)
        for i, tok in enumerate(out.token_ids):
            self._generated += 1
            last = i == n - 1
            if last and finish == "stop":  # an EOS token: never shown
                detok.finalize()
            else:
                detok.add_token(tok)
                if self._think is not None:
                    self._think.observe(tok)
                if last and finish == "length":
                    detok.finalize()
        if not out.token_ids and finish is not None:
            detok.finalize()
        text, hit = self._stops.feed(detok.last_segment)
        if hit:
            finish = "stop"
        elif finish is not None:
            text += self._stops.flush()
        event = TokenEvent(
            text=text,
            token_ids=list(out.token_ids),
            finish_reason=finish,
            stop_sequence=self._stops.matched if hit else None,
        )
        split = self.plan.splitter if self.plan is not None else None
        if split is not None:
            event.text, event.reasoning, event.tool_calls = split.feed(text)
            if finish is not None:
                more, reasoning, calls = split.flush(cut=finish == "length")
                event.text += more
                event.reasoning += reasoning
                event.tool_calls += calls
                if finish == "stop" and split.calls:
                    event.finish_reason = finish = "tool_calls"
        if out.logprobs:
            event.logprobs = [
                self._logprob(tok, lp) for tok, lp in zip(out.token_ids, out.logprobs, strict=False)
            ]
        if finish is not None:
            event.usage = Usage(
                prompt_tokens=len(self.prompt_tokens),
                completion_tokens=self._generated,
                cached_tokens=out.cached_tokens,
                reasoning_tokens=self._think.reasoning_tokens if self._think else None,
            )
        return event

    def _logprob(self, token: int, lp: p.Logprob) -> TokenLogprob:
        decode = self._proc.decode
        return TokenLogprob(
            token_id=token,
            token=decode([token]),
            logprob=_finite(lp.logprob),
            top=[
                TopLogprob(i, decode([i]), _finite(v))
                for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
            ],
        )


def new_rid() -> str:
    return uuid.uuid4().hex
