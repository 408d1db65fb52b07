"""Schemathesis over the live server's /openapi.json: every documented operation, valid
and invalid requests, bounded for CI (~20 examples per operation and mode).

Checks (tests/ops/fuzzing.py ``CHECKS``): no 5xx (``not_a_server_error``); the status code,
content type, headers and body are the documented ones (``*_conformance``; SSE streams
event by event); in negative mode, a request that breaks the schema is refused with a 4xx
(``negative_data_rejection``). Generated requests are tamed (tiny ``max_tokens``, the
served model half the time, no unload or delete of a real model) and ``POST /api/pull`` is
fuzzed only with invalid bodies: why each of these is safe is in fuzzing.py. The long run
is benchmarks/fuzz_long.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import LiveServer, make_settings
from fuzzing import EXCLUDED, KNOWN_ISSUES, fuzz_operation, load_schema, operations
from schemathesis import GenerationMode

MAX_EXAMPLES = 20


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, tiny_llama) -> Iterator[LiveServer]:
    home = tmp_path_factory.mktemp("fuzz")
    srv = LiveServer(make_settings(home, tiny_llama, engine={"max_num_seqs": 8})).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize(
    "mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"]
)
def test_every_documented_operation_survives_the_fuzz(fuzzed, mode, capsys) -> None:
    schema = load_schema(fuzzed.url)
    ops = operations(schema)
    documented = {(m.upper(), p) for p, o in fuzzed.app.openapi()["paths"].items() for m in o}
    assert {(op.method.upper(), op.path) for op in ops} == documented
    model = fuzzed.client().get("/v1/models").json()["data"][0]["id"]
    failures, sent, known = [], 0, {}
    for op in ops:
        res = fuzz_operation(
            op, mode, base_url=fuzzed.url, model=model, max_examples=MAX_EXAMPLES, seed=1
        )
        sent += res.examples
        if res.excluded:
            assert (op.method.upper(), op.path, mode) in EXCLUDED
            continue
        if res.failure:
            failures.append(f"{res.operation} [{res.mode}]: {res.failure}")
        for name, seen in res.known.items():
            known.setdefault(name, []).append(
                f"{res.operation}: {seen['count']}x, e.g. {seen['response']['body'][:120]}"
            )
        # an operation with anything to generate got requests (negative mode may prove
        # there is no invalid request: GET routes without parameters)
        assert res.examples > 0 or res.unsatisfiable, res.operation
    with capsys.disabled():
        for name, where in known.items():  # reported, never silent
            print(f"\nKNOWN ISSUE {name}: {KNOWN_ISSUES[name].where}\n  " + "\n  ".join(where))
    assert not failures, "\n\n".join(failures)
    assert sent >= len(ops) * 2
    h = httpx.get(fuzzed.url + "/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert h.json().get("requests_in_flight", 0) == 0
