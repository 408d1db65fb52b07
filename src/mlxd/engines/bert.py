"""BERT-family encoders in MLX: BERT, RoBERTa, XLM-RoBERTa (and CamemBERT), with heads.

Why our own ~200 lines rather than ``mlx-embeddings``: its 0.1.0 wheel imports ``mlx_vlm``
at package import (which pulls datasets, opencv, mlx-audio...), its BERT always mean-pools
and normalises (no CLS pooling from ``1_Pooling``), and it has no sequence-classification
heads, so cross-encoder rerankers could not load. The modules here keep Hugging Face's
attribute names, so a checkpoint's tensors load by name after stripping the task prefix
(``bert.``, ``roberta.``): ``BertModel``, ``BertForSequenceClassification`` (pooler +
``classifier``), ``XLMRobertaModel``/``RobertaModel`` and their
``*ForSequenceClassification`` (``classifier.dense`` + ``classifier.out_proj``).

Batches are right-padded; the padding is masked out of attention, and RoBERTa's position
ids count only real tokens, exactly as in transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

BERT_TYPES = frozenset({"bert"})
ROBERTA_TYPES = frozenset({"roberta", "xlm-roberta", "camembert"})
SUPPORTED_TYPES = BERT_TYPES | ROBERTA_TYPES

# erf as a rational function of x (Eigen's / XLA's float32 erf, max error ~5e-7): MLX's
# CPU erf/tanh/exp are scalar libm calls at ~25 ns per element and made GELU most of an
# encoder's time; multiply-adds vectorise and fuse under mx.compile (7x faster here).
_ERF_P = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
_ERF_Q = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)


def _erf(x: mx.array) -> mx.array:
    x = mx.clip(x, -4.0, 4.0)
    x2 = x * x
    p = x2 * _ERF_P[0] + _ERF_P[1]
    for a in _ERF_P[2:]:
        p = p * x2 + a
    q = x2 * _ERF_Q[0] + _ERF_Q[1]
    for b in _ERF_Q[2:]:
        q = q * x2 + b
    return x * p / q


@mx.compile
def gelu_erf(x: mx.array) -> mx.array:
    """Exact (erf) GELU to within ~1.5e-6 absolute."""
    return 0.5 * x * (1.0 + _erf(x * 0.7071067811865476).astype(x.dtype))


_ACTIVATIONS = {
    "gelu": gelu_erf,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_fast": nn.gelu_fast_approx,
    "relu": nn.relu,
    "silu": nn.silu,
    "swish": nn.silu,
    "tanh": mx.tanh,
}


@dataclass
class EncoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    hidden_act: str = "gelu"
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    num_labels: int = 0  # 0: no classification head

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], *, with_head: bool) -> EncoderConfig:
        mt = str(cfg.get("model_type") or "")
        if mt not in SUPPORTED_TYPES:
            raise ValueError(
                f"encoder model_type {mt!r} is not supported (supported: "
                f"{', '.join(sorted(SUPPORTED_TYPES))})"
            )
        pet = cfg.get("position_embedding_type") or "absolute"
        if pet != "absolute":
            raise ValueError(f"position_embedding_type {pet!r} is not supported")
        act = cfg.get("hidden_act") or "gelu"
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported")
        labels = cfg.get("id2label") or {}
        num_labels = int(cfg.get("num_labels") or len(labels) or 1) if with_head else 0
        return cls(
            model_type=mt,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            hidden_act=act,
            type_vocab_size=int(cfg.get("type_vocab_size") or 1),
            layer_norm_eps=float(cfg.get("layer_norm_eps") or 1e-12),
            pad_token_id=int(
                cfg.get("pad_token_id")
                if cfg.get("pad_token_id") is not None
                else (1 if mt in ROBERTA_TYPES else 0)
            ),
            num_labels=num_labels,
        )

    @property
    def is_roberta(self) -> bool:
        return self.model_type in ROBERTA_TYPES

    @property
    def max_tokens(self) -> int:
        """Longest input the position table allows (RoBERTa's starts after padding_idx)."""
        if self.is_roberta:
            return self.max_position_embeddings - self.pad_token_id - 1
        return self.max_position_embeddings


class Embeddings(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self._roberta = c.is_roberta
        self._pad = c.pad_token_id

    def __call__(self, ids: mx.array, mask: mx.array, types: mx.array | None) -> mx.array:
        L = ids.shape[1]
        if self._roberta:  # transformers: cumsum(mask) * mask + padding_idx
            m = mask.astype(mx.int32)
            pos = mx.cumsum(m, axis=1) * m + self._pad
        else:
            pos = mx.arange(L, dtype=mx.int32)[None]
        if types is None:
            types = mx.zeros_like(ids)
        h = (
            self.word_embeddings(ids)
            + self.position_embeddings(pos)
            + self.token_type_embeddings(types)
        )
        return self.LayerNorm(h)


class SelfAttention(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.heads = c.num_attention_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)
        self.scale = 1.0 / math.sqrt(c.hidden_size // c.num_attention_heads)

    def fuse(self) -> None:
        """One (3H x H) projection instead of three: one larger matmul is faster on CPU."""
        w = mx.concatenate([self.query.weight, self.key.weight, self.value.weight])
        b = mx.concatenate([self.query.bias, self.key.bias, self.value.bias])
        self.qkv = nn.Linear(w.shape[1], w.shape[0])
        self.qkv.weight, self.qkv.bias = w, b
        for k in ("query", "key", "value"):
            self.pop(k)

    def __call__(self, x: mx.array, bias: mx.array) -> mx.array:
        B, L, D = x.shape
        if "qkv" in self:
            qkv = self.qkv(x).reshape(B, L, 3, self.heads, -1).transpose(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
        else:
            q = self.query(x).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)
            k = self.key(x).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)
            v = self.value(x).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=bias)
        return o.transpose(0, 2, 1, 3).reshape(B, L, D)


class Dense(nn.Module):
    """``dense`` + ``LayerNorm`` over a residual: BERT's SelfOutput and Output."""

    def __init__(self, n_in: int, c: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(n_in, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.self = SelfAttention(c)
        self.output = Dense(c.hidden_size, c)

    def __call__(self, x: mx.array, bias: mx.array) -> mx.array:
        return self.output(self.self(x, bias), x)


class Intermediate(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        self._act = _ACTIVATIONS[c.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self._act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.attention = Attention(c)
        self.intermediate = Intermediate(c)
        self.output = Dense(c.intermediate_size, c)

    def __call__(self, x: mx.array, bias: mx.array) -> mx.array:
        a = self.attention(x, bias)
        return self.output(self.intermediate(a), a)


class Encoder(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.layer = [Layer(c) for _ in range(c.num_hidden_layers)]


class Pooler(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)

    def __call__(self, h: mx.array) -> mx.array:
        return mx.tanh(self.dense(h[:, 0]))


class RobertaHead(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.out_proj = nn.Linear(c.hidden_size, c.num_labels)

    def __call__(self, h: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(h[:, 0])))


class EncoderModel(nn.Module):
    """The bare encoder (last hidden states), plus a classification head when configured."""

    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.config = c
        self.embeddings = Embeddings(c)
        self.encoder = Encoder(c)
        if c.num_labels:
            if c.is_roberta:
                self.classifier = RobertaHead(c)
            else:
                self.pooler = Pooler(c)
                self.classifier = nn.Linear(c.hidden_size, c.num_labels)

    def hidden(self, ids: mx.array, mask: mx.array, types: mx.array | None = None) -> mx.array:
        h = self.embeddings(ids, mask, types)
        dtype = h.dtype
        # Additive attention bias over keys: 0 for tokens, a large negative for padding.
        bias = ((1 - mask.astype(dtype)) * mx.array(-1e9 if dtype == mx.float32 else -3e4, dtype))[
            :, None, None, :
        ]
        for layer in self.encoder.layer:
            h = layer(h, bias)
        return h

    def classify(self, ids: mx.array, mask: mx.array, types: mx.array | None = None) -> mx.array:
        h = self.hidden(ids, mask, types)
        if self.config.is_roberta:
            return self.classifier(h)
        return self.classifier(self.pooler(h))


_LEGACY = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}


def map_weights(weights: dict[str, mx.array], c: EncoderConfig) -> dict[str, mx.array]:
    """HF tensor names -> this module's: strip the task prefix, rename legacy LayerNorm
    names, drop what the model does not use (position_ids, the pooler of an embedder, MLM
    heads)."""
    prefixes = ("roberta.", "xlm-roberta.", "camembert.") if c.is_roberta else ("bert.",)
    out: dict[str, mx.array] = {}
    for key, v in weights.items():
        k = key
        for p in prefixes + ("model.",):
            if k.startswith(p):
                k = k[len(p) :]
                break
        for old, new in _LEGACY.items():
            if k.endswith(old):
                k = k[: -len(old)] + new
        if k.endswith("position_ids") or k.startswith(("lm_head.", "cls.")):
            continue
        if k.startswith("pooler.") and (not c.num_labels or c.is_roberta):
            continue
        if k.startswith("classifier.") and not c.num_labels:
            continue
        out[k] = v
    return out


def load_encoder(
    path: Path, cfg: dict[str, Any], *, with_head: bool, dtype: Any | None, fuse_qkv: bool = True
) -> EncoderModel:
    """Build the model for ``cfg`` and load ``path``'s safetensors into it (strictly)."""
    c = EncoderConfig.from_hf(cfg, with_head=with_head)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no .safetensors weights in {path} (pytorch_model.bin alone is not supported)"
        )
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    weights = map_weights(weights, c)
    if c.type_vocab_size == 1 and "embeddings.token_type_embeddings.weight" in weights:
        c.type_vocab_size = weights["embeddings.token_type_embeddings.weight"].shape[0]
    model = EncoderModel(c)
    if dtype is not None:
        weights = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
    model.load_weights(list(weights.items()), strict=True)
    if fuse_qkv:
        for layer in model.encoder.layer:
            layer.attention.self.fuse()
    model.eval()
    mx.eval(model.parameters())
    return model
