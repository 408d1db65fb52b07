"""A front end's tokenizer without MLX (frontend/tokenizer_side.py) and the model family's
tokenizer defaults that the engine core sends it instead (text/processor.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from fixtures.byte_level import CHATML, write_byte_level_tokenizer

from mlxd.enginecore import protocol as p
from mlxd.enginecore.calls import model_info
from mlxd.text.processor import load_tokenizer, tokenizer_defaults


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer with ChatML and no EOS in its config.json (so that a
    family default can supply one)."""
    return write_byte_level_tokenizer(
        tmp_path_factory.mktemp("tok-side"),
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
        tokenizer_config={
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|im_end|>",
            "chat_template": CHATML,
        },
        config={"model_type": "qwen2"},
    )


def test_a_front_end_process_tokenizes_and_templates_without_mlx_or_llguidance(tok_dir):
    """In a fresh process (as a front end starts): tokenizer, template, streaming
    detokenizer, a tool parser and a structured-output request's plan (its grammar left to
    the engine core), and neither MLX, mlx-lm's model code nor llguidance is imported; the
    ids are the ones mlx-lm's own loader gives."""
    from mlx_lm.tokenizer_utils import load as mlx_lm_load

    code = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        from mlxd.frontend import tokenizer_side
        assert tokenizer_side.register_without_init()
        assert not tokenizer_side.register_without_init()  # once per process
        from mlxd.core.types import GenerateRequest, GrammarSpec, OutputConstraint, SamplingParams
        from mlxd.text.processor import TextProcessor, load_tokenizer
        tok = load_tokenizer(Path({str(tok_dir)!r}))
        proc = TextProcessor("t", tok, 300, None)
        ids = proc.encode_messages([{{"role": "user", "content": "héllo"}}])
        d = proc.detokenizer
        for i in tok.encode("naïve café"):
            d.add_token(i)
        d.finalize()
        req = GenerateRequest(model="t", sampling=SamplingParams(),
                              messages=[{{"role": "user", "content": "x"}}],
                              constraint=OutputConstraint("json_schema", '{{"not": {{}}}}'))
        plan = proc.prepare(req, ids)  # the grammar is the core's to compile (and refuse)
        assert isinstance(plan.grammar, GrammarSpec) and "llguidance" not in sys.modules
        import mlx_lm.tool_parsers.json_tools
        heavy = sorted(m for m in sys.modules
                       if m.split(".")[0] == "mlx" or m in ("mlx_lm.generate", "mlx_lm.models"))
        print(json.dumps({{"ids": ids, "text": d.text, "heavy": heavy,
                          "version": sys.modules["mlx_lm"].__version__}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["heavy"] == []
    assert got["text"] == "naïve café"
    import mlx_lm

    assert got["version"] == mlx_lm.__version__
    ref = mlx_lm_load(tok_dir).apply_chat_template(
        [{"role": "user", "content": "héllo"}], add_generation_prompt=True, tokenize=True
    )
    assert got["ids"] == list(ref if not isinstance(ref, dict) else ref["input_ids"])


def test_family_defaults_come_from_the_loaded_models_module():
    """mlx-lm keeps a family's tokenizer settings in its model module; the engine core,
    which has that module loaded, reads them off the model and puts them in the model's
    info for the front ends."""
    from mlx_lm.models import llama, muse_spark

    spark = muse_spark.Model.__new__(muse_spark.Model)  # no weights needed
    assert tokenizer_defaults(spark) == muse_spark.TOKENIZER_DEFAULTS
    assert tokenizer_defaults(llama.Model.__new__(llama.Model)) is None
    assert tokenizer_defaults(None) is None
    entry = SimpleNamespace(
        name="m", kind="chat", path=Path("/m"), engine=SimpleNamespace(model=spark, vocab_size=10)
    )
    info = model_info(entry)
    assert info.tokenizer_defaults == muse_spark.TOKENIZER_DEFAULTS
    wire = p.frontend_decoder().decode(p.encoder().encode(p.Reply(1, 1, info)))
    assert wire.value == info  # plain data: it crosses the wire as it is


def test_the_front_ends_tokenizer_applies_the_defaults_it_is_sent(tok_dir):
    """What mlx-lm's own loader does with a family's defaults: EOS ids and a tool parser
    for a checkpoint that names neither."""
    plain = load_tokenizer(tok_dir)
    assert not plain.has_tool_calling
    tok = load_tokenizer(tok_dir, defaults={"eos_token_ids": [4], "tool_parser_type": "json_tools"})
    assert 4 in tok.eos_token_ids
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"
