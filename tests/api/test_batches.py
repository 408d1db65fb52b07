"""The Files and Batch APIs through the official ``openai`` client: uploads, ownership
across two keys, batches of chat and embeddings requests, a bad line in the error file,
cancel, and a batch that resumes after its server was killed (-9) mid-way."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import openai
import pytest
from conftest import LiveServer, free_port, make_settings, wait_healthy, wait_until
from fixtures.tiny_encoders import make_tiny_bert_embedder

ALICE, BOB = "sk-batch-alice-01", "sk-batch-bob-01"
KEYS = {"api_keys": [{"key": ALICE, "name": "alice"}, {"key": BOB, "name": "bob"}]}
MAX_FILE = 64 * 1024


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_llama):
    from mlxd.store.local import ModelStore
    from mlxd.store.pull import pull

    home = tmp_path_factory.mktemp("batch-home")
    settings = make_settings(home, tiny_llama, security=KEYS, batch={"max_file_bytes": MAX_FILE})
    src = tmp_path_factory.mktemp("batch-src")
    make_tiny_bert_embedder(src / "tiny-embed")
    pull(
        ModelStore(settings.models_dir),
        str(src / "tiny-embed"),
        settings.models,
        as_name="tiny-embed",
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLXD_HOME", str(home / ".mlxd"))  # the server's database and files
        s = LiveServer(settings).start()
    yield s
    s.stop()


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture()
def alice(srv) -> openai.OpenAI:
    return _client(srv.url, ALICE)


@pytest.fixture()
def bob(srv) -> openai.OpenAI:
    return _client(srv.url, BOB)


def _chat_line(cid: str, text: str = "hello", max_tokens: int = 4) -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    }


def _jsonl(lines: list) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def _upload(client: openai.OpenAI, lines: list, purpose: str = "batch"):
    return client.files.create(file=("input.jsonl", _jsonl(lines)), purpose=purpose)


def _wait_done(client: openai.OpenAI, batch_id: str, timeout: float = 180):
    final = ("completed", "failed", "cancelled", "expired")
    seen = {}

    def done() -> bool:
        seen["b"] = client.batches.retrieve(batch_id)
        return seen["b"].status in final

    assert wait_until(done, timeout, every=0.2), seen.get("b")
    return seen["b"]


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


# -- files -----------------------------------------------------------------------------------


def test_files_round_trip(alice):
    data = _jsonl([_chat_line("a")])
    f = alice.files.create(file=("in.jsonl", data), purpose="batch")
    assert f.object == "file" and f.purpose == "batch" and f.bytes == len(data)
    assert f.filename == "in.jsonl" and f.id.startswith("file-") and f.created_at > 0
    assert alice.files.retrieve(f.id).id == f.id
    assert alice.files.content(f.id).content == data
    assert f.id in [x.id for x in alice.files.list()]
    assert f.id in [x.id for x in alice.files.list(purpose="batch")]
    assert f.id not in [x.id for x in alice.files.list(purpose="user_data")]
    other = alice.files.create(file=("notes.txt", b"notes"), purpose="user_data")
    assert other.purpose == "user_data"
    gone = alice.files.delete(f.id)
    assert gone.deleted and gone.id == f.id
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        alice.files.content(f.id)
    with pytest.raises(openai.NotFoundError):
        alice.files.delete(f.id)


def test_file_list_pages(alice):
    ids = [alice.files.create(file=("p.txt", b"x"), purpose="user_data").id for _ in range(3)]
    page = alice.files.list(purpose="user_data", limit=2)
    assert len(page.data) == 2 and page.has_more
    everything = [x.id for x in alice.files.list(purpose="user_data", limit=2)]  # auto-paging
    assert set(ids) <= set(everything) and len(everything) == len(set(everything))


def test_bad_uploads_are_refused(alice, srv):
    with pytest.raises(openai.BadRequestError) as e:
        alice.files.create(file=("x.jsonl", b"{}"), purpose="nonsense")
    assert e.value.body["param"] == "purpose"
    with pytest.raises(openai.APIStatusError) as big:
        alice.files.create(file=("big.jsonl", b"x" * (MAX_FILE + 1)), purpose="batch")
    assert big.value.status_code == 413 and "batch.max_file_bytes" in big.value.message
    # beyond the multipart allowance, refused at the door on its Content-Length
    r = httpx.post(
        srv.url + "/v1/files",
        headers={"Authorization": f"Bearer {ALICE}"},
        files={"file": ("big.jsonl", b"x" * (MAX_FILE + 300 * 1024))},
        data={"purpose": "batch"},
        timeout=60,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(
        srv.url + "/v1/files",
        headers={"Authorization": f"Bearer {ALICE}"},
        files={"file": ("a.jsonl", b"{}")},
        timeout=60,
    )
    assert r.status_code == 400 and "purpose" in r.json()["error"]["message"]


def test_another_keys_objects_are_not_found(alice, bob):
    f = _upload(alice, [_chat_line("own-1")])
    b = alice.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for call in (
        lambda: bob.files.retrieve(f.id),
        lambda: bob.files.content(f.id),
        lambda: bob.files.delete(f.id),
        lambda: bob.batches.retrieve(b.id),
        lambda: bob.batches.cancel(b.id),
        lambda: bob.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in [x.id for x in bob.files.list()]
    assert b.id not in [x.id for x in bob.batches.list()]
    done = _wait_done(alice, b.id)
    assert done.status == "completed"
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(done.output_file_id)
    assert alice.files.retrieve(f.id).id == f.id  # still there for its owner


# -- batches ---------------------------------------------------------------------------------


def test_chat_batch_with_bad_lines(alice):
    lines = [
        _chat_line("c-1", "one"),
        _chat_line("c-2", "two"),
        "this is not json",
        {**_chat_line("c-3"), "url": "/v1/embeddings"},
        {**_chat_line("c-4"), "body": {"messages": []}},  # the route answers 400
        _chat_line("c-5", "five"),
    ]
    f = _upload(alice, lines)
    b = alice.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert b.status == "validating" and b.metadata == {"job": "nightly"}
    assert b.expires_at == b.created_at + 24 * 3600
    done = _wait_done(alice, b.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 6
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 3)
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    out = _lines(alice, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == ["c-1", "c-2", "c-5"]
    for x in out:
        assert x["error"] is None and x["id"].startswith("batch_req_")
        assert x["response"]["status_code"] == 200 and x["response"]["request_id"]
        body = x["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 4
    errs = {x["custom_id"]: x for x in _lines(alice, done.error_file_id)}
    assert set(errs) == {None, "c-3", "c-4"}
    assert errs[None]["error"]["code"] == "invalid_json" and errs[None]["response"] is None
    assert errs["c-3"]["error"]["code"] == "invalid_url"
    assert errs["c-4"]["response"]["status_code"] == 400
    assert errs["c-4"]["response"]["body"]["error"]["type"] == "invalid_request_error"
    out_file = alice.files.retrieve(done.output_file_id)
    assert out_file.purpose == "batch_output"
    assert done.id in [x.id for x in alice.batches.list()]


def test_embeddings_batch(alice):
    lines = [
        {
            "custom_id": f"e-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "tiny-embed", "input": f"text number {i}"},
        }
        for i in range(3)
    ]
    b = alice.batches.create(
        input_file_id=_upload(alice, lines).id,
        endpoint="/v1/embeddings",
        completion_window="24h",
    )
    done = _wait_done(alice, b.id)
    assert done.status == "completed" and done.request_counts.completed == 3
    out = _lines(alice, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == ["e-0", "e-1", "e-2"]
    for x in out:
        emb = x["response"]["body"]["data"][0]["embedding"]
        assert len(emb) == 32 and all(isinstance(v, float) for v in emb)
    assert done.error_file_id is None


@pytest.mark.parametrize(
    ("endpoint", "body", "kind"),
    [
        ("/v1/completions", {"prompt": "Once upon", "max_tokens": 3}, "text_completion"),
        ("/v1/responses", {"input": "Say hi", "max_output_tokens": 3}, "response"),
    ],
)
def test_completions_and_responses_batches(alice, endpoint, body, kind):
    lines = [
        {"custom_id": f"x-{i}", "method": "POST", "url": endpoint, "body": body} for i in range(2)
    ]
    b = alice.batches.create(
        input_file_id=_upload(alice, lines).id, endpoint=endpoint, completion_window="24h"
    )
    done = _wait_done(alice, b.id)
    assert done.status == "completed" and done.request_counts.completed == 2, done
    out = _lines(alice, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == ["x-0", "x-1"]
    assert all(x["response"]["body"]["object"] == kind for x in out)


def test_interactive_requests_preempt_batch_lines_which_run_again(alice, srv):
    """Lines stopped for interactive requests are sent again: every line still answers
    once, none fails."""
    lines = [_chat_line(f"p-{i}", f"tell story {i}", max_tokens=24) for i in range(40)]
    b = alice.batches.create(
        input_file_id=_upload(alice, lines).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert wait_until(lambda: alice.batches.retrieve(b.id).request_counts.completed >= 1, 120)
    for i in range(5):
        r = alice.chat.completions.create(
            model="default", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=3
        )
        assert r.usage.completion_tokens == 3
    done = _wait_done(alice, b.id)
    assert done.status == "completed" and done.request_counts.completed == 40, done
    assert done.error_file_id is None
    ids = [x["custom_id"] for x in _lines(alice, done.output_file_id)]
    assert sorted(ids) == sorted(f"p-{i}" for i in range(40))
    scrape = httpx.get(
        srv.url + "/metrics", headers={"Authorization": f"Bearer {ALICE}"}, timeout=30
    ).text
    stopped = [
        line
        for line in scrape.splitlines()
        if line.startswith("mlxd:http_requests_total")
        and 'route="/v1/chat/completions"' in line
        and 'status="499"' in line
    ]
    assert stopped, "no line was stopped for the interactive requests"


def test_cancel(alice):
    lines = [_chat_line(f"k-{i}", f"count to {i}", max_tokens=32) for i in range(300)]
    b = alice.batches.create(
        input_file_id=_upload(alice, lines).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    c = alice.batches.cancel(b.id)
    assert c.status == "cancelling" and c.cancelling_at is not None
    done = _wait_done(alice, b.id)
    assert done.status == "cancelled" and done.cancelled_at >= done.cancelling_at
    out = _lines(alice, done.output_file_id)
    assert len(out) == done.request_counts.completed < 300
    assert len({x["custom_id"] for x in out}) == len(out)
    with pytest.raises(openai.ConflictError):
        _done = alice.batches.create(
            input_file_id=_upload(alice, [_chat_line("z")]).id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        _wait_done(alice, _done.id)
        alice.batches.cancel(_done.id)


def test_batch_create_is_validated(alice):
    f = _upload(alice, [_chat_line("v")])
    ok = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    for bad, param in (
        ({"endpoint": "/v1/audio/speech"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            alice.batches.create(**{**ok, **bad})
        assert e.value.body["param"] == param
    notes = alice.files.create(file=("n.jsonl", _jsonl([_chat_line("v")])), purpose="user_data")
    with pytest.raises(openai.BadRequestError) as e:
        alice.batches.create(**{**ok, "input_file_id": notes.id})
    assert e.value.body["param"] == "input_file_id"
    with pytest.raises(openai.NotFoundError):
        alice.batches.create(**{**ok, "input_file_id": "file-missing"})
    with pytest.raises(openai.NotFoundError):
        alice.batches.retrieve("batch_missing")


def test_a_file_invalid_as_a_whole_fails_the_batch(alice):
    dup = _upload(alice, [_chat_line("same"), _chat_line("same")])
    b = alice.batches.create(
        input_file_id=dup.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = _wait_done(alice, b.id)
    assert done.status == "failed" and done.failed_at is not None
    (err,) = done.errors.data
    assert err.code == "duplicate_custom_id" and err.line == 2
    empty = alice.files.create(file=("e.jsonl", b"\n"), purpose="batch")
    b = alice.batches.create(
        input_file_id=empty.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = _wait_done(alice, b.id)
    assert done.status == "failed" and done.errors.data[0].code == "empty_file"


def test_one_lease_holder_at_a_time(tmp_path):
    """The runner's lease (api/batchdb.py): held by one process at a time, renewable by its
    holder, taken over once it expires or is dropped."""
    from mlxd.api.batchdb import BatchDB

    a, b = BatchDB(tmp_path), BatchDB(tmp_path)  # two front ends, one home
    try:
        assert a.take_lease("a", ttl=60) and a.take_lease("a", ttl=60)
        assert not b.take_lease("b", ttl=60)
        a.drop_lease("a")
        assert b.take_lease("b", ttl=0.2) and not a.take_lease("a", ttl=60)
        assert wait_until(lambda: a.take_lease("a", ttl=60), 30)  # b stopped renewing
        assert not b.take_lease("b", ttl=60)
    finally:
        a.close()
        b.close()


# -- a crash mid-batch -----------------------------------------------------------------------


def _serve(
    model: Path, port: int, home: Path, tmp: Path, log: Path, *extra: str
) -> subprocess.Popen:
    env = {**os.environ, "MLXD_HOME": str(home), "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp)}
    env["MLXD_BATCH__MAX_CONCURRENT"] = "2"  # a few lines at a time: the kill lands mid-way
    return subprocess.Popen(
        [sys.executable, "-m", "mlxd", "serve", "--model", str(model), "--port", str(port), *extra],
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.mark.slow
def test_a_killed_server_resumes_its_batch(tmp_path, long_llama, request):
    home = tmp_path / "home"
    tmp = Path(tempfile.mkdtemp(prefix="mlxd-"))  # short: IPC socket paths live there
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    log = tmp_path / "serve.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []

    def start() -> None:
        p = _serve(long_llama, port, home, tmp, log)
        procs.append(p)
        wait_healthy(url, p, 120, lambda: log.read_text(errors="replace")[-3000:])

    def kill_all() -> None:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)

    request.addfinalizer(kill_all)
    start()
    client = _client(url, "unused")
    lines = [_chat_line(f"r-{i:02d}", f"story {i}", max_tokens=48) for i in range(20)]
    b = client.batches.create(
        input_file_id=_upload(client, lines).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert wait_until(
        lambda: client.batches.retrieve(b.id).request_counts.completed >= 3, 180, every=0.05
    )
    mid = client.batches.retrieve(b.id)
    kill_all()  # the serving process, its engine core, everything in its group
    assert mid.status == "in_progress" and mid.request_counts.completed < 20
    start()
    client = _client(url, "unused")
    done = _wait_done(client, b.id, timeout=300)
    assert done.status == "completed", done
    assert done.request_counts.completed == 20 and done.request_counts.failed == 0
    ids = [x["custom_id"] for x in _lines(client, done.output_file_id)]
    assert sorted(ids) == [f"r-{i:02d}" for i in range(20)]


@pytest.mark.slow
def test_one_front_end_runs_the_jobs(tmp_path, tiny_llama, request):
    """With --api-workers 2 both front ends take files and batches, one runs them: each
    request of the batch is answered once."""
    home = tmp_path / "home"
    tmp = Path(tempfile.mkdtemp(prefix="mlxd-"))
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    log = tmp_path / "serve.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    p = _serve(tiny_llama, port, home, tmp, log, "--api-workers", "2")

    def kill() -> None:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)

    request.addfinalizer(kill)
    wait_healthy(url, p, 120, lambda: log.read_text(errors="replace")[-3000:])
    ids = []
    for n in range(4):  # new connections: both front ends take some
        with _client(url, "unused") as client:
            lines = [_chat_line(f"w{n}-{i}", max_tokens=3) for i in range(10)]
            ids.append(
                client.batches.create(
                    input_file_id=_upload(client, lines).id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                ).id
            )
    client = _client(url, "unused")
    for n, bid in enumerate(ids):
        done = _wait_done(client, bid)
        assert done.status == "completed" and done.request_counts.completed == 10, done
        got = sorted(x["custom_id"] for x in _lines(client, done.output_file_id))
        assert got == sorted(f"w{n}-{i}" for i in range(10))
