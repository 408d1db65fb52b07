"""The engine core's calls on the wire (enginecore/protocol.py): one typed request and one
typed result per call, validated on decode both ways; a call that does not decode is
answered with an error, never left waiting."""

from __future__ import annotations

import asyncio
import os
from typing import get_args

import msgspec
import pytest
import zmq

from mlxd.core.errors import EngineError, InvalidRequest, ModelNotFound
from mlxd.enginecore import calls
from mlxd.enginecore import protocol as p
from mlxd.frontend.client import CoreClient


def test_every_call_has_one_handler_and_one_result_type():
    requests = get_args(p.CallRequest)
    results = get_args(p.CallResult)
    assert set(calls.HANDLERS) == set(requests)
    for req in requests:
        assert req.result in results, req.__name__
    tags = [t.__struct_config__.tag for t in requests]
    assert len(set(tags)) == len(tags)
    assert {r.result for r in requests} == set(results)


def test_requests_and_results_decode_with_validation():
    enc, dec = p.encoder(), p.core_decoder()
    call = dec.decode(enc.encode(p.Call(3, 7, 11, p.Embed("m", ["a", [1, 2]], dimensions=8))))
    assert call == p.Call(3, 7, 11, p.Embed("m", ["a", [1, 2]], dimensions=8))
    with pytest.raises(msgspec.ValidationError):
        dec.decode(enc.encode(p.Call(3, 7, 11, p.Embed(5, "not a list"))))  # type: ignore[arg-type]
    head = p.call_head(enc.encode(p.Call(3, 7, 11, p.Embed(5, "x"))))  # type: ignore[arg-type]
    assert (head.epoch, head.frontend, head.cid) == (3, 7, 11)
    assert p.call_head(enc.encode(p.Abort(3, ["r"]))) is None
    reply = p.frontend_decoder().decode(enc.encode(p.Reply(3, 11, p.ScorerCount(2))))
    assert reply.value == p.ScorerCount(2)


def _run_against(server, body) -> None:
    """``body(client)`` with a second front end's connection to ``server``'s core."""

    async def main() -> None:
        client = CoreClient(server.runtime.cores.clients[0].run_dir)
        await client.start()
        try:
            await client.wait_ready(60)
            await body(client)
        finally:
            await client.close()

    asyncio.run(main())


def test_typed_calls_on_a_live_core(server):
    async def body(client: CoreClient) -> None:
        status = await client.call(p.Status())
        assert isinstance(status, p.CoreStatus) and status.epoch == client.epoch
        assert "tiny-llama" in [m["name"] for m in status.models]
        info = await client.call(p.Touch("tiny-llama"))
        assert (info.name, info.kind) == ("tiny-llama", "chat") and info.vocab_size > 0
        loaded = await client.call(p.Loaded())
        assert "tiny-llama" in [m["name"] for m in loaded.models]
        toks = await client.call(p.Tokenize("tiny-llama", ["hello there"]))
        assert toks.model == "tiny-llama" and toks.tokens[0]
        with pytest.raises(ModelNotFound) as missing:  # the error's class crosses the wire
            await client.call(p.Touch("no-such-model"))
        assert missing.value.status == 404

    _run_against(server, body)


def test_a_malformed_call_is_answered_with_a_400_and_the_core_keeps_serving(server):
    async def body(client: CoreClient) -> None:
        bad = p.Embed(5, "not a list of inputs")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest) as err:
            await asyncio.wait_for(client.call(bad), 30)
        assert err.value.status == 400 and "malformed engine-core call" in err.value.message
        assert isinstance(await client.call(p.Status()), p.CoreStatus)

    _run_against(server, body)


def test_a_reply_that_does_not_decode_or_answers_another_call_fails_its_call(tmp_path):
    """The front end's side: a reply whose value is not the call's result type ends the
    call with a 500 instead of handing the caller something it did not ask for."""

    async def main() -> None:
        client = CoreClient(tmp_path, dead_after=60.0)
        await client.start()
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(client.address)
        enc = p.encoder()
        try:
            push.send(enc.encode(p.Heartbeat(epoch=1, pid=os.getpid(), ready=True)))
            await client.wait_ready(10)
            for reply in (
                ["reply", 1, 1, ["status", "not a status"], None],
                p.Reply(1, 2, p.Done()),
            ):
                call = asyncio.ensure_future(client.call(p.Status()))
                await asyncio.sleep(0.05)  # sent, waiting for its reply
                push.send(enc.encode(reply))
                with pytest.raises(EngineError) as err:
                    await asyncio.wait_for(call, 10)
                assert err.value.status == 500
        finally:
            push.close(0)
            await client.close()

    asyncio.run(main())
