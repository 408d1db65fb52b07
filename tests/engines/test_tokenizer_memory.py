"""The tokenizer as mlxd loads it (engines/text.py) drops transformers' Python copy of the
vocabulary and merges, and still tokenizes, templates and detokenizes exactly as the
tokenizer mlx-lm loads. The fixture is a Qwen2-family tokenizer (transformers loads it
with Qwen2Tokenizer, a class that keeps the copy): byte-level BPE with a few merges."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as mlx_lm_load

from mlxd.engines.text import TextProcessor, load_tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["Hello, world!", "naïve café — 日本語 🙂", "  spaces\tand\nnewlines  ", ""]


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d = tmp_path_factory.mktemp("qwen-tok")
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("H", "e"), ("l", "l"), ("He", "ll"), ("Ġ", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab, merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIAL)
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHATML}))
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2",
                                               "eos_token_id": len(vocab) + 2}))
    return d


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
    proc = TextProcessor("q", ours, len(ours), masks=False)
    assert proc.encode_messages(msgs) == ref.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True)
    ids = ref.encode(TEXTS[1])
    d_ours, d_ref = proc.detokenizer, ref.detokenizer
    for t in ids:
        d_ours.add_token(t)
        d_ref.add_token(t)
    d_ours.finalize()
    d_ref.finalize()
    assert d_ours.text == d_ref.text == TEXTS[1]
