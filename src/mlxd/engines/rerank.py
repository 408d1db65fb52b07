"""Rerankers: cross-encoders and LLM rerankers, both with dynamic batching.

* :class:`CrossEncoderEngine`: BERT / XLM-RoBERTa ``*ForSequenceClassification``
  checkpoints (ms-marco MiniLM, bge-reranker...). The query and the document are one
  sentence pair; the score is ``sigmoid(logit)`` for a single-label head (what
  sentence-transformers' CrossEncoder and TEI return), the last label's softmax otherwise.
* :class:`LLMRerankEngine`: a causal LM scored the Qwen3-Reranker way: the score is
  ``softmax([no, yes])[yes]`` over the logits of the token that would come next after a
  prompt asking whether the document meets the query. A dedicated checkpoint (kind
  reranker, e.g. Qwen3-Reranker) gets Qwen3-Reranker's exact prompt and its "yes"/"no"
  tokens. A chat model gets Qwen3-Reranker's system prompt in its own chat template, the
  query and document in plain words ("Query: ...\nDocument: ...\nIs the document relevant
  to the query? Answer with yes or no."; the <Instruct>/<Query>/<Document> tags confuse
  models not trained on them: SmolLM2-135M put the relevant document first in 0-1 of 6
  easy cases with them, 6 of 6 without),
  and its "yes"/"no" spellings (yes, Yes, " yes"...) pooled. A chat model's scorer borrows
  the loaded chat engine's weights (see :meth:`LLMRerankEngine.sharing`): nothing is
  loaded twice.

Prompts are right-padded: a causal model's real tokens never attend to the padding after
them, so each row's last real token sees exactly its own prompt.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.core.errors import InvalidRequest, ModelLoadError
from mlxd.engines import bert
from mlxd.engines.batching import BatchPolicy, EncodeItem
from mlxd.engines.embed import encoder_dtype
from mlxd.engines.encoder import BatchingEncoder, TextTokenizer, read_json, too_long

log = logging.getLogger(__name__)


class CrossEncoderEngine(BatchingEncoder):
    kind = "reranker"

    def __init__(self, name: str, path: Path, policy: BatchPolicy, *, dtype: str = "auto") -> None:
        super().__init__(name, policy)
        self.path = Path(path)
        cfg = read_json(self.path / "config.json")
        self.config = cfg
        try:
            self.model = bert.load_encoder(
                self.path, cfg, with_head=True, dtype=encoder_dtype(dtype)
            )
        except Exception as exc:  # noqa: BLE001 - one clear load error
            raise ModelLoadError(f"could not load reranker '{name}' from {path}: {exc}") from exc
        limit = self.model.config.max_tokens
        tok_max = read_json(self.path / "tokenizer_config.json").get("model_max_length")
        if isinstance(tok_max, int) and 0 < tok_max < limit:
            limit = tok_max
        self.context_length = limit
        self.tokenizer = TextTokenizer(self.path, limit)
        self.vocab_size = int(cfg.get("vocab_size") or self.tokenizer.vocab_size)
        self.num_labels = self.model.config.num_labels
        self.pad_id = self.model.config.pad_token_id
        from mlx.utils import tree_flatten

        self.nbytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    def encode_pairs(
        self, query: str, documents: list[str], *, truncate: bool, instruction: str | None = None
    ) -> list[tuple[list[int], list[int]]]:
        return self.tokenizer.encode_pairs(query, documents, truncate=truncate)

    def _forward(self, items: list[EncodeItem]) -> list[Any]:
        B, L = len(items), max(it.n for it in items)
        ids = np.full((B, L), self.pad_id, dtype=np.int32)
        mask = np.zeros((B, L), dtype=np.int32)
        types = np.zeros((B, L), dtype=np.int32)
        for r, it in enumerate(items):
            ids[r, : it.n] = it.ids
            mask[r, : it.n] = 1
            if it.types:
                types[r, : it.n] = it.types
        logits = self.model.classify(mx.array(ids), mx.array(mask), mx.array(types))
        logits = logits.astype(mx.float32)
        if self.num_labels == 1:
            scores = mx.sigmoid(logits[:, 0])
        else:
            scores = mx.softmax(logits, axis=-1)[:, -1]
        return [float(s) for s in np.array(scores)]

    def warmup(self) -> None:
        from mlxd.engines.batching import EncodeJob

        job = EncodeJob([EncodeItem(0, [self.pad_id + 1] * 4, [0] * 4)])
        self._forward(job.items)

    def close(self) -> None:
        super().close()
        self.model = None
        mx.clear_cache()


# -- LLM rerankers ------------------------------------------------------------------------------

QWEN3_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".'
)
QWEN3_PREFIX = f"<|im_start|>system\n{QWEN3_SYSTEM}<|im_end|>\n<|im_start|>user\n"
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
CHAT_QUESTION = "Is the document relevant to the query? Answer with yes or no."
_SENTINEL = "\ue000"  # stands for the document while the template renders
# mlx-lm architectures whose Model is ``model`` (body) + ``lm_head`` or tied embeddings and
# nothing else: the scorer runs the body and projects only each row's last position.
_FULL_LOGITS_TOKENS = 512  # other architectures: positions per full forward
_PLAIN_HEAD_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "olmo2", "smollm3"})


class _Holder:
    """A loaded causal LM that no chat engine owns (a dedicated reranker checkpoint)."""

    def __init__(self, model: Any, tokenizer: Any, context_length: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.context_length = context_length


class LLMRerankEngine(BatchingEncoder):
    kind = "reranker"

    def __init__(
        self, name: str, source: Any, policy: BatchPolicy, *, qwen3_format: bool, shared: bool
    ) -> None:
        super().__init__(name, policy)
        self._src = source  # .model, .tokenizer, .context_length (an LLMEngine or _Holder)
        self.shared = shared
        self.qwen3_format = qwen3_format
        self.context_length = int(source.context_length)
        tok = source.tokenizer
        self._hf = getattr(tok, "_tokenizer", tok)  # the transformers tokenizer
        if qwen3_format:
            yes = [self._hf.convert_tokens_to_ids("yes")]
            no = [self._hf.convert_tokens_to_ids("no")]
        else:
            yes, no = (
                self._single_tokens(("yes", "Yes", " yes", " Yes", "YES")),
                self._single_tokens(("no", "No", " no", " No", "NO")),
            )
        if not yes or not no or any(i is None for i in yes + no):
            raise ModelLoadError(
                f"'{name}' has no single-token 'yes'/'no': it cannot be used as an LLM reranker"
            )
        self.yes_ids, self.no_ids = sorted(set(yes)), sorted(set(no))
        self.pad_id = 0
        model = source.model
        self._plain_head = getattr(model, "model_type", None) in _PLAIN_HEAD_TYPES and hasattr(
            model, "model"
        )
        self.vocab_size = len(self._hf)
        self.nbytes = 0 if shared else _nbytes(model)

    @property
    def tokenizer(self) -> Any:
        return self._src.tokenizer

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def sharing(cls, llm: Any, policy: BatchPolicy) -> LLMRerankEngine:
        """A scorer on a loaded chat engine's weights (it holds the engine, not a copy)."""
        return cls(llm.name, llm, policy, qwen3_format=False, shared=True)

    @classmethod
    def load(
        cls,
        name: str,
        path: Path,
        policy: BatchPolicy,
        *,
        dtype: str = "auto",
        trust_remote_code: bool = False,
    ) -> LLMRerankEngine:
        """A dedicated reranker checkpoint (Qwen3-Reranker and alike) with its own weights."""
        from mlx_lm.utils import load as mlx_lm_load

        try:
            model, tokenizer, config = mlx_lm_load(
                str(path),
                return_config=True,
                trust_remote_code=trust_remote_code,
                tokenizer_config={"trust_remote_code": trust_remote_code},
            )
        except Exception as exc:  # noqa: BLE001 - one clear load error
            raise ModelLoadError(f"could not load reranker '{name}' from {path}: {exc}") from exc
        dt = encoder_dtype(dtype)
        if dt is not None and "quantization" not in config:
            model.apply(lambda x: x.astype(dt) if mx.issubdtype(x.dtype, mx.floating) else x)
        mx.eval(model.parameters())
        ctx = int(config.get("max_position_embeddings") or 8192)
        return cls(name, _Holder(model, tokenizer, ctx), policy, qwen3_format=True, shared=False)

    def _single_tokens(self, spellings: tuple[str, ...]) -> list[int]:
        out = []
        for s in spellings:
            ids = self._hf.encode(s, add_special_tokens=False)
            if len(ids) == 1:
                out.append(int(ids[0]))
        return out

    # -- prompts (any thread) --------------------------------------------------------------
    def _frame(self, query: str, instruction: str | None) -> tuple[str, str]:
        """The prompt text before and after the document."""
        if self.qwen3_format or not getattr(self._hf, "chat_template", None):
            body = (
                f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n"
                f"<Document>: {_SENTINEL}"
            )
            text = QWEN3_PREFIX + body + QWEN3_SUFFIX
        else:
            # A general chat model is not trained on the <Instruct>/<Query>/<Document> tags;
            # the same judgement asked in plain words ranks far better (docs/benchmarks.md).
            body = (
                f"Instruct: {instruction}\n" if instruction else ""
            ) + f"Query: {query}\nDocument: {_SENTINEL}\n{CHAT_QUESTION}"
            text = self._render(
                [{"role": "system", "content": QWEN3_SYSTEM}, {"role": "user", "content": body}]
            )
        pre, sep, post = text.partition(_SENTINEL)
        if not sep:
            raise InvalidRequest("the model's chat template dropped the document", param="model")
        return pre, post

    def _render(self, messages: list[dict]) -> str:
        kw = {"add_generation_prompt": True, "tokenize": False, "enable_thinking": False}
        try:
            return self._hf.apply_chat_template(messages, **kw)
        except Exception:  # noqa: BLE001 - templates without a system role
            merged = [
                {
                    "role": "user",
                    "content": messages[0]["content"] + "\n\n" + messages[1]["content"],
                }
            ]
            try:
                return self._hf.apply_chat_template(merged, **kw)
            except Exception as exc:  # noqa: BLE001
                raise InvalidRequest(f"chat template failed: {exc}", param="model") from exc

    def encode_pairs(
        self, query: str, documents: list[str], *, truncate: bool, instruction: str | None = None
    ) -> list[tuple[list[int], None]]:
        pre, post = self._frame(query, instruction)
        enc = self._hf([pre + d + post for d in documents], add_special_tokens=False)["input_ids"]
        limit = self.context_length
        out: list[tuple[list[int], None]] = []
        fixed: tuple[list[int], list[int]] | None = None
        for i, ids in enumerate(enc):
            if len(ids) > limit:
                if not truncate:
                    raise too_long(
                        i,
                        len(ids),
                        limit,
                        "documents",
                        len(documents) > 1,
                        what="prompt (query and document)",
                    )
                if fixed is None:
                    fixed = (
                        self._hf.encode(pre, add_special_tokens=False),
                        self._hf.encode(post, add_special_tokens=False),
                    )
                room = limit - len(fixed[0]) - len(fixed[1])
                if room < 1:
                    raise InvalidRequest(
                        f"the query alone fills this model's {limit}-token context", param="query"
                    )
                doc = self._hf.encode(documents[i], add_special_tokens=False)[:room]
                ids = fixed[0] + doc + fixed[1]
            out.append((list(ids), None))
        return out

    # -- the forward pass (worker thread) ----------------------------------------------------
    def _forward(self, items: list[EncodeItem]) -> list[Any]:
        model = self._src.model
        if model is None:
            raise RuntimeError(f"model '{self.name}' was unloaded")
        B, L = len(items), max(it.n for it in items)
        ids = np.full((B, L), self.pad_id, dtype=np.int32)
        for r, it in enumerate(items):
            ids[r, : it.n] = it.ids
        last = mx.array(np.array([it.n - 1 for it in items], dtype=np.int32))[:, None, None]
        x = mx.array(ids)
        if self._plain_head:
            h = model.model(x)
            h = mx.take_along_axis(h, last, axis=1)  # (B, 1, H)
            if hasattr(model, "lm_head"):
                logits = model.lm_head(h)
            else:
                logits = model.model.embed_tokens.as_linear(h)
        else:  # the full model (its own head, softcapping...): logits at every position,
            # so a few rows at a time to bound the (rows, length, vocab) array
            rows = max(1, _FULL_LOGITS_TOKENS // L)
            parts = []
            for i in range(0, B, rows):
                parts.append(mx.take_along_axis(model(x[i : i + rows]), last[i : i + rows], axis=1))
                mx.eval(parts[-1])
            logits = mx.concatenate(parts)
        logits = logits[:, 0, :].astype(mx.float32)
        yes = mx.logsumexp(logits[:, self.yes_ids], axis=-1)
        no = mx.logsumexp(logits[:, self.no_ids], axis=-1)
        return [float(s) for s in np.array(mx.sigmoid(yes - no))]

    def warmup(self) -> None:
        from mlxd.engines.batching import EncodeJob

        enc = self.encode_pairs("warm up", ["a document"], truncate=True)
        job = EncodeJob([EncodeItem(0, enc[0][0])])
        self._forward(job.items)

    def close(self) -> None:
        super().close()
        if not self.shared:
            self._src.model = None
        self._src = _Holder(None, self._src.tokenizer, self.context_length)
        mx.clear_cache()


def _nbytes(model: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def is_causal_lm(cfg: dict) -> bool:
    archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) or (
        str(cfg.get("model_type") or "") not in bert.SUPPORTED_TYPES
        and not any(a.endswith("ForSequenceClassification") for a in archs)
    )
