"""The grammar logits processor: masking, advancing with the sampled token, arming late."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxd.core.errors import InvalidRequest
from mlxd.core.types import OutputConstraint
from mlxd.engines.grammar_mask import GrammarProcessor
from mlxd.text.structured import GrammarCompiler


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from fixtures.tiny_models import make_tiny_chat_model
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    path = make_tiny_chat_model(tmp_path_factory.mktemp("m") / "g", "qwen2")
    tok = load_tokenizer(Path(path))
    return GrammarCompiler(tok, 512, sorted(tok.eos_token_ids)), tok


def _walk(proc, tok, prompt_last: int, steps: int, arm_first: list[int] | None = None):
    """Drive the processor like mlx-lm's batch: context grows by the sampled token."""
    rng = np.random.default_rng(0)
    ctx = [prompt_last]
    out = []
    forced = list(arm_first or [])
    for _ in range(steps):
        logits = mx.array(rng.normal(size=(1, 512)).astype(np.float32))
        masked = proc(mx.array(ctx), logits)
        if forced:
            t = forced.pop(0)
        else:
            t = int(mx.argmax(masked, axis=-1).item())
        ctx.append(t)
        if t in tok.eos_token_ids:
            break
        out.append(t)
    return out, masked


def test_output_matches_the_schema_then_only_eos(compiler):
    gc, tok = compiler
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    m = gc.matcher(gc.from_constraint(OutputConstraint("json_schema", json.dumps(schema))))
    out, _ = _walk(GrammarProcessor(m, sorted(tok.eos_token_ids)), tok, 0, 60)
    assert json.loads(tok.decode(out))["n"] in range(10)
    assert m.is_stopped()


def test_arming_after_the_thinking_part(compiler):
    gc, tok = compiler
    m = gc.matcher(gc.from_constraint(OutputConstraint("regex", "ab")))
    think_end = tok.encode(" end", add_special_tokens=False)
    proc = GrammarProcessor(m, sorted(tok.eos_token_ids), arm_after=think_end)
    free = tok.encode(" free text", add_special_tokens=False)
    out, _ = _walk(proc, tok, 0, 30, arm_first=free + think_end)
    assert tok.decode(out) == " free text endab"


def test_unsupported_grammars_are_invalid_requests(compiler):
    gc, _ = compiler
    with pytest.raises(InvalidRequest):
        gc.matcher(gc.from_constraint(OutputConstraint("json_schema", '{"not": {}}')))
    with pytest.raises(InvalidRequest):
        gc.from_constraint(OutputConstraint("json_schema", "{nope"))
    with pytest.raises(InvalidRequest):
        gc.matcher(gc.from_constraint(OutputConstraint("lark", "start: undefined_rule")))


def test_the_core_compiles_what_a_front_end_planned(compiler):
    """A front end's plan says what the grammar is made of (nothing compiled, sent over
    the wire as is); the core's matcher compiles it, and an unsupported schema or grammar
    is a 400 naming the request's field."""
    import msgspec

    from mlxd.core.types import GenerateRequest, GrammarSpec, SamplingParams
    from mlxd.text.processor import TextProcessor

    _, tok = compiler
    proc = TextProcessor("g", tok, 512)

    def plan(**kw) -> GrammarSpec:
        req = GenerateRequest(
            model="g", sampling=SamplingParams(), messages=[{"role": "user", "content": "hi"}], **kw
        )
        spec = proc.prepare(req, proc.tokenize(req)).grammar
        return msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=GrammarSpec)

    ok = plan(constraint=OutputConstraint("json_schema", '{"type": "object"}'))
    assert ok.constraint.kind == "json_schema" and not ok.tool_call
    assert not proc.matcher(ok).is_error()
    for bad in (
        OutputConstraint("json_schema", '{"not": {}}'),
        OutputConstraint("json_schema", "{nope"),
        OutputConstraint("lark", "start: undefined_rule"),
        OutputConstraint("regex", "[a-"),
    ):
        with pytest.raises(InvalidRequest) as err:
            proc.matcher(plan(constraint=bad))
        assert err.value.param == "response_format"
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
            },
        }
    ]
    call = plan(tools=tools, tool_choice="required")
    assert call.tool_call and call.names == ["f"] and not proc.matcher(call).is_error()
    with pytest.raises(InvalidRequest) as err:  # a front end tells this one itself
        plan(tools=tools, tool_choice="function", tool_name="g")
    assert err.value.param == "tool_choice"
