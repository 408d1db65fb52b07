"""mlx-lm's byte-level streaming detokenizer without its per-vocabulary token table.

mlx-lm's ``BPEStreamingDetokenizer`` (the one it picks for every tokenizer whose
``tokenizer.json`` has a ByteLevel decoder: Qwen, Llama 3, SmolLM, ...) builds, once per
tokenizer, a Python list with every token's string: for a 152k-token vocabulary ~10 MB in
each front end (docs/benchmarks.md, "Front-end memory"). It only ever reads that list one
entry at a time, by the id just generated, so :class:`LazyBPEStreamingDetokenizer` hands it
a view that asks the tokenizer for the entry instead (the same
``convert_ids_to_tokens`` call mlx-lm filled the list with, in Rust for a fast tokenizer).
The streaming algorithm is mlx-lm's own, inherited unchanged: same text after every token,
same held-back partial UTF-8, same leading-space trim, same quirks
(tests/engines/test_detokenizer.py compares the two token by token).

Why not ``tokenizers.decoders.DecodeStream``: it decodes with the tokenizer's decoder
pipeline, so mlx-lm's own streaming rules (trim one leading space, hold a lone space
token, "!" for ids past the vocabulary, flushing in ``finalize``) would have to be copied
around it, and it still streams the NUL byte token differently (mlx-lm: "Ā",
DecodeStream: "\\x00").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper


class TokenView(Sequence[str]):
    """``tokenizer.convert_ids_to_tokens(range(len(tokenizer)))`` without the list: each
    entry is looked up when read. Ids at or past the length raise IndexError like the list."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._len = len(tokenizer)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._len))]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("token id out of range")
        return self._tokenizer.convert_ids_to_tokens(index)


class LazyBPEStreamingDetokenizer(BPEStreamingDetokenizer):
    """mlx-lm's ``BPEStreamingDetokenizer`` over a :class:`TokenView` instead of a list.

    It skips the parent's ``__init__`` (whose only work is building the list) and sets the
    same attributes; every other method is the parent's. ``tokenmap`` is a public attribute
    of mlx-lm's class, read by ``add_token`` as ``tokenmap[id]`` and ``len(tokenmap)``.
    """

    def __init__(self, tokenizer: Any) -> None:  # noqa: D107 - see the class
        self.tokenmap = TokenView(tokenizer)
        self.reset()


def use_lazy_detokenizer(wrapper: Any) -> bool:
    """Give an mlx-lm ``TokenizerWrapper`` the lazy byte-level detokenizer in place of the
    table-backed one it built, so the table can be freed; True when it was replaced.

    Only an exact ``BPEStreamingDetokenizer`` is replaced (a subclass or another kind, e.g.
    the SentencePiece or the naive one, is left as mlx-lm chose it). The wrapper keeps its
    prototype detokenizer in ``_detokenizer`` and hands out copies of it from its
    ``detokenizer`` property; there is no public way to pass mlx-lm's loader a class, so the
    prototype is swapped here. A wrapper without that attribute is left alone.
    """
    if not isinstance(wrapper, TokenizerWrapper):
        return False
    current = wrapper.__dict__.get("_detokenizer")
    if type(current) is not BPEStreamingDetokenizer:
        return False
    hf = wrapper.__dict__.get("_tokenizer")
    if hf is None or len(current.tokenmap) != len(hf):
        return False
    wrapper.__dict__["_detokenizer"] = LazyBPEStreamingDetokenizer(hf)
    return True
