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
from mlxd.engines.structured import GrammarCompiler


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
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
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


def test_a_front_ends_compiler_validates_without_a_tokenizer(compiler):
    """masks=False (front ends): the same 400s for what a grammar alone shows, the same
    tool-call literals, and no llguidance tokenizer built (its tries are the memory)."""
    full, tok = compiler
    fe = GrammarCompiler(tok, 512, sorted(tok.eos_token_ids), masks=False)
    fe.check(fe.from_constraint(OutputConstraint("json_schema", '{"type": "object"}')))
    for bad in (OutputConstraint("json_schema", '{"not": {}}'),
                OutputConstraint("lark", "start: undefined_rule"),
                OutputConstraint("regex", "[a-")):
        with pytest.raises(InvalidRequest):
            fe.check(fe.from_constraint(bad))
        with pytest.raises(InvalidRequest):
            full.check(full.from_constraint(bad))
    for text in ("<|im_end|>", "<|endoftext|>", "plain words"):
        # a token where llguidance itself reads one (every added token), else the text
        ids = tok.encode(text, add_special_tokens=False)
        as_token = len(ids) == 1 and full.lltok.is_special_token(ids[0])
        assert fe.literal(text) == (f"<[{ids[0]}]>" if as_token else json.dumps(text))
    assert fe._lltok is None
