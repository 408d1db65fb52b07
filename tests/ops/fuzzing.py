"""Schemathesis over a live mlxd's ``/openapi.json``, shared by the CI test
(tests/ops/test_fuzz.py) and the long run (benchmarks/fuzz_long.py).

One hypothesis run per (operation, generation mode), driven from here rather than through
schemathesis' pytest plugin, so the benchmark script and the test run exactly the same
thing and each run's outcome (examples sent, statuses seen, the first failure) can be
summarised.

Generated requests are *tamed* before they are sent, so the fuzz checks the API and never
turns into a load test or a change to the server's state:

* every output-length field an integer above ``MAX_TOKENS`` is lowered to it (OpenAI's
  ``max_tokens`` / ``max_completion_tokens``, the Responses API's ``max_output_tokens``,
  Ollama's ``options.num_predict``), ``n`` above 2 to 2; values that are *invalid*
  (negative, strings...) are left alone: rejecting them is what is being tested;
* in positive mode, half the bodies name the served model instead of a random string, so
  the generation paths run (a random name only reaches the 404);
* ``model``/``name`` of ``POST /unload`` and ``DELETE /api/delete`` is always a name no
  store holds: their validation and 404 are fuzzed, but nothing is unloaded or deleted.

Excluded (see :data:`EXCLUDED`): only what would change the store or need the network.

Known issues (see :data:`KNOWN_ISSUES`): failures found here whose fix lies outside the
API layer. A response matching one exactly is counted and reported (route, request,
response) instead of failing the run, so the fuzz goes on past it; any other failure on the
same route still fails.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import hypothesis.errors
import hypothesis.strategies as st
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

MAX_TOKENS = 4
NO_SUCH_MODEL = "fuzz-no-such-model"

# (method, path, mode) -> why leaving it out is safe. A positive ``/api/pull`` of a
# generated name would try the network (unreachable here: a timeout per example, not a test)
# or, for a name that happens to be a local path, import it into the store: a run must change
# nothing. Its negative mode still runs: invalid pulls are refused before any download.
EXCLUDED: dict[tuple[str, str, GenerationMode], str] = {
    (
        "POST",
        "/api/pull",
        GenerationMode.POSITIVE,
    ): "a valid pull downloads or imports a model (changes the store, needs the network); "
    "its validation is fuzzed in negative mode",
}
# Names the fixers below treat as the requested output length, by dialect.
_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "num_predict")
_NO_STATE_CHANGE = {("POST", "/unload"), ("DELETE", "/api/delete")}


@dataclass(frozen=True)
class KnownIssue:
    """A precisely identified failure that cannot be fixed in api/ (see the report)."""

    paths: frozenset[str]
    status: int
    text: str  # in the response body
    where: str  # what is wrong and where it must be fixed

    def matches(self, path: str, status: int, body: str) -> bool:
        return path in self.paths and status == self.status and self.text in body


KNOWN_ISSUES: dict[str, KnownIssue] = {}  # none open: rerank with a chat model that
# cannot score (no single-token yes/no) was a 500 and is a 400 now (runtime/encoders.py)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
]


def _clamp(obj: dict[str, Any]) -> None:
    for key in _LENGTH_FIELDS:
        v = obj.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_TOKENS:
            obj[key] = MAX_TOKENS
    n = obj.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 2:
        obj["n"] = 2
    opts = obj.get("options")
    if isinstance(opts, dict):
        _clamp(opts)


def tame(
    case: schemathesis.Case,
    mode: GenerationMode,
    model: str,
    use_model: bool,
    contained: bool = True,
) -> schemathesis.Case:
    """Small outputs and, when ``contained``, no state changes; see the module docstring."""
    body = case.body
    if isinstance(body, dict):
        _clamp(body)
        key = (case.operation.method.upper(), case.operation.path)
        if contained and key in _NO_STATE_CHANGE:
            for k in ("model", "name"):
                if isinstance(body.get(k), str):
                    body[k] = NO_SUCH_MODEL
        elif mode == GenerationMode.POSITIVE and use_model and isinstance(body.get("model"), str):
            body["model"] = model
    return case


@dataclass
class RunResult:
    """One (operation, mode) run: what was sent, what came back, the first failure."""

    operation: str
    mode: str
    examples: int = 0
    seconds: float = 0.0
    statuses: Counter = field(default_factory=Counter)
    failure: str | None = None
    excluded: str | None = None
    known: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> count, example
    # negative mode on an operation with nothing to break (no body, no constrained
    # parameter): hypothesis proves no invalid request exists; nothing to send, no failure
    unsatisfiable: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "operation": self.operation,
            "mode": self.mode,
            "examples": self.examples,
            "seconds": round(self.seconds, 2),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "failure": self.failure,
            "excluded": self.excluded,
            "known": self.known,
            "unsatisfiable": self.unsatisfiable,
        }


def load_schema(base_url: str, headers: dict[str, str] | None = None) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(base_url + "/openapi.json", headers=headers or {})


def fuzz_operation(
    operation: schemathesis.APIOperation,
    mode: GenerationMode,
    *,
    base_url: str,
    model: str,
    max_examples: int,
    seed: int = 0,
    shrink: bool = False,
    timeout: float = 60.0,
    contained: bool = True,
) -> RunResult:
    """Run ``max_examples`` generated requests against one operation in one mode; the first
    failing check stops the run (hypothesis then shrinks it when ``shrink``).

    ``contained=False`` (a throwaway server and store, benchmarks/fuzz_long.py): nothing is
    excluded and unload/delete get the names generated, the served model's included."""
    label = f"{operation.method.upper()} {operation.path}"
    res = RunResult(label, mode.value)
    why = EXCLUDED.get((operation.method.upper(), operation.path, mode)) if contained else None
    if why:
        res.excluded = why
        return res
    strategy = st.tuples(operation.as_strategy(generation_mode=mode), st.booleans())
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])

    @hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @hypothesis.seed(seed)
    @hypothesis.given(strategy)
    def run(drawn: tuple[schemathesis.Case, bool]) -> None:
        case = tame(drawn[0], mode, model, drawn[1], contained)
        res.examples += 1
        response = case.call(base_url=base_url, timeout=timeout)
        res.statuses[response.status_code] += 1
        for name, issue in KNOWN_ISSUES.items():
            if issue.matches(operation.path, response.status_code, response.text):
                seen = res.known.setdefault(
                    name,
                    {
                        "count": 0,
                        "request": {
                            "method": label.split()[0],
                            "path": case.formatted_path,
                            "body": case.body,
                        },
                        "response": {"status": response.status_code, "body": response.text[:500]},
                    },
                )
                seen["count"] += 1
                return
        case.validate_response(response, checks=CHECKS)

    t0 = time.perf_counter()
    try:
        run()
    except KeyboardInterrupt:
        raise
    except hypothesis.errors.Unsatisfiable:
        res.unsatisfiable = True
    except BaseException as exc:  # noqa: BLE001 - schemathesis' FailureGroup is a
        # BaseExceptionGroup; the report is the point: keep it, go on with the next run
        res.failure = f"{type(exc).__name__}: {exc}"[:4000]
    res.seconds = time.perf_counter() - t0
    return res


def operations(schema: schemathesis.BaseSchema) -> list[schemathesis.APIOperation]:
    """Every operation the document lists (a broken definition raises, never skips)."""
    return [result.ok() for result in schema.get_all_operations()]
