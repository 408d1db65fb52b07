"""Prometheus metrics, named as vLLM and TEI name them so existing dashboards work.

One module-level registry: a process runs one server. Every metric that concerns a model
carries a ``model`` label.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0)
_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# -- generation (vLLM names) ---------------------------------------------------------------
num_requests_running = Gauge("mlxd:num_requests_running",
                             "Requests in a running batch.", ["model"], registry=REGISTRY)
num_requests_waiting = Gauge("mlxd:num_requests_waiting",
                             "Requests admitted and waiting for a batch slot.", ["model"],
                             registry=REGISTRY)
time_to_first_token = Histogram("mlxd:time_to_first_token_seconds",
                                "Time from admission to the first token.", ["model"],
                                buckets=_LATENCY, registry=REGISTRY)
inter_token_latency = Histogram("mlxd:inter_token_latency_seconds",
                                "Time between successive tokens of one request.", ["model"],
                                buckets=_LATENCY, registry=REGISTRY)
e2e_request_latency = Histogram("mlxd:e2e_request_latency_seconds",
                                "Time from admission to the last token.", ["model"],
                                buckets=_LATENCY, registry=REGISTRY)
request_queue_time = Histogram("mlxd:request_queue_time_seconds",
                               "Time from admission until the model is ready to run it.",
                               ["model"], buckets=_LATENCY, registry=REGISTRY)
prompt_tokens_total = Counter("mlxd:prompt_tokens", "Prompt tokens processed.", ["model"],
                              registry=REGISTRY)
generation_tokens_total = Counter("mlxd:generation_tokens", "Tokens generated.", ["model"],
                                  registry=REGISTRY)
request_success_total = Counter("mlxd:request_success",
                                "Finished requests by finish reason.",
                                ["model", "finished_reason"], registry=REGISTRY)

# -- encoders (TEI names) -----------------------------------------------------------------
embed_batch_size = Histogram("mlxd:embed_batch_size", "Inputs per encoder batch.", ["model"],
                             buckets=_TOKENS_BUCKETS, registry=REGISTRY)
embed_queue_duration = Histogram("mlxd:embed_queue_duration_seconds",
                                 "Time an input waited for its encoder batch.", ["model"],
                                 buckets=_LATENCY, registry=REGISTRY)
embed_inference_duration = Histogram("mlxd:embed_inference_duration_seconds",
                                     "Forward-pass time of one encoder batch.", ["model"],
                                     buckets=_LATENCY, registry=REGISTRY)

# -- the model cache ------------------------------------------------------------------------
models_loaded = Gauge("mlxd:models_loaded", "Models loaded now.", ["kind"], registry=REGISTRY)
model_memory_bytes = Gauge("mlxd:model_memory_bytes", "Weight memory of a loaded model.",
                           ["model"], registry=REGISTRY)
model_load_seconds = Histogram("mlxd:model_load_seconds", "Time to load (and warm up) a model.",
                               ["model"], buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
                               registry=REGISTRY)
model_evictions_total = Counter("mlxd:model_evictions", "Models unloaded to make room or idle.",
                                ["model", "reason"], registry=REGISTRY)

# -- HTTP ---------------------------------------------------------------------------------------
http_requests_total = Counter("mlxd:http_requests", "HTTP requests by route and status.",
                              ["method", "route", "status"], registry=REGISTRY)
http_request_duration = Histogram("mlxd:http_request_duration_seconds",
                                  "HTTP request latency by route.", ["method", "route"],
                                  buckets=_LATENCY, registry=REGISTRY)
