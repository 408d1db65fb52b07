"""The tokenizer as mlxd loads it (text/processor.py) drops transformers' Python copy of the
vocabulary and merges, and still tokenizes, templates and detokenizes exactly as the
tokenizer mlx-lm loads. The fixture is a Qwen2-family tokenizer (transformers loads it
with Qwen2Tokenizer, a class that keeps the copy): byte-level BPE with a few merges."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.byte_level import CHATML, write_byte_level_tokenizer
from mlx_lm.tokenizer_utils import load as mlx_lm_load

from mlxd.text.processor import TextProcessor, load_tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = ["Hello, world!", "naïve café — 日本語 🙂", "  spaces\tand\nnewlines  ", ""]


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory) -> Path:
    return write_byte_level_tokenizer(
        tmp_path_factory.mktemp("qwen-tok"),
        merges=[("H", "e"), ("l", "l"), ("He", "ll"), ("Ġ", "w")],
        special=SPECIAL,
        tokenizer_config={
            "tokenizer_class": "Qwen2Tokenizer",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": CHATML,
        },
        # <|im_end|>'s id: after the 256 byte tokens, the four merges and two specials
        config={"model_type": "qwen2", "eos_token_id": 256 + 4 + 2},
    )


def test_same_tokens_template_and_text_without_the_python_vocabulary(qwen_tok):
    ref = mlx_lm_load(qwen_tok)
    assert type(ref._tokenizer).__name__ == "Qwen2Tokenizer"
    assert isinstance(ref._tokenizer.__dict__.get("_vocab"), dict)  # what is dropped
    assert len(ref._tokenizer.__dict__.get("_merges")) == 4
    ours = load_tokenizer(qwen_tok)
    hf = ours._tokenizer
    assert "_vocab" not in hf.__dict__ and "_merges" not in hf.__dict__
    assert len(ours) == len(ref) and hf.get_vocab() == ref._tokenizer.get_vocab()
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text)
        assert ours.decode(ref.encode(text)) == ref.decode(ref.encode(text))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[1]}]
    proc = TextProcessor("q", ours, len(ours))
    assert proc.encode_messages(msgs) == ref.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True
    )
    ids = ref.encode(TEXTS[1])
    d_ours, d_ref = proc.detokenizer, ref.detokenizer
    for t in ids:
        d_ours.add_token(t)
        d_ref.add_token(t)
    d_ours.finalize()
    d_ref.finalize()
    assert d_ours.text == d_ref.text == TEXTS[1]
