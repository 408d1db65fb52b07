"""Prometheus metrics, named as vLLM and TEI name them so existing dashboards work.

One module-level registry: a process runs one server. Every metric that concerns a model
carries a ``model`` label.

With ``--api-workers N`` the front ends are N processes behind one socket, and a scrape
reaches whichever one accepts it: each keeping its own counters, two scrapes in a row
would disagree (Prometheus would see resets). So the serving process gives them one
directory for prometheus-client's multiprocess mode (:data:`MULTIPROC_ENV`, as vLLM does)
and every front end exposes the sum over all of them; the engine cores keep single-process
metrics, which each front end fetches as before.
"""

from __future__ import annotations

import os
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mlxd.observability.context import add_usage

REGISTRY = CollectorRegistry(auto_describe=True)

# prometheus-client's own variable: set (by ``mlxd serve --api-workers N``) before a front
# end imports it, its metric values live in files there, summed over the processes
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Families the engine-core process records (models, encoder batches, vision features); a
# front end's /metrics takes these from the core and every other family from itself.
CORE_FAMILIES = frozenset(
    {
        "mlxd:embed_batch_size",
        "mlxd:embed_queue_duration_seconds",
        "mlxd:embed_inference_duration_seconds",
        "mlxd:vision_feature_cache_hits",
        "mlxd:vision_feature_cache_misses",
        "mlxd:vision_feature_cache_bytes",
        "mlxd:vision_images",
        "mlxd:models_loaded",
        "mlxd:model_memory_bytes",
        "mlxd:model_load_seconds",
        "mlxd:model_evictions",
        "mlxd:spec_decode_num_verify_steps",
        "mlxd:spec_decode_num_draft_tokens",
        "mlxd:spec_decode_num_accepted_tokens",
        "mlxd:spec_decode_num_emitted_tokens",
        "mlxd:spec_decode_draft_acceptance_rate",
        "mlxd:spec_decode_tokens_per_step",
        "mlxd:spec_decode_num_plain_steps",
        "mlxd:spec_decode_speculating",
        "mlxd:prefix_cache_disk_hits",
        "mlxd:prefix_cache_disk_misses",
        "mlxd:prefix_cache_disk_bytes",
        "mlxd:prefix_cache_disk_read_bytes",
        "mlxd:prefix_cache_disk_written_bytes",
        "mlxd:prefix_cache_disk_evictions",
        "mlxd:preemptions",
        "mlxd:prefix_cache_hybrid_checkpoint_hits",
        "mlxd:prefix_cache_hybrid_checkpoint_misses",
        "mlxd:prefix_cache_hybrid_checkpoint_bytes",
    }
)


def core_families(core_texts: list[str]) -> Any:
    """The engine cores' families (parsed from their text format). With several cores
    (one per device) each sample gets an ``engine_core`` label, its core's index, and each
    family is exposed once with every core's samples."""
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    if len(core_texts) == 1:
        for family in text_string_to_metric_families(core_texts[0]):
            if family.name in CORE_FAMILIES:
                yield family
        return
    merged: dict[str, Metric] = {}
    for index, text in enumerate(core_texts):
        for family in text_string_to_metric_families(text):
            if family.name not in CORE_FAMILIES:
                continue
            m = merged.get(family.name)
            if m is None:
                m = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            m.samples.extend(
                s._replace(labels={**s.labels, "engine_core": str(index)}) for s in family.samples
            )
    yield from merged.values()


class MergedCollector:
    """This process's families plus the engine cores' (``core_texts``: one per core, in
    core order; a core that did not answer: an empty text)."""

    def __init__(self, core_texts: list[str]) -> None:
        self.core_texts = core_texts

    def collect(self) -> Any:
        for family in _own_families():
            if family.name not in CORE_FAMILIES:
                yield family
        yield from core_families(self.core_texts)


def _own_families() -> Any:
    """This front end's families; with several front ends, all of theirs summed (gauges
    of processes that have exited dropped), plus this process's own ``process_*``."""
    if not os.environ.get(MULTIPROC_ENV):
        yield from REGISTRY.collect()
        return
    from prometheus_client import multiprocess

    yield from multiprocess.MultiProcessCollector(None).collect()  # type: ignore[arg-type]
    for family in REGISTRY.collect():
        if family.name.startswith("process_"):
            yield family


def front_end_exited(pid: int) -> None:
    """A front end of several is gone, however it ended (its supervisor calls this): its
    live gauges stop counting (counters stay)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)


def merged_text(core_texts: list[str]) -> bytes:
    from prometheus_client import generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(MergedCollector(core_texts))  # type: ignore[arg-type]
    return generate_latest(registry)


_LATENCY = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# -- generation (vLLM names) ---------------------------------------------------------------
num_requests_running = Gauge(
    "mlxd:num_requests_running",
    "Requests in a running batch.",
    ["model"],
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
num_requests_waiting = Gauge(
    "mlxd:num_requests_waiting",
    "Requests admitted and waiting for a batch slot.",
    ["model"],
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
time_to_first_token = Histogram(
    "mlxd:time_to_first_token_seconds",
    "Time from admission to the first token.",
    ["model"],
    buckets=_LATENCY,
    registry=REGISTRY,
)
inter_token_latency = Histogram(
    "mlxd:inter_token_latency_seconds",
    "Time between successive tokens of one request.",
    ["model"],
    buckets=_LATENCY,
    registry=REGISTRY,
)
e2e_request_latency = Histogram(
    "mlxd:e2e_request_latency_seconds",
    "Time from admission to the last token.",
    ["model"],
    buckets=_LATENCY,
    registry=REGISTRY,
)
request_queue_time = Histogram(
    "mlxd:request_queue_time_seconds",
    "Time from arrival until the request joins a batch.",
    ["model"],
    buckets=_LATENCY,
    registry=REGISTRY,
)
request_queue_time_by_priority = Histogram(
    "mlxd:request_queue_time_by_priority_seconds",
    "Time from arrival until the request joins a batch, by priority and API key name "
    "(empty without keys).",
    ["model", "priority", "key"],
    buckets=_LATENCY,
    registry=REGISTRY,
)
preemptions_total = Counter(
    "mlxd:preemptions",
    "Running requests that gave their slot (and resumed later), by reason: priority (a "
    "better one waited) or fair (a key with no running request waited).",
    ["model", "reason"],
    registry=REGISTRY,
)
prompt_tokens_total = Counter(
    "mlxd:prompt_tokens", "Prompt tokens processed.", ["model"], registry=REGISTRY
)
generation_tokens_total = Counter(
    "mlxd:generation_tokens", "Tokens generated.", ["model"], registry=REGISTRY
)
request_success_total = Counter(
    "mlxd:request_success",
    "Finished requests by finish reason.",
    ["model", "finished_reason"],
    registry=REGISTRY,
)

# -- encoders (TEI names) -----------------------------------------------------------------
embed_batch_size = Histogram(
    "mlxd:embed_batch_size",
    "Inputs per encoder batch.",
    ["model"],
    buckets=_TOKENS_BUCKETS,
    registry=REGISTRY,
)
embed_queue_duration = Histogram(
    "mlxd:embed_queue_duration_seconds",
    "Time an input waited for its encoder batch.",
    ["model"],
    buckets=_LATENCY,
    registry=REGISTRY,
)
embed_inference_duration = Histogram(
    "mlxd:embed_inference_duration_seconds",
    "Forward-pass time of one encoder batch.",
    ["model"],
    buckets=_LATENCY,
    registry=REGISTRY,
)

# -- vision models ----------------------------------------------------------------------------
vision_feature_cache_hits = Counter(
    "mlxd:vision_feature_cache_hits",
    "Images whose features came from the vision-feature cache (encoder not run).",
    ["model"],
    registry=REGISTRY,
)
vision_feature_cache_misses = Counter(
    "mlxd:vision_feature_cache_misses",
    "Images the vision encoder ran for (not in the feature cache).",
    ["model"],
    registry=REGISTRY,
)
vision_feature_cache_bytes = Gauge(
    "mlxd:vision_feature_cache_bytes",
    "Memory held by cached image features.",
    ["model"],
    registry=REGISTRY,
)
vision_images_total = Counter(
    "mlxd:vision_images", "Images accepted in requests.", ["model"], registry=REGISTRY
)

# -- speculative decoding (vLLM's spec_decode names) -------------------------------------------
spec_decode_verify_steps = Counter(
    "mlxd:spec_decode_num_verify_steps",
    "Decode steps that verified drafts.",
    ["model"],
    registry=REGISTRY,
)
spec_decode_draft_tokens = Counter(
    "mlxd:spec_decode_num_draft_tokens",
    "Draft tokens proposed for verification.",
    ["model"],
    registry=REGISTRY,
)
spec_decode_accepted_tokens = Counter(
    "mlxd:spec_decode_num_accepted_tokens",
    "Draft tokens the model accepted.",
    ["model"],
    registry=REGISTRY,
)
spec_decode_emitted_tokens = Counter(
    "mlxd:spec_decode_num_emitted_tokens",
    "Tokens emitted by verify steps (accepted drafts plus one per row).",
    ["model"],
    registry=REGISTRY,
)
spec_decode_acceptance_rate = Gauge(
    "mlxd:spec_decode_draft_acceptance_rate",
    "Accepted / proposed draft tokens since the model loaded.",
    ["model"],
    registry=REGISTRY,
)
spec_decode_tokens_per_step = Gauge(
    "mlxd:spec_decode_tokens_per_step",
    "Tokens a sequence emits per verify step since the model loaded (1 = no gain).",
    ["model"],
    registry=REGISTRY,
)
spec_decode_plain_steps = Counter(
    "mlxd:spec_decode_num_plain_steps",
    "Decode steps without a verify pass while speculation was on (no drafts, the cost "
    "rule chose plain, or the batch was above speculative_max_batch).",
    ["model"],
    registry=REGISTRY,
)
spec_decode_speculating = Gauge(
    "mlxd:spec_decode_speculating",
    "1 where the cost rule now speculates at this batch size (a power of two: the bucket "
    "of batch sizes from it to the next), 0 where it decodes plainly.",
    ["model", "batch"],
    registry=REGISTRY,
)

# -- the prefix cache's disk tier (engines/prefix_disk.py) ------------------------------------
prefix_disk_hits = Counter(
    "mlxd:prefix_cache_disk_hits",
    "Requests whose prompt prefix was read from the prefix cache's disk tier.",
    ["model"],
    registry=REGISTRY,
)
prefix_disk_misses = Counter(
    "mlxd:prefix_cache_disk_misses",
    "Long prompts the memory tier could not serve and the disk tier had nothing for.",
    ["model"],
    registry=REGISTRY,
)
prefix_disk_bytes = Gauge(
    "mlxd:prefix_cache_disk_bytes",
    "Bytes of KV cache files in the disk tier.",
    ["model"],
    registry=REGISTRY,
)
prefix_disk_read = Counter(
    "mlxd:prefix_cache_disk_read_bytes",
    "Bytes read back from the disk tier.",
    ["model"],
    registry=REGISTRY,
)
prefix_disk_written = Counter(
    "mlxd:prefix_cache_disk_written_bytes",
    "Bytes written to the disk tier.",
    ["model"],
    registry=REGISTRY,
)
prefix_disk_evictions = Counter(
    "mlxd:prefix_cache_disk_evictions",
    "Disk-tier files deleted to stay within engine.prefix_cache_disk_bytes.",
    ["model"],
    registry=REGISTRY,
)

# -- the prefix cache's checkpoints of recurrent and sliding-window layers --------------------
prefix_checkpoint_hits = Counter(
    "mlxd:prefix_cache_hybrid_checkpoint_hits",
    "Requests of a model with recurrent or sliding-window layers that resumed from a "
    "prefix-cache checkpoint.",
    ["model"],
    registry=REGISTRY,
)
prefix_checkpoint_misses = Counter(
    "mlxd:prefix_cache_hybrid_checkpoint_misses",
    "Requests that shared a useful prefix with a cached sequence of such a model but found "
    "no checkpoint at or before where they diverge.",
    ["model"],
    registry=REGISTRY,
)
prefix_checkpoint_bytes = Gauge(
    "mlxd:prefix_cache_hybrid_checkpoint_bytes",
    "Bytes of checkpoints the prefix cache's memory tier holds.",
    ["model"],
    registry=REGISTRY,
)

# -- the model cache ------------------------------------------------------------------------
models_loaded = Gauge("mlxd:models_loaded", "Models loaded now.", ["kind"], registry=REGISTRY)
model_memory_bytes = Gauge(
    "mlxd:model_memory_bytes", "Weight memory of a loaded model.", ["model"], registry=REGISTRY
)
model_load_seconds = Histogram(
    "mlxd:model_load_seconds",
    "Time to load (and warm up) a model.",
    ["model"],
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
    registry=REGISTRY,
)
model_evictions_total = Counter(
    "mlxd:model_evictions",
    "Models unloaded to make room or idle.",
    ["model", "reason"],
    registry=REGISTRY,
)

# -- HTTP ---------------------------------------------------------------------------------------
http_requests_total = Counter(
    "mlxd:http_requests",
    "HTTP requests by route and status.",
    ["method", "route", "status"],
    registry=REGISTRY,
)
# -- usage per API key name (never the key; empty with no keys configured) --------------------
key_tokens_total = Counter(
    "mlxd_key_tokens",
    "Tokens by API key name, model and kind (input, output).",
    ["key", "model", "kind"],
    registry=REGISTRY,
)
key_requests_total = Counter(
    "mlxd_key_requests",
    "Model requests by API key name and model.",
    ["key", "model"],
    registry=REGISTRY,
)
key_errors_total = Counter(
    "mlxd_key_errors",
    "Model requests answered with an error status (4xx, 5xx) by API key name and model.",
    ["key", "model"],
    registry=REGISTRY,
)
http_request_duration = Histogram(
    "mlxd:http_request_duration_seconds",
    "HTTP request latency by route.",
    ["method", "route"],
    buckets=_LATENCY,
    registry=REGISTRY,
)

rate_limit_store_errors = Counter(
    "mlxd:rate_limit_store_errors",
    "Rate-limit checks the shared store (Redis) could not answer, by failure policy.",
    ["policy"],
    registry=REGISTRY,
)

# -- operations ------------------------------------------------------------------------------
worker_restarts_total = Counter(
    "mlxd:worker_restarts",
    "Times an engine core died and a new one was started.",
    registry=REGISTRY,
)

try:  # process_* metrics (RSS, CPU, open fds) on Linux
    from prometheus_client import ProcessCollector

    ProcessCollector(registry=REGISTRY)
except Exception:  # noqa: BLE001 - optional
    pass


# -- hooks the runtime calls ------------------------------------------------------------------


def spec_decode_events(
    model: str,
    steps: int,
    drafted: int,
    accepted: int,
    emitted: int,
    totals: dict[str, Any],
    plain: int = 0,
) -> None:
    """Growth of the speculation counters since the last call, the running ratios, and
    the cost rule's decision per batch-size bucket."""
    spec_decode_verify_steps.labels(model).inc(steps)
    spec_decode_plain_steps.labels(model).inc(plain)
    for batch, bucket in (totals.get("buckets") or {}).items():
        spec_decode_speculating.labels(model, batch).set(bucket["decision"] == "speculate")
    spec_decode_draft_tokens.labels(model).inc(drafted)
    spec_decode_accepted_tokens.labels(model).inc(accepted)
    spec_decode_emitted_tokens.labels(model).inc(emitted)
    if totals.get("acceptance_rate") is not None:
        spec_decode_acceptance_rate.labels(model).set(totals["acceptance_rate"])
    if totals.get("tokens_per_step") is not None:
        spec_decode_tokens_per_step.labels(model).set(totals["tokens_per_step"])


def preempted(model: str, reason: str) -> None:
    preemptions_total.labels(model, reason).inc()


def model_loaded(name: str, kind: str, size: int, seconds: float) -> None:
    models_loaded.labels(kind).inc()
    model_memory_bytes.labels(name).set(size)
    model_load_seconds.labels(name).observe(seconds)


def model_unloaded(name: str, kind: str, eviction_reason: str | None = None) -> None:
    """``eviction_reason``: capacity | memory | idle; None for an unload."""
    models_loaded.labels(kind).dec()
    try:
        model_memory_bytes.remove(name)
    except KeyError:
        pass
    if eviction_reason is not None:
        model_evictions_total.labels(name, eviction_reason).inc()


class GenerationObserver:
    """Follows one generation: waiting -> running -> finished, feeding the vLLM-named metrics
    and the request's usage (for the access log and the token rate limit).

    ``gen`` needs ``model``, ``prompt_tokens``, ``t_submitted`` and ``t_acquired``
    (perf_counter times), read when the first event arrives.
    """

    __slots__ = ("_gen", "_state", "_last", "_completion", "_ttft", "_itl", "_gen_tokens")

    def __init__(self, gen: Any) -> None:
        self._gen = gen
        self._state = "waiting"
        self._last = 0.0
        self._completion = 0
        model = gen.model
        num_requests_waiting.labels(model).inc()
        self._ttft = time_to_first_token.labels(model)
        self._itl = inter_token_latency.labels(model)
        self._gen_tokens = generation_tokens_total.labels(model)

    def event(self, n_tokens: int, finish_reason: str | None, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        g = self._gen
        if self._state == "waiting":
            self._state = "running"
            num_requests_waiting.labels(g.model).dec()
            num_requests_running.labels(g.model).inc()
            queued = getattr(g, "queue_seconds", None)  # arrival -> first scheduled in a batch
            waited = max(queued if queued is not None else g.t_acquired - g.t_submitted, 0.0)
            request_queue_time.labels(g.model).observe(waited)
            request_queue_time_by_priority.labels(
                g.model, str(getattr(g, "priority", 0)), getattr(g, "key_name", None) or ""
            ).observe(waited)
            self._ttft.observe(max(now - g.t_submitted, 0.0))
            prompt_tokens_total.labels(g.model).inc(len(g.prompt_tokens))
        elif n_tokens:
            self._itl.observe(max(now - self._last, 0.0) / n_tokens)
        if n_tokens:
            self._last = now
            self._completion += n_tokens
            self._gen_tokens.inc(n_tokens)
        if finish_reason is not None:
            e2e_request_latency.labels(g.model).observe(max(now - g.t_submitted, 0.0))
            self._finish(finish_reason)

    def close(self) -> None:
        """The generation ended without a finish event (client gone, never iterated)."""
        if self._state != "done":
            self._finish("cancelled")

    def _finish(self, reason: str) -> None:
        g = self._gen
        ran = self._state == "running"
        if self._state == "waiting":
            num_requests_waiting.labels(g.model).dec()
        elif ran:
            num_requests_running.labels(g.model).dec()
        self._state = "done"
        request_success_total.labels(g.model, reason).inc()
        add_usage(g.model, len(g.prompt_tokens) if ran else 0, self._completion)
