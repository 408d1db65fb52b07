"""The GGUF file's tokenizer as a Hugging Face ``tokenizer.json`` and its side files.

GGUF stores the vocabulary as llama.cpp needs it (pieces, scores, merges, a pre-tokenizer
name); mlx-lm loads tokenizers through ``transformers``, which needs ``tokenizer.json``.
Rebuilding it from the pieces keeps the token ids identical to llama.cpp's, which the
weights depend on.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from mlxd.store.gguf_meta import GGUFImportError
from mlxd.store.gguf_meta import meta as _meta

__all__ = ["TokenizerFiles", "build_tokenizer"]

# llama.cpp token types (tokenizer.ggml.token_type).
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes from llama.cpp / the original HF tokenizer.json files.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact"})
_GPT2_PRE = frozenset({"gpt-2", "gpt2", "default"})
_LLAMA3_PRE = frozenset({"llama-bpe", "llama3", "llama-v3"})
# Qwen2/2.5/3: Llama 3's split but one digit at a time, and merges are never skipped.
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN2_PRE = frozenset({"qwen2"})


@dataclass
class TokenizerFiles:
    """What ``import_gguf`` writes: tokenizer.json, its config, and the ids config.json needs."""

    tokenizer: Tokenizer
    config: dict[str, Any]
    special_tokens_map: dict[str, Any]
    eos_ids: list[int]
    bos_id: int | None
    pad_id: int | None


def _token_id(md: dict[str, Any], key: str, n_tokens: int) -> int | None:
    value = _meta(md, f"tokenizer.ggml.{key}", None)
    if value is None:
        return None
    value = int(value)
    # Converters write -1 / 0xFFFFFFFF for "no such token".
    return value if 0 <= value < n_tokens else None


def _spm_merges(
    tokens: list[str], vocab: dict[str, int], scores: np.ndarray, mergeable: np.ndarray
) -> list[tuple[str, str]]:
    """Derive BPE merges from a SentencePiece vocabulary.

    GGUF stores only pieces and scores for SentencePiece models; SentencePiece BPE
    always merges the pair whose result scores highest, so ranking every split of
    every piece by the piece's score reproduces it with a standard BPE model.
    """
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for idx, piece in enumerate(tokens):
        if not mergeable[idx] or len(piece) < 2:
            continue
        score = float(scores[idx])
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None and mergeable[li] and mergeable[ri]:
                ranked.append((-score, idx, li, ri, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_tokenizer(md: dict[str, Any], context_length: int) -> TokenizerFiles:
    kind = _meta(md, "tokenizer.ggml.model", None)
    if kind is None:
        raise GGUFImportError("GGUF metadata is missing 'tokenizer.ggml.model'")
    tokens: list[str] = list(_meta(md, "tokenizer.ggml.tokens"))
    n = len(tokens)
    token_type = np.asarray(
        md.get("tokenizer.ggml.token_type", np.full(n, _TT_NORMAL)), dtype=np.int64
    )
    if token_type.shape != (n,):
        raise GGUFImportError("tokenizer.ggml.token_type length does not match the token list")

    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # first occurrence wins, like llama.cpp's token_to_id

    bos_id = _token_id(md, "bos_token_id", n)
    eos_id = _token_id(md, "eos_token_id", n)
    unk_id = _token_id(md, "unknown_token_id", n)
    pad_id = _token_id(md, "padding_token_id", n)
    eot_id = _token_id(md, "eot_token_id", n)
    eom_id = _token_id(md, "eom_token_id", n)

    if kind == "gpt2":
        pre = _meta(md, "tokenizer.ggml.pre", "default")
        merges = []
        for m in _meta(md, "tokenizer.ggml.merges"):
            cut = m.find(" ", 1)  # llama.cpp splits at the first space after char 0
            if cut < 0:
                raise GGUFImportError(f"malformed BPE merge {m!r}")
            merges.append((m[:cut], m[cut + 1 :]))
        byte_level = pre_tokenizers.ByteLevel(
            add_prefix_space=False, trim_offsets=True, use_regex=pre not in _LLAMA3_PRE | _QWEN2_PRE
        )
        pre_tok: pre_tokenizers.PreTokenizer
        if pre in _DIGIT_SPLIT_PRE:
            pre_tok = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        elif pre in _GPT2_PRE:
            if pre == "default":
                warnings.warn(
                    "GGUF has no tokenizer.ggml.pre; assuming GPT-2 pre-tokenization",
                    stacklevel=3,
                )
            pre_tok = byte_level
        elif pre in _LLAMA3_PRE | _QWEN2_PRE:
            regex = _LLAMA3_REGEX if pre in _LLAMA3_PRE else _QWEN2_REGEX
            pre_tok = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(regex), behavior="isolated"), byte_level]
            )
        else:
            raise GGUFImportError(
                f"unsupported BPE pre-tokenizer {pre!r} (supported: "
                f"{sorted(_DIGIT_SPLIT_PRE | _GPT2_PRE | _LLAMA3_PRE | _QWEN2_PRE)})"
            )
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                fuse_unk=False,
                byte_fallback=False,
                ignore_merges=pre in _LLAMA3_PRE,
            )
        )
        tok.pre_tokenizer = pre_tok
        tok.decoder = decoders.ByteLevel()
        add_bos_default = False
    elif kind == "llama":
        scores = np.asarray(md.get("tokenizer.ggml.scores", -np.arange(n)), dtype=np.float64)
        if scores.shape != (n,):
            raise GGUFImportError("tokenizer.ggml.scores length does not match the token list")
        mergeable = (token_type == _TT_NORMAL) | (token_type == _TT_USER_DEFINED)
        merges = _spm_merges(tokens, vocab, scores, mergeable)
        add_prefix = bool(_meta(md, "tokenizer.ggml.add_space_prefix", True))
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                unk_token=tokens[unk_id] if unk_id is not None else None,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        replace = normalizers.Replace(" ", "\u2581")
        tok.normalizer = (
            normalizers.Sequence([normalizers.Prepend("\u2581"), replace])
            if add_prefix
            else replace
        )
        dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_prefix:
            dec.append(decoders.Strip(content=" ", left=1, right=0))
        tok.decoder = decoders.Sequence(dec)
        add_bos_default = True
    else:
        raise GGUFImportError(
            f"unsupported tokenizer model {kind!r} (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece BPE)"
        )

    # Control/user-defined tokens must be added tokens so that markers such as
    # <|im_start|> are matched verbatim as one id instead of being split by BPE.
    named = {i for i in (bos_id, eos_id, unk_id, pad_id, eot_id, eom_id) if i is not None}
    added: list[AddedToken] = []
    added_decoder: dict[str, dict[str, Any]] = {}
    for i in range(n):
        tt = int(token_type[i])
        if tt not in (_TT_CONTROL, _TT_USER_DEFINED, _TT_UNKNOWN) and i not in named:
            continue
        if vocab.get(tokens[i]) != i:
            continue  # duplicate string; unreachable by text anyway
        special = tt != _TT_USER_DEFINED
        added.append(AddedToken(tokens[i], special=special, normalized=False))
        added_decoder[str(i)] = {
            "content": tokens[i],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])

    add_bos = bool(_meta(md, "tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(_meta(md, "tokenizer.ggml.add_eos_token", False))
    bos_tok = tokens[bos_id] if add_bos and bos_id is not None else None
    eos_tok = tokens[eos_id] if add_eos and eos_id is not None else None
    if bos_tok is not None or eos_tok is not None:

        def seq(piece: str, type_id: int) -> list[str]:
            return [
                *([f"{bos_tok}:{type_id}"] if bos_tok is not None else []),
                f"{piece}:{type_id}",
                *([f"{eos_tok}:{type_id}"] if eos_tok is not None else []),
            ]

        specials = {tokens[i]: i for i in (bos_id, eos_id) if i is not None}
        tok.post_processor = processors.TemplateProcessing(
            single=seq("$A", 0),
            pair=seq("$A", 0) + seq("$B", 1),
            special_tokens=[(t, i) for t, i in specials.items() if t in (bos_tok, eos_tok)],
        )

    def name(i: int | None) -> str | None:
        return tokens[i] if i is not None else None

    special_map: dict[str, Any] = {
        k: name(i)
        for k, i in (
            ("bos_token", bos_id),
            ("eos_token", eos_id),
            ("unk_token", unk_id),
            ("pad_token", pad_id),
        )
        if i is not None
    }
    extra = [
        tokens[i]
        for i in range(n)
        if int(token_type[i]) == _TT_CONTROL
        and i not in {bos_id, eos_id, unk_id, pad_id}
        and vocab.get(tokens[i]) == i
    ]
    if extra:
        special_map["additional_special_tokens"] = extra

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(bos_id),
        "eos_token": name(eos_id),
        "unk_token": name(unk_id),
        "pad_token": name(pad_id),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added_decoder,
    }
    if extra:
        config["additional_special_tokens"] = extra
    template = _meta(md, "tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template

    eos_ids = list(dict.fromkeys(i for i in (eos_id, eot_id, eom_id) if i is not None))
    return TokenizerFiles(tok, config, special_map, eos_ids, bos_id, pad_id)
