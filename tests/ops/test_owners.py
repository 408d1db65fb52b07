"""What a caller stores belongs to its API key, through real HTTP with several keys.

Another key's stored response answers exactly as a missing one (404, the same error but
for the id) to GET, DELETE and ``previous_response_id``, and stays intact for its owner;
the owner is the key itself, not its name. The web UI's request log shows a key only its
own requests; an admin key (``admin: true``, or `` admin`` after the key in MLXD_API_KEYS
and the key file) sees everyone's, and so does the local operator of a server without keys.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, make_settings

ALICE, BOB, ROOT = "sk-alice-owner-01", "sk-bob-owner-01", "sk-root-owner-01"
TWIN = "sk-alice-twin-01"  # another key that is also called "alice" (from the environment)
ERIN, FRANK, GRACE = "sk-erin:with:colons", "sk-frank-01", "sk-grace-01"
MISSING = "resp_0123456789abcdef01234567"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, tiny_llama):
    home = tmp_path_factory.mktemp("owners")
    keyfile = home / "keys.txt"
    keyfile.write_text(f"# team keys\nerin:{ERIN} admin\n{FRANK}\n")
    old = os.environ.get("MLXD_API_KEYS")
    os.environ["MLXD_API_KEYS"] = f"alice:{TWIN},grace:{GRACE}"
    try:
        settings = make_settings(
            home,
            tiny_llama,
            security={
                "api_keys": [
                    {"key": ALICE, "name": "alice"},
                    {"key": BOB, "name": "bob"},
                    {"key": ROOT, "name": "root", "admin": True},
                ],
                "api_key_file": str(keyfile),
            },
        )
        srv = LiveServer(settings).start()
    finally:
        if old is None:
            os.environ.pop("MLXD_API_KEYS", None)
        else:
            os.environ["MLXD_API_KEYS"] = old
    yield srv
    srv.stop()


def _c(srv: LiveServer, key: str) -> httpx.Client:
    return srv.client(headers={"Authorization": f"Bearer {key}"})


def _create(c: httpx.Client, text: str, **kw) -> dict:
    r = c.post(
        "/v1/responses",
        json={"model": "default", "input": text, "max_output_tokens": 3, "temperature": 0, **kw},
    )
    assert r.status_code == 200, r.text
    return r.json()


def _as_missing(r: httpx.Response, rid: str, c: httpx.Client, method: str, **kw) -> None:
    """``r`` (about ``rid``) is the very answer a never-stored id gets."""
    ref = c.request(method, f"/v1/responses/{MISSING}", **kw)
    assert r.status_code == ref.status_code == 404
    assert r.json() == {
        "error": {
            **ref.json()["error"],
            "message": ref.json()["error"]["message"].replace(MISSING, rid),
        }
    }


def test_another_keys_response_is_missing_and_intact(keyed):
    with _c(keyed, ALICE) as alice, _c(keyed, BOB) as bob, _c(keyed, ROOT) as root:
        mine = _create(alice, "alice's secret plan")
        rid = mine["id"]
        for other in (bob, root):  # an admin key reads no one else's objects either
            _as_missing(other.get(f"/v1/responses/{rid}"), rid, other, "GET")
            _as_missing(other.delete(f"/v1/responses/{rid}"), rid, other, "DELETE")
            body = {"model": "default", "input": "go on", "max_output_tokens": 2}
            cont = other.post("/v1/responses", json={**body, "previous_response_id": rid})
            ref = other.post("/v1/responses", json={**body, "previous_response_id": MISSING})
            assert cont.status_code == ref.status_code == 404
            assert cont.json()["error"]["message"] == ref.json()["error"]["message"].replace(
                MISSING, rid
            )
            assert cont.json()["error"]["param"] == "previous_response_id"
            streamed = other.post(
                "/v1/responses", json={**body, "stream": True, "previous_response_id": rid}
            )
            assert streamed.status_code == 404 and "not found" in streamed.text
        # the owner still has it, whole, and can continue and delete it
        got = alice.get(f"/v1/responses/{rid}")
        assert got.status_code == 200 and got.json() == mine
        assert _create(alice, "go on", previous_response_id=rid)["previous_response_id"] == rid
        assert alice.delete(f"/v1/responses/{rid}").json()["deleted"] is True
        _as_missing(alice.get(f"/v1/responses/{rid}"), rid, alice, "GET")


def test_a_streamed_response_belongs_to_its_key(keyed):
    with _c(keyed, BOB) as bob, _c(keyed, ALICE) as alice:
        r = bob.post(
            "/v1/responses",
            json={"model": "default", "input": "hi", "stream": True, "max_output_tokens": 2},
        )
        assert r.status_code == 200
        rid = (
            next(line for line in r.text.splitlines() if '"resp_' in line)
            .split('"id":"')[1]
            .split('"')[0]
        )
        assert bob.get(f"/v1/responses/{rid}").status_code == 200
        _as_missing(alice.get(f"/v1/responses/{rid}"), rid, alice, "GET")


def test_the_owner_is_the_key_not_its_name(keyed):
    """Two keys named "alice" (config and environment) are two owners."""
    with _c(keyed, ALICE) as alice, _c(keyed, TWIN) as twin:
        rid = _create(alice, "for the first alice only")["id"]
        _as_missing(twin.get(f"/v1/responses/{rid}"), rid, twin, "GET")
        assert alice.get(f"/v1/responses/{rid}").status_code == 200
        theirs = _create(twin, "and this for the other")["id"]
        _as_missing(alice.get(f"/v1/responses/{theirs}"), theirs, alice, "GET")


def _log(c: httpx.Client, **params) -> dict:
    r = c.get("/ui/api/requests", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(log: dict) -> set[str]:
    return {r["request_id"] for r in log["requests"]}


def test_the_ui_request_log_shows_a_key_its_own_requests(keyed):
    who = {"alice": ALICE, "bob": BOB, "twin": TWIN, "frank": FRANK, "grace": GRACE}
    with keyed.client() as c:
        for name, key in who.items():
            assert (
                c.get(
                    "/v1/models",
                    headers={"Authorization": f"Bearer {key}", "X-Request-ID": f"log-{name}"},
                ).status_code
                == 200
            )
        assert (
            c.get(
                "/v1/models",
                headers={"Authorization": "Bearer sk-wrong", "X-Request-ID": "log-refused"},
            ).status_code
            == 401
        )
    ours = {f"log-{n}" for n in who} | {"log-refused"}
    for name, key in who.items():
        with _c(keyed, key) as c:
            log = _log(c)
            assert log["scope"] == "own"
            assert _ids(log) & ours == {f"log-{name}"}, name
            shown = {"twin": "alice", "frank": "file-2"}.get(name, name)  # frank has no name
            assert all(r["key"] == shown for r in log["requests"]), name
            # the limit counts the caller's own requests: the newest of them comes back
            assert [r["request_id"] for r in _log(c, limit=1)["requests"]] == [f"log-{name}"]
    for admin in (ROOT, ERIN):  # an admin key from the config, one from the key file
        with _c(keyed, admin) as c:
            log = _log(c, limit=1000)
            assert log["scope"] == "all" and ours <= _ids(log)
            assert c.get("/ui/api/overview").json()["admin"] is True
    with _c(keyed, BOB) as c:
        assert c.get("/ui/api/overview").json()["admin"] is False
    with keyed.client() as c:  # the log still needs a key
        assert c.get("/ui/api/requests").status_code == 401


def test_a_server_without_keys_shows_the_local_operator_everything(server):
    with server.client() as c:
        assert c.get("/v1/models", headers={"X-Request-ID": "open-log-1"}).status_code == 200
        log = _log(c)
        assert log["scope"] == "all" and "open-log-1" in _ids(log)
        assert c.get("/ui/api/overview").json()["admin"] is True


def test_key_syntax_admin_flag_and_the_old_forms():
    from mlxd.config import Settings, parse_key_item

    assert parse_key_item("alice:sk-1") == {"name": "alice", "key": "sk-1"}
    assert parse_key_item("sk-1") == {"key": "sk-1"}
    assert parse_key_item("alice:sk-1 admin") == {"name": "alice", "key": "sk-1", "admin": True}
    assert parse_key_item("  sk-1\tadmin ") == {"key": "sk-1", "admin": True}
    # a ':' in the key stays in the key, with or without the flag
    assert parse_key_item("ops:a:b:admin") == {"name": "ops", "key": "a:b:admin"}
    assert parse_key_item("ops:a:b admin") == {"name": "ops", "key": "a:b", "admin": True}
    # anything else after whitespace is still part of the key, as it always was
    assert parse_key_item("sk-2 # note") == {"key": "sk-2 # note"}
    assert parse_key_item("sk-2 Admin") == {"key": "sk-2 Admin"}
    keys = Settings(security={"api_keys": "a:sk-a admin,sk-b"}).security.api_keys
    assert [(k.name, k.key, k.admin) for k in keys] == [("a", "sk-a", True), (None, "sk-b", False)]
    assert (
        Settings(security={"api_keys": [{"key": "k", "admin": True}]}).security.api_keys[0].admin
        is True
    )


def test_a_key_keeps_its_owner_when_the_key_file_changes(tmp_path: Path):
    from mlxd.api.security import KeyRing
    from mlxd.config import Settings

    f = tmp_path / "keys"
    f.write_text("ops:sk-one\nsk-two admin\n")
    ring = KeyRing(
        Settings(security={"api_key_file": str(f)}), environ={"MLXD_API_KEYS": "ops:sk-three admin"}
    )
    one, two, three = (ring.match(k).principal for k in ("sk-one", "sk-two", "sk-three"))
    assert (one.admin, two.admin, three.admin) == (False, True, True)
    assert len({one.owner, two.owner, three.owner}) == 3  # one name, two keys, two owners
    assert ring.match("sk-two admin") is None  # the flag is not part of the key
    f.write_text("renamed:sk-one admin\nsk-two\n")
    ring._checked = 0.0  # skip the 2 s re-check interval
    again = ring.match("sk-one").principal
    assert again.owner == one.owner and again.admin and again.name == "renamed"
    assert not ring.match("sk-two").principal.admin
