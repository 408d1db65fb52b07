"""The validation policy every request body shares, and the sampling parameters' ranges.

Every dialect's reference server is strict about JSON types (OpenAI and Anthropic answer
400 for ``"top_k": false``; Ollama is Go, whose decoder refuses a bool for an int, and the
embedding servers are Rust/serde), so the request models are strict too: no bool becomes 0
or 1 (``"prompt": [false]`` was token id 0, ``"keep_alive": false`` an unload), no string
becomes a number, no float is truncated to an int. A JSON integer still fills a float
field. ``allow_inf_nan=False`` refuses the ``NaN``/``Infinity`` literals Python's JSON
parser accepts and numbers that overflow to infinity (``1e400``):
nothing non-finite reaches a sampler. Every JSON integer, wherever it sits in a body (a
token id, ``top_k``, ``dimensions``, ``keep_alive``...), must fit in a signed 64-bit
integer: the engine core's wire (msgspec) cannot carry a bigger one, and the reference
servers refuse them too (Go's and serde's decoders); beyond, a 400 names the field (it was a
500 ``OverflowError`` from the front end's send, found by tests/ops/test_fuzz.py).

The ranges are the ones a value must keep for the engine to stay finite and the request to
mean something: outside them the request is a 400 that names the parameter, never an
engine failure that takes the batch's other sequences down with it.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from typing_extensions import TypeIs

from mlxd.core.types import PRIORITY_MAX, PRIORITY_MIN

# OpenAI documents ``seed`` as a (signed) 64-bit integer; MLX takes its uint64 image
# (engines/sampling.py), so every accepted seed is a valid PRNG key.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# repetition_penalty divides (or multiplies) the logits of tokens already seen: beyond
# these bounds float32 logits overflow to infinity and the distribution becomes NaN.
PENALTY_MIN, PENALTY_MAX = 0.01, 100.0


class WireModel(BaseModel):
    """Base of every request body: strict JSON types, finite numbers, unknown fields ignored
    (as OpenAI-compatible servers do, for forward compatibility)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    # Fields whose JSON ``null`` means "the default", as the dialect documents them
    # nullable (OpenAI's ``"n": null``); the official clients send nulls for unset values.
    NULL_IS_DEFAULT: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if (
            cls.NULL_IS_DEFAULT
            and isinstance(data, dict)
            and any(data.get(k, 0) is None for k in cls.NULL_IS_DEFAULT)
        ):
            return {k: v for k, v in data.items() if v is not None or k not in cls.NULL_IS_DEFAULT}
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _int64(cls, v: Any) -> Any:
        if not fits_int64(v):
            raise PydanticCustomError(
                "int64_range",
                "an integer is outside the signed 64-bit range [{lo}, {hi}]",
                {"lo": INT64_MIN, "hi": INT64_MAX},
            )
        return v

    @model_validator(mode="after")
    def _extra_int64(self) -> WireModel:
        """The same for the fields of models that keep unknown ones (chat messages carry
        tool_calls and the like to the template, and from there over the wire)."""
        for name, v in (self.__pydantic_extra__ or {}).items():
            if not fits_int64(v):
                raise PydanticCustomError(
                    "int64_range",
                    "{name}: an integer is outside the signed 64-bit range [{lo}, {hi}]",
                    {"name": name, "lo": INT64_MIN, "hi": INT64_MAX},
                )
        return self


def fits_int64(v: Any) -> bool:
    """Every int in ``v`` (lists, tuples and dict values walked; nested request models
    checked their own fields already) is within the signed 64-bit range."""
    if isinstance(v, bool) or v is None or isinstance(v, (str, float, BaseModel)):
        return True
    if isinstance(v, int):
        return INT64_MIN <= v <= INT64_MAX
    if isinstance(v, (list, tuple)):
        return all(fits_int64(x) for x in v)
    if isinstance(v, dict):
        return all(fits_int64(x) for x in v.values())
    return True


Seed = Annotated[
    int,
    Field(
        ge=SEED_MIN, le=SEED_MAX, description="A signed 64-bit integer; equal seeds, equal text."
    ),
]
Temperature = Annotated[float, Field(ge=0.0, description="0 (or below 1e-5): greedy.")]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[
    float, Field(ge=PENALTY_MIN, le=PENALTY_MAX, description="1: off; above 1 discourages repeats.")
]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # presence / frequency, as OpenAI
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0)]
MaxTokens = Annotated[int, Field(ge=1)]
Priority = Annotated[
    int,
    Field(
        ge=PRIORITY_MIN,
        le=PRIORITY_MAX,
        description="vLLM extension: lower runs first (default: the API key's, else 0). "
        "A key that is not admin may only ask for its own priority or a larger number.",
    ),
]
KeepAlive = str | int | float | None  # Ollama semantics: "5m", seconds, 0 unloads, <0 forever
CacheSalt = (
    Annotated[
        str,
        Field(
            min_length=1,
            max_length=1024,
            description="vLLM extension: requests share cached prompt prefixes (the prefix cache) "
            "only when their cache_salt is equal; with security.prefix_cache_isolation "
            "'per_key' only within one API key besides.",
        ),
    ]
    | None
)


def _named(v: str) -> str:
    if not v.strip():
        raise PydanticCustomError(
            "model_name_blank",
            "a model name must not be empty or blank (leave the field out "
            "for the server's default model)",
        )
    return v


# A model field: "" or blanks are a 400, never silently the default model (an empty name in
# /unload unloaded the default one); leaving the field out still means the default.
ModelName = Annotated[str, AfterValidator(_named)]


def is_token_ids(x: object) -> TypeIs[list[int]]:
    """A list of token ids, which the OpenAI-shaped fields take in place of text."""
    return isinstance(x, list) and all(isinstance(t, int) for t in x)
