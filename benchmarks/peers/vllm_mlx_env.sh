#!/usr/bin/env bash
# A venv with vllm-mlx 0.6.0 and only what its text server imports, for a Linux CPU peer.
# Its declared dependencies (mlx-vlm, gradio, opencv, torchvision, mcp...) serve images,
# audio and a web UI; the text path runs without them, so every package here is pinned and
# installed with --no-deps. MLX is the version mlxd was measured with.
#
#   bash benchmarks/peers/vllm_mlx_env.sh [VENV]     # default /tmp/vmlx
#   LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
#     VENV/bin/vllm-mlx serve ~/.mlxd/models/smollm2-135m-instruct --port 8391 \
#     --served-model-name smollm2-135m-instruct --continuous-batching
set -euo pipefail
venv="${1:-/tmp/vmlx}"
python="${PYTHON:-python3.11}"
"$python" -m venv "$venv"
req="$(mktemp)"
trap 'rm -f "$req"' EXIT
cat >"$req" <<'PINS'
vllm-mlx==0.6.0
mlx==0.32.4
mlx-cpu==0.32.4
mlx-lm==0.31.3
transformers==5.25.0
tokenizers==0.23.3
huggingface_hub==2.4.0
hf-xet==1.8.0
safetensors==0.8.0
sentencepiece==0.2.3
protobuf==7.36.2
numpy==2.4.6
regex==2026.12.2
PyYAML==6.0.4
Jinja2==3.1.6
MarkupSafe==3.0.4
tqdm==4.70.1
filelock==4.3.2
fsspec==2026.9.0
packaging==26.4
typer==0.29.2
click==8.5.1
rich==15.0.0
markdown-it-py==4.3.0
mdurl==0.1.2
Pygments==2.21.0
shellingham==1.5.4
httpx2==2.17.0
httpcore2==2.17.0
h11==0.16.0
anyio==4.16.0
idna==3.20
certifi==2026.10.19.post1
truststore==0.10.5
kernels==0.19.1
tomlkit==0.15.3
fastapi==0.165.0
starlette==1.10.0
annotated-doc==0.0.7
opentelemetry-api==1.45.3
pydantic==2.14.4
pydantic_core==2.50.5
annotated-types==0.8.0
typing_extensions==4.16.0
typing-inspection==0.4.5
uvicorn==0.55.0
python-multipart==0.0.34
psutil==7.2.2
requests==2.34.2
urllib3==2.8.0
charset-normalizer==3.5.3
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
referencing==0.37.0
rpds-py==2026.9.1
attrs==26.1.0
pillow==13.0.0
PINS
"$venv/bin/pip" install --quiet --no-deps -r "$req"
# the text server's imports, checked here rather than at the first request
"$venv/bin/python" -c "import vllm_mlx.server, vllm_mlx.engine.batched, mlx.core as mx; print('vllm-mlx ready, mlx', mx.__version__)"
