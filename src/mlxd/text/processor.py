"""A chat/text model's tokenizer side: templating, tokenizing, grammars, output parsing.

No MLX here. Front ends hold one :class:`TextProcessor` per model to template and tokenize
prompts, say what a request's grammar is made of (:class:`~mlxd.core.types.GrammarSpec`)
and parse the output; the engine core holds one too (warm-up, token counts, rerank
prompts) and compiles grammars (:meth:`TextProcessor.matcher`), so front ends never load
llguidance. Loading one reads only the tokenizer files, never the weights.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.core.errors import InvalidRequest, ModelLoadError
from mlxd.core.render import check_template_kwargs
from mlxd.core.types import GenerateRequest, GrammarSpec, ThinkSpec
from mlxd.text.structured import JSON_OPTIONS, GrammarCompiler, tool_call_grammar
from mlxd.text.tool_calls import (
    OutputSplitter,
    ToolFormat,
    fallback_messages,
    template_messages,
    tool_format,
)


@dataclass
class SeqPlan:
    """What :meth:`TextProcessor.prepare` worked out for one request."""

    splitter: OutputSplitter | None = None  # answer / reasoning / tool calls (front end)
    grammar: GrammarSpec | None = None  # compiled by the engine core (matcher)
    arm_after: tuple[int, ...] | None = None  # grammar waits for these tokens (think end)
    think: ThinkSpec | None = None  # a thinking model's markers and the reasoning budget


def load_tokenizer(
    path: Path, *, trust_remote_code: bool = False, defaults: dict[str, Any] | None = None
) -> Any:
    """mlx-lm's tokenizer wrapper for a model directory, as ``mlx_lm.load`` builds it, less
    the Python copies of the vocabulary that nothing reads (see the two helpers).

    ``defaults`` are the model family's tokenizer settings for checkpoints that lack them
    (mlx-lm keeps them as ``TOKENIZER_DEFAULTS`` in the family's model module). mlx-lm's
    own ``load_tokenizer`` imports that module, and with it MLX; a front end never imports
    MLX, so the engine core, which has the module loaded, sends them
    (:func:`tokenizer_defaults`, in the model's info).
    """
    from mlx_lm.tokenizer_utils import load as _load

    from mlxd.text.detokenizer import use_lazy_detokenizer

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    eos = config.get("eos_token_id")
    if eos is None:
        eos = (config.get("text_config") or {}).get("eos_token_id")
    try:
        tok = _load(
            Path(path),
            {"trust_remote_code": trust_remote_code},
            eos_token_ids=eos,
            defaults=defaults,
        )
    except Exception as exc:  # noqa: BLE001 - ValueError, OSError, KeyError from transformers
        raise ModelLoadError(f"could not load the tokenizer of {path}: {exc}") from exc
    _drop_build_inputs(getattr(tok, "_tokenizer", tok))
    use_lazy_detokenizer(tok)  # the byte-level detokenizer's token table (text/detokenizer.py)
    return tok


def _render_arguments(tokenizer: Any) -> frozenset[str]:
    """The named arguments of this tokenizer's ``apply_chat_template`` (a newer transformers
    may add some): no request's template variable may take one of their names."""
    import inspect

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        params = inspect.signature(type(hf).apply_chat_template).parameters
    except (AttributeError, TypeError, ValueError):
        return frozenset()
    return frozenset(
        n
        for n, p in params.items()
        if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    )


def tokenizer_defaults(model: Any) -> dict[str, Any] | None:
    """The tokenizer settings mlx-lm keeps in a loaded model's family module
    (``TOKENIZER_DEFAULTS``: chat template, tool parser, EOS ids), if it has any."""
    module = sys.modules.get(type(model).__module__) if model is not None else None
    found = getattr(module, "TOKENIZER_DEFAULTS", None)
    return dict(found) if isinstance(found, dict) else None


def _drop_build_inputs(hf: Any) -> None:
    """Free the Python copy of the vocabulary a family's tokenizer class was built from.

    transformers' per-family classes (Qwen2Tokenizer, LlamaTokenizer, ...) parse
    ``tokenizer.json`` into a Python dict and list, build the Rust tokenizer from them, and
    keep both as ``_vocab`` and ``_merges``; only ``save_pretrained`` of a few families
    reads them again, which mlxd never calls on a loaded tokenizer. For a 150k-token
    vocabulary with its merges that is 15-40 MB in every front end and engine core
    (measured RSS). Everything else reads the Rust tokenizer, which stays.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError:  # a slow (pure Python) tokenizer keeps what it encodes with
        return
    if not isinstance(getattr(hf, "_tokenizer", None), Tokenizer):
        return
    for attr in ("_vocab", "_merges"):
        if isinstance(hf.__dict__.get(attr), (dict, list)):
            del hf.__dict__[attr]


class TextProcessor:
    """Thread-safe helpers over one model's tokenizer."""

    def __init__(
        self, name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int] | None = None
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(
            eos_token_ids
            if eos_token_ids is not None
            else getattr(tokenizer, "eos_token_ids", []) or []
        )
        self.grammar = GrammarCompiler(tokenizer, vocab_size, self.eos_token_ids)
        self.tool_format: ToolFormat = tool_format(tokenizer)
        self._render_arguments = _render_arguments(tokenizer)

    @property
    def detokenizer(self) -> Any:
        """A fresh streaming detokenizer (one per sequence)."""
        return self.tokenizer.detokenizer

    def encode_messages(self, messages: list[dict], **template_kwargs: Any) -> list[int]:
        if not getattr(self.tokenizer, "has_chat_template", False):
            raise InvalidRequest(
                f"model '{self.name}' has no chat template; use /v1/completions", param="model"
            )
        variables = {k: v for k, v in template_kwargs.items() if k != "tools"}
        check_template_kwargs(variables, reserved=self._render_arguments)
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **template_kwargs
            )
        except Exception as exc:  # noqa: BLE001 - jinja2 TemplateError, KeyError on odd messages
            raise InvalidRequest(f"chat template failed: {exc}", param="messages") from exc
        if isinstance(ids, dict):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def encode_request(self, req: GenerateRequest) -> list[int]:
        """A chat request's prompt: its messages, tools and template variables, templated.

        A template that does not render tools gets them (and earlier calls and results) in
        the fallback syntax of text/tool_calls.py.
        """
        messages = req.messages or []
        kwargs = dict(req.template_kwargs or {})
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        if not self.tool_format.native and (
            tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
        ):
            messages = fallback_messages(messages, tools)
        elif tools:
            kwargs["tools"] = tools
        return self.encode_messages(template_messages(messages), **kwargs)

    def encode_prompt(self, prompt: str) -> list[int]:
        ids = self.tokenizer.encode(prompt)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        # Some tokenizers add BOS twice when the prompt already carries it as text.
        if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def tokenize(self, req: GenerateRequest) -> list[int]:
        """The prompt's token ids: given ids (checked), templated messages, or raw text."""
        if req.prompt_tokens is not None:
            tokens = list(req.prompt_tokens)
            bad = [t for t in tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(f"token ids out of range: {bad[:5]}", param="prompt")
        elif req.messages is not None:
            tokens = self.encode_request(req)
        else:
            tokens = self.encode_prompt(req.prompt or "")
        if not tokens:
            raise InvalidRequest("the prompt is empty", param="prompt")
        return tokens

    def prepare(self, req: GenerateRequest, tokens: list[int]) -> SeqPlan | None:
        """Output parsing and what the grammar is made of, for one request (the 400s a
        front end can tell without llguidance come from here; the grammar's own from
        :meth:`matcher` in the engine core)."""
        tok = self.tokenizer
        chat = req.messages is not None
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        fmt = self.tool_format if tools else None
        think = (tok.think_start, tok.think_end) if chat and tok.has_thinking else None
        reasoning = think is not None and tok.rfind_think_start(tokens) > tok.rfind_think_end(
            tokens
        )
        splitter = None
        if think is not None or fmt is not None:
            splitter = OutputSplitter(
                think=think,
                reasoning=reasoning,
                fmt=fmt,
                tools=tools,
                parallel=req.parallel_tool_calls,
            )
        names = [t.get("function", t).get("name") for t in tools or []]
        spec = None
        if fmt is not None and req.tool_choice in ("required", "function"):
            if req.tool_choice == "function":
                if req.tool_name not in names:
                    raise InvalidRequest(
                        f"tool_choice names '{req.tool_name}', which is not among the tools",
                        param="tool_choice",
                    )
                names = [req.tool_name]
            spec = GrammarSpec(
                tools=tools,
                names=names,
                tool_call=True,
                parallel=req.parallel_tool_calls and req.tool_choice == "required",
            )
        elif req.constraint is not None:
            # tool_choice "auto" with a JSON answer: the answer follows the schema, or the
            # model calls tools
            either = (
                fmt is not None
                and fmt.json_body
                and req.constraint.kind in ("json_object", "json_schema")
            )
            spec = GrammarSpec(
                constraint=req.constraint,
                tools=tools if either else None,
                names=names if either else [],
                parallel=req.parallel_tool_calls,
            )
        arm = tuple(tok.think_end_tokens) if spec is not None and reasoning else None
        thinks = None
        if think is not None:
            thinks = ThinkSpec(
                start=list(tok.think_start_tokens),
                end=list(tok.think_end_tokens),
                open=reasoning,
                budget=req.thinking_budget,
            )
        if splitter is None and spec is None:
            return None
        return SeqPlan(splitter=splitter, grammar=spec, arm_after=arm, think=thinks)

    def matcher(self, spec: GrammarSpec) -> Any:
        """The engine core's side of :meth:`prepare`: the request's grammar compiled into a
        fresh llguidance matcher; an unsupported schema or grammar is a 400."""
        fmt = self.tool_format
        if spec.tool_call:
            if fmt.json_body:  # each tool's arguments schema must be servable on its own
                for t in spec.tools or []:
                    fn = t.get("function", t)
                    if fn.get("name") in spec.names:
                        self.grammar.check(
                            self.grammar.json_schema_grammar(
                                fn.get("parameters") or {"type": "object"}, "tools"
                            ),
                            "tools",
                        )
            grammar = tool_call_grammar(
                self.grammar, fmt, spec.tools or [], spec.names, spec.parallel
            )
            return self.grammar.matcher(grammar, "tool_choice")
        c = spec.constraint
        if c is None:
            raise InvalidRequest(
                "a grammar needs a constraint or a tool call", param="response_format"
            )
        grammar = self.grammar.from_constraint(c)
        if spec.tools is not None:
            schema = json.loads(c.spec) if c.kind == "json_schema" else {"type": "object"}
            if isinstance(schema, dict):
                self.grammar.check(grammar)  # the schema alone must be supported
                answer = "%json " + json.dumps({"x-guidance": JSON_OPTIONS, **schema})
                grammar = tool_call_grammar(
                    self.grammar, fmt, spec.tools, spec.names, spec.parallel, answer=answer
                )
        return self.grammar.matcher(grammar)
