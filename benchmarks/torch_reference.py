"""PyTorch (CPU) on the same model shape, as a reference for MLX's CPU numbers.

Runs in a separate environment that has torch and transformers (never the project's venv):

    python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch==2.13.0 transformers
    /tmp/torchvenv/bin/python benchmarks/torch_reference.py MODEL_DIR

MODEL_DIR is a store entry of the default model (float32 safetensors with Hugging Face names;
llama.cpp's Q/K permutation changes the values, not the speed). Reports prefill tokens/s on a
256-token prompt and batch-1 / batch-16 decode tokens/s, medians of 3.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
    model.eval()
    prompt = torch.arange(1000, 1256).unsqueeze(0)

    @torch.inference_mode()
    def prefill() -> float:
        t = time.perf_counter()
        model(prompt)
        return time.perf_counter() - t

    @torch.inference_mode()
    def decode(batch: int, n: int = 32) -> float:
        ids = torch.arange(1000, 1016).repeat(batch, 1)
        out = model(ids, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(n):
            out = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return batch * n / (time.perf_counter() - t)

    prefill()
    pre = 256 / statistics.median(prefill() for _ in range(3))
    d1 = statistics.median(decode(1) for _ in range(3))
    d16 = statistics.median(decode(16) for _ in range(3))
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "prefill_tps": pre,
                "decode_tps_b1": d1,
                "decode_tps_b16": d16,
            }
        )
    )


if __name__ == "__main__":
    main()
