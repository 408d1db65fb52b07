"""Embedding models: BERT-family encoders and decoder embedders (Qwen3-Embedding style).

What the vector is comes from the model's own sentence-transformers files when present:
``modules.json`` (Pooling, optional Dense, Normalize), ``1_Pooling/config.json`` (cls /
mean / max / mean_sqrt_len / lasttoken) and ``sentence_bert_config.json``
(``max_seq_length``). Without them: mean pooling for encoders, last-token pooling for
decoders, and L2 normalisation.

Encoders (bert, roberta, xlm-roberta, camembert) run on :mod:`mlxd.engines.bert`; any
other architecture mlx-lm knows (qwen3, qwen2, llama, gemma3...) runs as a decoder:
mlx-lm's model body without its LM head, right-padded (causal attention means real
tokens never see the padding, so no mask is needed and results equal unbatched ones).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxd.core.errors import ModelLoadError
from mlxd.engines import bert
from mlxd.engines.backend import wants_float32
from mlxd.engines.batching import BatchPolicy, EncodeItem
from mlxd.engines.encoder import BatchingEncoder, TextTokenizer, read_json, too_long

log = logging.getLogger(__name__)

_POOL_KEYS = (  # sentence-transformers' order when several modes are on
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
    ("pooling_mode_weightedmean_tokens", "weightedmean"),
    ("pooling_mode_lasttoken", "lasttoken"),
)


@dataclass
class SentenceTransformerConfig:
    pooling: tuple[str, ...]
    normalize: bool
    max_seq_length: int | None
    dense: list[tuple[Path, dict]]  # (module dir, config) of Dense layers, in order


def read_sentence_transformers(path: Path, *, decoder: bool) -> SentenceTransformerConfig:
    path = Path(path)
    try:
        raw = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError):
        raw = None
    modules = [m for m in raw if isinstance(m, dict)] if isinstance(raw, list) else []
    pooling: tuple[str, ...] = ()
    dense: list[tuple[Path, dict]] = []
    normalize = False
    for m in modules:
        kind = str(m.get("type") or "").rsplit(".", 1)[-1]
        sub = path / str(m.get("path") or "")
        if kind == "Pooling":
            cfg = read_json(sub / "config.json")
            if isinstance(cfg.get("pooling_mode"), str):  # newer single-key form
                pooling = (cfg["pooling_mode"].replace("_tokens", "").replace("_token", ""),)
            else:
                pooling = tuple(mode for key, mode in _POOL_KEYS if cfg.get(key))
        elif kind == "Dense":
            dense.append((sub, read_json(sub / "config.json")))
        elif kind == "Normalize":
            normalize = True
    st = read_json(path / "sentence_bert_config.json")
    msl = st.get("max_seq_length")
    if not modules:
        pooling, normalize = (("lasttoken",) if decoder else ("mean",)), True
    elif not pooling:
        pooling = ("lasttoken",) if decoder else ("mean",)
    bad = [p for p in pooling if p not in ("cls", "max", "mean", "mean_sqrt_len", "lasttoken")]
    if bad:
        raise ModelLoadError(f"pooling mode {bad[0]!r} is not supported")
    return SentenceTransformerConfig(
        pooling, normalize, msl if isinstance(msl, int) else None, dense
    )


def encoder_dtype(setting: str) -> Any:
    if setting == "float32" or (setting == "auto" and wants_float32()):
        return mx.float32
    if setting in ("float16", "bfloat16"):
        return getattr(mx, setting)
    return None


class _DenseModule(nn.Module):
    """sentence-transformers' Dense: linear + activation (Tanh or Identity)."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.linear = nn.Linear(
            int(cfg["in_features"]), int(cfg["out_features"]), bias=bool(cfg.get("bias", True))
        )
        act = str(cfg.get("activation_function") or "Identity").rsplit(".", 1)[-1]
        if act not in ("Tanh", "Identity"):
            raise ModelLoadError(f"Dense activation {act!r} is not supported")
        self._tanh = act == "Tanh"

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        return mx.tanh(y) if self._tanh else y


def load_decoder(path: Path, dtype: Any) -> nn.Module:
    """mlx-lm's architecture for ``path`` without the LM head (embedders ship the bare
    body, often without the ``model.`` prefix)."""
    from mlx_lm.utils import _get_classes, load_model

    def classes(config: dict):
        model_cls, args_cls = _get_classes(config)

        class Body(model_cls):  # type: ignore[misc, valid-type]
            def __init__(self, args: Any) -> None:
                super().__init__(args)
                if "lm_head" in self:
                    self.pop("lm_head")

            def sanitize(self, weights: dict) -> dict:
                if weights and not any(k.startswith("model.") for k in weights):
                    weights = {"model." + k: v for k, v in weights.items()}
                weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
                return super().sanitize(weights) if hasattr(model_cls, "sanitize") else weights

        return Body, args_cls

    model, config = load_model(Path(path), get_model_classes=classes)
    if not hasattr(model, "model"):
        raise ModelLoadError(f"{config.get('model_type')}: no transformer body to embed with")
    if dtype is not None and "quantization" not in config:
        model.apply(lambda x: x.astype(dtype) if mx.issubdtype(x.dtype, mx.floating) else x)
    mx.eval(model.parameters())
    return model


class EmbeddingEngine(BatchingEncoder):
    """One loaded embedding model and its dynamic batch."""

    kind = "embedding"

    def __init__(self, name: str, path: Path, policy: BatchPolicy, *, dtype: str = "auto") -> None:
        super().__init__(name, policy)
        self.path = Path(path)
        cfg = read_json(self.path / "config.json")
        if not cfg:
            raise ModelLoadError(f"{path}: no config.json")
        self.config = cfg
        mt = str(cfg.get("model_type") or "")
        self.decoder = mt not in bert.SUPPORTED_TYPES
        st = read_sentence_transformers(self.path, decoder=self.decoder)
        self.st = st
        dt = encoder_dtype(dtype)
        try:
            if self.decoder:
                self.model = load_decoder(self.path, dt)
                limit = int(cfg.get("max_position_embeddings") or 32768)
                hidden = int(cfg.get("hidden_size") or 0)
            else:
                self.model = bert.load_encoder(self.path, cfg, with_head=False, dtype=dt)
                limit = self.model.config.max_tokens
                hidden = self.model.config.hidden_size
            self.dense = []
            for sub, dcfg in st.dense:
                d = _DenseModule(dcfg)
                files = sorted(sub.glob("*.safetensors"))
                if not files:
                    raise ModelLoadError(f"{sub}: Dense weights must be safetensors")
                w = {}
                for f in files:
                    w.update(mx.load(str(f)))
                if dt is not None:
                    w = {k: v.astype(dt) for k, v in w.items()}
                d.load_weights(list(w.items()), strict=True)
                self.dense.append(d)
                hidden = d.linear.weight.shape[0]
        except ModelLoadError:
            raise
        except Exception as exc:  # noqa: BLE001 - one clear load error
            raise ModelLoadError(
                f"could not load embedding model '{name}' from {path}: {exc}"
            ) from exc
        if st.max_seq_length:
            limit = min(limit, st.max_seq_length)
        self.context_length = limit
        self.dimensions = hidden * len(st.pooling) if not st.dense else hidden
        self.tokenizer = TextTokenizer(self.path, limit)
        self.vocab_size = int(cfg.get("vocab_size") or self.tokenizer.vocab_size)
        self.pad_id = int(cfg.get("pad_token_id") or 0) if not self.decoder else 0
        params = [self.model.parameters()] + [d.parameters() for d in self.dense]
        from mlx.utils import tree_flatten

        self.nbytes = sum(v.nbytes for p in params for _, v in tree_flatten(p))
        if self.decoder:
            self.policy.pass_overhead_tokens = 16

    # -- thread-safe tokenizer helpers -------------------------------------------------
    def encode_inputs(
        self, inputs: list[str | list[int]], *, truncate: bool
    ) -> list[tuple[list[int], None]]:
        texts = [(i, x) for i, x in enumerate(inputs) if isinstance(x, str)]
        out: list[Any] = [None] * len(inputs)
        if texts:
            ids = self.tokenizer.encode(
                [t for _, t in texts],
                truncate=truncate,
                positions=[i for i, _ in texts],
                many=len(inputs) > 1,
            )
            for (i, _), x in zip(texts, ids, strict=True):
                out[i] = (x, None)
        for i, x in enumerate(inputs):
            if not isinstance(x, str):
                toks = list(x)
                if len(toks) > self.context_length:
                    if not truncate:
                        raise too_long(i, len(toks), self.context_length, "input", len(inputs) > 1)
                    toks = toks[: self.context_length]
                out[i] = (toks, None)
        return out

    # -- the forward pass (worker thread) ----------------------------------------------
    def _forward(self, items: list[EncodeItem]) -> list[Any]:
        B, L = len(items), max(it.n for it in items)
        ids = np.full((B, L), self.pad_id, dtype=np.int32)
        mask = np.zeros((B, L), dtype=np.int32)
        for r, it in enumerate(items):
            ids[r, : it.n] = it.ids
            mask[r, : it.n] = 1
        lengths = mx.array(mask.sum(axis=1))
        ids_m, mask_m = mx.array(ids), mx.array(mask)
        if self.decoder:
            h = self.model.model(ids_m)
        else:
            h = self.model.hidden(ids_m, mask_m)
        v = pool(h.astype(mx.float32), mask_m, lengths, self.st.pooling)
        for d in self.dense:
            v = d(v.astype(d.linear.weight.dtype)).astype(mx.float32)
        if self.st.normalize:
            v = v / mx.maximum(mx.linalg.norm(v, axis=-1, keepdims=True), 1e-12)
        out = np.array(v, dtype=np.float32)
        return list(out)

    def embed_batch(self, encoded: list[list[int]]) -> np.ndarray:
        """Offline: embed token-id lists in passes as the server would (benchmarks, tests)."""
        from mlxd.engines.batching import EncodeJob, split_by_length

        job = EncodeJob([EncodeItem(i, ids) for i, ids in enumerate(encoded)])
        out: list[Any] = [None] * len(encoded)
        for p in split_by_length(
            job.items, self.policy.max_batch_tokens, self.policy.pass_overhead_tokens
        ):
            for it, v in zip(p, self._forward(p), strict=True):
                out[it.index] = v
        return np.stack(out)

    def warmup(self) -> None:
        for n in (1, 2):
            self.embed_batch([[self.pad_id + 1] * 4] * n)
        self.max_batch_seen = 0

    def close(self) -> None:
        super().close()
        self.model = None
        self.dense = []
        mx.clear_cache()


def pool(h: mx.array, mask: mx.array, lengths: mx.array, modes: tuple[str, ...]) -> mx.array:
    m = mask[..., None].astype(h.dtype)
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(h[:, 0])
        elif mode == "lasttoken":
            idx = (lengths - 1).astype(mx.int32)
            parts.append(mx.take_along_axis(h, idx[:, None, None], axis=1)[:, 0])
        elif mode == "max":
            parts.append(mx.max(mx.where(m > 0, h, mx.array(-1e9, h.dtype)), axis=1))
        else:
            s = mx.sum(h * m, axis=1)
            n = mx.maximum(mx.sum(m, axis=1), 1e-9)
            parts.append(s / (mx.sqrt(n) if mode == "mean_sqrt_len" else n))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
