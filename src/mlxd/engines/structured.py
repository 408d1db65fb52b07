"""Constrained decoding with llguidance: JSON schemas, JSON objects, regexes, tool calls.

Why llguidance: MIT licence, a Rust core with abi3 wheels on PyPI and no torch dependency,
masks computed lazily in tens of microseconds per token (no ahead-of-time automaton over the
whole vocabulary, so a new schema costs about a millisecond to compile), JSON Schema and Lark
grammars (with ``%json`` inside Lark, which is how a tool call becomes a grammar), and a
helper that builds its tokenizer from a Hugging Face fast tokenizer (byte-level BPE
included, special tokens kept apart from text).

How it runs inside the batch: each constrained sequence gets a :class:`GrammarProcessor`
among its mlx-lm logits processors. mlx-lm calls a row's processors with that row's token
context and logits at every decode step; the processor first advances its matcher with the
token sampled at the previous step (the context's last token), then masks every token the
grammar does not allow at this point (``-inf``). Rows without a grammar are untouched, so
one batch mixes constrained and free sequences. When the grammar is complete only EOS is
allowed, so the sequence ends with ``finish_reason == "stop"``; running out of
``max_tokens`` first ends it with "length" (a truncated document).

Reasoning models: the grammar can wait until the thinking part is over (``arm_after``: the
think-end token ids), so the model still thinks freely and then answers in the schema.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.core.errors import InvalidRequest
from mlxd.core.types import OutputConstraint

log = logging.getLogger(__name__)

# Between JSON tokens: nothing, one space, or a newline and some indentation (models that
# pretty-print), bounded so that a weak model cannot pad forever.
_WS = r"(?:[\x20\x09]?|\x0A[\x20\x09]{0,16})"
JSON_OPTIONS = {"whitespace_pattern": _WS}
# Tool calls are written the way the families' templates write them: one line, at most a
# space between tokens (``{"name": "f", "arguments": {...}}``).
TOOL_JSON_OPTIONS = {"whitespace_pattern": r"\x20?"}


class GrammarCompiler:
    """One model's grammar front end: its llguidance tokenizer and validated grammars.

    ``masks=False`` is the front ends' kind: they validate grammars but never mask logits,
    so they build no llguidance tokenizer (it copies the whole vocabulary into tries: 60-90
    MB for a 150k-token vocabulary, docs/benchmarks.md) and validate without one. What only
    a tokenizer can find (a token id or special-token name in a user's Lark grammar that
    the vocabulary lacks) the engine core finds when it builds the request's matcher, and
    the request still ends in a 400 before any output.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], *,
                 masks: bool = True) -> None:
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self.vocab_size = vocab_size
        self.eos = list(eos_token_ids)
        self.masks = masks
        self._lltok: Any = None
        self._lock = threading.Lock()
        self._valid: OrderedDict[str, str] = OrderedDict()  # grammar -> "" or error

    @property
    def lltok(self) -> Any:
        if self._lltok is None:
            with self._lock:
                if self._lltok is None:
                    import llguidance.hf

                    try:
                        self._lltok = llguidance.hf.from_tokenizer(
                            self._hf, n_vocab=self.vocab_size, eos_token=self.eos or None)
                    except Exception as exc:  # noqa: BLE001 - slow tokenizers, odd vocabularies
                        raise InvalidRequest(
                            f"structured output is not available for this model's tokenizer "
                            f"({exc})") from exc
        return self._lltok

    # -- grammar sources ---------------------------------------------------------------------
    @staticmethod
    def json_schema_grammar(schema: dict | bool) -> str:
        import llguidance

        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidRequest(f"invalid JSON schema: {exc}", param="response_format") from exc

    def from_constraint(self, c: OutputConstraint) -> str:
        import llguidance

        if c.kind == "json_object":
            return self.json_schema_grammar({"type": "object"})
        if c.kind == "json_schema":
            try:
                schema = json.loads(c.spec)
            except ValueError as exc:
                raise InvalidRequest(f"the JSON schema is not valid JSON: {exc}",
                                     param="response_format") from exc
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest("a JSON schema must be an object", param="response_format")
            return self.json_schema_grammar(schema)
        if c.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(c.spec)
        if c.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(c.spec)
        raise InvalidRequest(f"unknown output constraint '{c.kind}'", param="response_format")

    def literal(self, text: str) -> str:
        """A Lark terminal for ``text``: the special token itself when the tokenizer has it as
        one (``<tool_call>`` in Qwen's vocabulary), else the characters."""
        ids = list(self._hf.encode(text, add_special_tokens=False))
        # llguidance reads every added token (special or not) as a token, never as text
        if len(ids) == 1 and ids[0] in getattr(self._hf, "added_tokens_decoder", {}):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    # -- checking and matching -------------------------------------------------------------
    def check(self, grammar: str, param: str = "response_format") -> None:
        """Raise a 400 (InvalidRequest) for an unsupported grammar or schema."""
        if self.masks:
            self.matcher(grammar, param)
        else:
            self._validate(grammar, param, None)

    def _validate(self, grammar: str, param: str, lltok: Any) -> None:
        import llguidance

        with self._lock:
            err = self._valid.get(grammar)
        if err is None:
            err = llguidance.LLMatcher.validate_grammar(grammar, lltok)
            with self._lock:
                self._valid[grammar] = err
                while len(self._valid) > 256:
                    self._valid.popitem(last=False)
        if err and not err.startswith("WARNING"):
            raise InvalidRequest(f"this schema or grammar is not supported: {err}", param=param)

    def matcher(self, grammar: str, param: str = "response_format") -> Any:
        """A fresh matcher for ``grammar``; an unsupported grammar or schema is a 400."""
        import llguidance

        self._validate(grammar, param, self.lltok)
        m = llguidance.LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise InvalidRequest(f"this schema or grammar is not supported: {m.get_error()}",
                                 param=param)
        return m


class GrammarProcessor:
    """An mlx-lm logits processor that keeps one sequence inside its grammar.

    Called once per decode step of its row with (context tokens, logits of shape (1, V)).
    ``arm_after`` delays the constraint until those token ids have been generated (the end
    of a thinking part).
    """

    def __init__(self, matcher: Any, eos_token_ids: Sequence[int],
                 arm_after: Sequence[int] | None = None) -> None:
        self.matcher = matcher
        self.eos = list(eos_token_ids)
        self._arm = tuple(arm_after or ())
        self.armed = not self._arm
        self._tail: list[int] = []
        self._calls = 0
        self._pending = False  # our last mask applies to the context's last token
        self._warned = False

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        self._calls += 1
        if self._calls > 1:  # context[-1] was sampled after our previous call
            token = int(context[-1].item())
            if self.armed:
                if self._pending and not self.matcher.is_stopped():
                    self.matcher.consume_token(token)
            else:
                self._tail = (self._tail + [token])[-len(self._arm):]
                if tuple(self._tail) == self._arm:
                    self.armed = True
        if not self.armed:
            return logits
        self._pending = True
        vocab = logits.shape[-1]
        if self.matcher.is_error():
            if not self._warned:
                log.warning("grammar matcher failed (%s); ending the sequence",
                            self.matcher.get_error())
                self._warned = True
            allowed = np.zeros(vocab, dtype=bool)
            allowed[[t for t in self.eos if t < vocab]] = True
        else:
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)
            if allowed.shape[0] < vocab:
                allowed = np.pad(allowed, (0, vocab - allowed.shape[0]))
        mask = mx.array(allowed)
        return mx.where(mask, logits, mx.array(-float("inf"), dtype=logits.dtype))


# -- tool calls as grammars ---------------------------------------------------------------------

def _call_schema(tools: list[dict], names: Sequence[str]) -> dict:
    variants = []
    for t in tools:
        fn = t.get("function", t)
        if fn.get("name") not in names:
            continue
        params = fn.get("parameters") or {"type": "object"}
        variants.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def tool_call_grammar(compiler: GrammarCompiler, fmt: Any, tools: list[dict],
                      names: Sequence[str], parallel: bool,
                      answer: str | None = None) -> str:
    """A Lark grammar for one call (or several, ``parallel``) of the functions ``names``.

    For families whose calls are JSON (``{"name", "arguments"}`` between the markers) the
    grammar fixes the name and the arguments' schema. For other syntaxes it forces the
    opening marker (and, for Qwen3-Coder's XML, the function name) and leaves the rest to
    the model. ``answer`` (a Lark rule body, e.g. ``%json {...}``) makes the call optional:
    the output is either that answer or calls.
    """
    import llguidance

    start, end = compiler.literal(fmt.start), compiler.literal(fmt.end) if fmt.end else None
    if fmt.json_body:
        schema = json.dumps(_call_schema(tools, names), ensure_ascii=False)
        call = f'{start} "\\n" call_body "\\n" {end}'
        body = f"call_body: %json {{ \"x-guidance\": {json.dumps(TOOL_JSON_OPTIONS)}, " \
               f"\"anyOf\": [{schema}] }}\n"
    elif fmt.name == "qwen3_coder":
        alts = " | ".join(json.dumps(n) for n in names)
        call = f'{start} "\\n<function=" ({alts}) ">" REST'
        body = "REST: /(.|\\n)*/\n"
        parallel = False
    else:
        call = f"{start} REST"
        body = "REST: /(.|\\n)*/\n"
        parallel = False
    calls = "tool_call (\"\\n\" tool_call)*" if parallel else "tool_call"
    lark = f"start: {calls}\n" if answer is None else \
        f"start: answer | calls\ncalls: {calls}\nanswer: {answer}\n"
    lark += f"tool_call: {call}\n{body}"
    return llguidance.LLMatcher.grammar_from_lark(lark)
