"""Constrained decoding with llguidance: JSON schemas, JSON objects, regexes, tool calls.

Why llguidance: MIT licence, a Rust core with abi3 wheels on PyPI and no torch dependency,
masks computed lazily in tens of microseconds per token (no ahead-of-time automaton over the
whole vocabulary, so a new schema costs about a millisecond to compile), JSON Schema and Lark
grammars (with ``%json`` inside Lark, which is how a tool call becomes a grammar), and a
helper that builds its tokenizer from a Hugging Face fast tokenizer (byte-level BPE
included, special tokens kept apart from text).

How it runs inside the batch: each constrained sequence gets a
:class:`~mlxd.engines.grammar_mask.GrammarProcessor` (which imports MLX) among its mlx-lm
logits processors. This module (grammar sources, validation, tool-call grammars) imports
neither MLX nor NumPy, and only the engine core runs it: front ends send what a grammar is
made of (``core.types.GrammarSpec``) and never load llguidance (~9 MB of a front end's
memory).

Reasoning models: the grammar can wait until the thinking part is over (``arm_after``: the
think-end token ids), so the model still thinks freely and then answers in the schema.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mlxd.core.errors import InvalidRequest
from mlxd.core.types import OutputConstraint

if TYPE_CHECKING:  # a front end never loads llguidance (docs/architecture.md)
    from llguidance._lib import JsonCompileOptions

# Between JSON tokens: nothing, one space, or a newline and some indentation (models that
# pretty-print), bounded so that a weak model cannot pad forever.
_WS = r"(?:[\x20\x09]?|\x0A[\x20\x09]{0,16})"
JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": _WS}
# Tool calls are written the way the families' templates write them: one line, at most a
# space between tokens (``{"name": "f", "arguments": {...}}``).
TOOL_JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": r"\x20?"}


def first_line(error: str) -> str:
    """An llguidance error without the parser state it may append (schema details)."""
    return error.strip().split("\n", 1)[0][:500]


def _limits() -> Any:
    """llguidance's default resource limits, with terse errors: a verbose one carries the
    parser's state and grammar, which are not the client's to read."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


class GrammarCompiler:
    """One model's grammars: its llguidance tokenizer (built on first use: it copies the
    whole vocabulary into tries, 60-90 MB for a 150k-token vocabulary)
    and the validation results of recent grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self.vocab_size = vocab_size
        self.eos = list(eos_token_ids)
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
                            self._hf, n_vocab=self.vocab_size, eos_token=self.eos or None
                        )
                    except Exception as exc:  # noqa: BLE001 - slow tokenizers, odd vocabularies
                        raise InvalidRequest(
                            f"structured output is not available for this model's tokenizer ({exc})"
                        ) from exc
        return self._lltok

    # -- grammar sources ---------------------------------------------------------------------
    @staticmethod
    def json_schema_grammar(schema: dict | bool, param: str = "response_format") -> str:
        import llguidance

        try:  # a bare true/false is a schema too: llguidance takes it as JSON text
            source: str | dict[str, Any] = (
                schema if isinstance(schema, dict) else json.dumps(schema)
            )
            return llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidRequest(f"invalid JSON schema: {exc}", param=param) from exc

    def from_constraint(self, c: OutputConstraint) -> str:
        import llguidance

        if c.kind == "json_object":
            return self.json_schema_grammar({"type": "object"})
        if c.kind == "json_schema":
            try:
                schema = json.loads(c.spec)
            except ValueError as exc:
                raise InvalidRequest(
                    f"the JSON schema is not valid JSON: {exc}", param="response_format"
                ) from exc
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
        """Raise a 400 (InvalidRequest) for an unsupported grammar or schema: validation
        with the tokenizer and a first mask (remembered per grammar)."""
        self._checked(grammar, param)

    def _checked(self, grammar: str, param: str) -> Any:
        """Validate ``grammar`` and compute its first mask, unless a recent request did
        (then no matcher is built here: None). The first mask catches a grammar llguidance
        accepts but cannot start (``{"$ref": "#"}``: no production ends), as a 400 before
        any output rather than an empty document that ends in "stop"."""
        import llguidance

        lltok = self.lltok
        with self._lock:
            err = self._valid.get(grammar)
        m = None
        if err is None:
            err = llguidance.LLMatcher.validate_grammar(grammar, lltok, limits=_limits())
            if not err or err.startswith("WARNING"):
                m = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=_limits())
                if not m.is_error():
                    m.compute_bitmask()  # no token consumed: the first step reuses its work
                err = first_line(m.get_error()) if m.is_error() else err
            with self._lock:
                self._valid[grammar] = err
                while len(self._valid) > 256:
                    self._valid.popitem(last=False)
        if err and not err.startswith("WARNING"):
            raise InvalidRequest(f"this schema or grammar is not supported: {err}", param=param)
        return m

    def matcher(self, grammar: str, param: str = "response_format") -> Any:
        """A fresh matcher for ``grammar``; an unsupported grammar or schema is a 400."""
        import llguidance

        m = self._checked(grammar, param)
        if m is None:
            m = llguidance.LLMatcher(self.lltok, grammar, log_level=0, limits=_limits())
        if m.is_error():
            raise InvalidRequest(
                f"this schema or grammar is not supported: {first_line(m.get_error())}", param=param
            )
        return m


# -- tool calls as grammars ---------------------------------------------------------------------


def _call_schema(tools: list[dict], names: Sequence[str]) -> dict:
    variants = []
    for t in tools:
        fn = t.get("function", t)
        if fn.get("name") not in names:
            continue
        params = fn.get("parameters") or {"type": "object"}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def tool_call_grammar(
    compiler: GrammarCompiler,
    fmt: Any,
    tools: list[dict],
    names: Sequence[str],
    parallel: bool,
    answer: str | None = None,
) -> str:
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
        body = (
            f'call_body: %json {{ "x-guidance": {json.dumps(TOOL_JSON_OPTIONS)}, '
            f'"anyOf": [{schema}] }}\n'
        )
    elif fmt.name == "qwen3_coder":
        alts = " | ".join(json.dumps(n) for n in names)
        call = f'{start} "\\n<function=" ({alts}) ">" REST'
        body = "REST: /(.|\\n)*/\n"
        parallel = False
    else:
        call = f"{start} REST"
        body = "REST: /(.|\\n)*/\n"
        parallel = False
    calls = 'tool_call ("\\n" tool_call)*' if parallel else "tool_call"
    lark = (
        f"start: {calls}\n"
        if answer is None
        else f"start: answer | calls\ncalls: {calls}\nanswer: {answer}\n"
    )
    lark += f"tool_call: {call}\n{body}"
    return llguidance.LLMatcher.grammar_from_lark(lark)
