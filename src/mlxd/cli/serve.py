"""``mlxd serve``: run the server in the foreground (``mlxd start -f`` calls it too)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from mlxd.cli.common import ConfigOpt
from mlxd.config import ConfigError, load_settings


def serve(
    config: ConfigOpt = None,
    host: Annotated[Optional[str], typer.Option(help="Address to bind.")] = None,
    port: Annotated[Optional[int], typer.Option(help="TCP port.")] = None,
    allowed_origins: Annotated[
        Optional[str],
        typer.Option(
            help="Web origins whose pages may call the server (CORS too), comma-separated; '*' "
            "any. Default: only the server's own (its web UI).",
        ),
    ] = None,
    allowed_hosts: Annotated[
        Optional[str],
        typer.Option(
            help="Host names the server answers to (against DNS rebinding), comma-separated; "
            "'*' any. Loopback names always; default when bound beyond loopback: any.",
        ),
    ] = None,
    model: Annotated[
        Optional[str],
        typer.Option("--model", "-m", help="Default chat model: a name, alias or directory."),
    ] = None,
    preload: Annotated[
        Optional[list[str]], typer.Option(help="Also load this model at start (repeatable).")
    ] = None,
    max_num_seqs: Annotated[
        Optional[str],
        typer.Option(
            help="Batch size per model: a number, or auto (sized from the memory budget).",
        ),
    ] = None,
    prefill_step_size: Annotated[Optional[int], typer.Option()] = None,
    pipeline_decode: Annotated[
        Optional[str],
        typer.Option(help="auto|on|off: start each decode step before the last one is read."),
    ] = None,
    max_queued_requests: Annotated[Optional[int], typer.Option()] = None,
    dtype: Annotated[
        Optional[str], typer.Option(help="auto|native|float32|float16|bfloat16")
    ] = None,
    log_level: Annotated[Optional[str], typer.Option()] = None,
    log_format: Annotated[Optional[str], typer.Option(help="text|json")] = None,
    adapter: Annotated[
        Optional[Path],
        typer.Option(
            "--adapter",
            "--adapter-path",
            help="LoRA adapter directory for the default model.",
        ),
    ] = None,
    trust_remote_code: Annotated[
        Optional[bool],
        typer.Option(
            "--trust-remote-code",
            help="Let models run Python code they ship (only if asked).",
        ),
    ] = None,
    kv_bits: Annotated[
        Optional[float],
        typer.Option(help="Quantize the KV cache (bits; vision models; 3.5 with turboquant)."),
    ] = None,
    kv_quant_scheme: Annotated[
        Optional[str],
        typer.Option(help="KV quantization scheme: uniform | turboquant (vision models)."),
    ] = None,
    kv_group_size: Annotated[Optional[int], typer.Option(help="KV quantization group.")] = None,
    max_kv_size: Annotated[Optional[int], typer.Option(help="Bound the KV cache (tokens).")] = None,
    speculative: Annotated[
        Optional[str],
        typer.Option(
            help="Speculative decoding: auto | off | prompt-lookup | draft (with --draft-model)."
        ),
    ] = None,
    draft_model: Annotated[
        Optional[str],
        typer.Option(
            help="Draft model for --speculative draft (shares the served model's tokenizer)."
        ),
    ] = None,
    api_workers: Annotated[
        Optional[int],
        typer.Option(
            help="Front-end processes (HTTP, tokenizing, streaming) sharing the engine cores.",
        ),
    ] = None,
    devices: Annotated[
        Optional[str],
        typer.Option(
            help="One engine core per device: all | 0,1 (GPU indices) | cpu:N (N cores on the "
            "CPU). Default: one core on the default device.",
        ),
    ] = None,
    tensor_parallel: Annotated[
        Optional[int],
        typer.Option(
            help="Shard the text model over N ranks (mx.distributed: ring on CPU, NCCL on CUDA).",
        ),
    ] = None,
    pipeline_parallel: Annotated[
        Optional[int],
        typer.Option(
            help="Split the text model's layers over N ranks (models whose mlx-lm class offers "
            "pipelining: Qwen2/2.5, DeepSeek-V2/V3, Qwen3-MoE...).",
        ),
    ] = None,
    otlp_traces_endpoint: Annotated[
        Optional[str],
        typer.Option(
            help="Export OpenTelemetry traces over OTLP/HTTP to this URL "
            "(http://collector:4318/v1/traces; needs the otel extra).",
        ),
    ] = None,
) -> None:
    """Run the server in the foreground."""
    overrides = {
        "server": {
            "host": host,
            "port": port,
            "api_workers": api_workers,
            "allowed_origins": allowed_origins,
            "allowed_hosts": allowed_hosts,
        },
        "models": {
            "default": model,
            "preload": preload or None,
            "dtype": dtype,
            "adapter_path": adapter,
            "trust_remote_code": trust_remote_code,
        },
        "engine": {
            "devices": devices,
            "max_num_seqs": max_num_seqs,
            "prefill_step_size": prefill_step_size,
            "pipeline_decode": pipeline_decode,
            "max_queued_requests": max_queued_requests,
            "kv_bits": kv_bits,
            "kv_quant_scheme": kv_quant_scheme,
            "kv_group_size": kv_group_size,
            "max_kv_size": max_kv_size,
            "tensor_parallel": tensor_parallel,
            "pipeline_parallel": pipeline_parallel,
            "speculative": speculative,
            "draft_model": draft_model,
        },
        "log": {"level": log_level, "format": log_format},
        "observability": {"otlp_traces_endpoint": otlp_traces_endpoint},
    }
    try:
        settings = load_settings(config, overrides)
    except ConfigError as exc:
        typer.echo(f"mlxd: configuration error:\n{exc}", err=True)
        raise typer.Exit(2) from None

    from mlxd.server import run

    raise typer.Exit(run(settings))
