"""Write a random-weight model of a real shape (speed does not depend on weight values).

    python benchmarks/make_random_model.py --shape qwen2.5-0.5b --dtype bfloat16 --out DIR
    python benchmarks/make_random_model.py --shape smollm2-360m --dtype float32 \
        --tokenizer-from ~/.mlxd/models/smollm2-135m-instruct --out DIR

The Qwen2.5 shapes get a byte-level BPE tokenizer whose vocabulary has exactly the model's
size, so every id the random model emits decodes, with ChatML special tokens at Qwen2.5's
ids. ``--tokenizer-from DIR`` instead copies DIR's tokenizer (and its vocabulary size,
special ids and RoPE settings): a random target that a real smaller model of that family
can draft for (benchmarks/speculative.py ``--random-target``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

SHAPES = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        tie_word_embeddings=True,
    ),
    # Qwen2.5-7B's layer shape (vocabulary kept at the small models' size): the model for
    # tensor parallel (benchmarks/tensor_parallel.py); its 28 heads, 4 KV heads and MLP
    # width divide by 2 and 4 ranks
    "qwen2.5-7b": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        tie_word_embeddings=False,
    ),
    # Qwen2.5's vocabulary on a toy body: what the front end holds for a 151,936-token
    # tokenizer (benchmarks/memory_soak.py), at a speed a CPU serves
    "qwen2.5-vocab-tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=True,
    ),
    # SmolLM2-360M's body (Llama): the target for a SmolLM2-135M draft
    # (benchmarks/speculative.py --random-target), with that model's tokenizer
    "smollm2-360m": dict(
        model_type="llama",
        hidden_size=960,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        head_dim=64,
        intermediate_size=2560,
        tie_word_embeddings=True,
    ),
}
# what --tokenizer-from takes from the source's config.json besides its tokenizer files
FROM_SOURCE = (
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "rope_theta",
    "rope_traditional",
    "rope_scaling",
    "rms_norm_eps",
    "max_position_embeddings",
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)
VOCAB = 151936
SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(out: Path) -> None:
    """Byte-level BPE with no merges: text encodes byte by byte, and every id decodes.

    (transformers rebuilds qwen2 tokenizers from the vocab and merges alone, so the
    tokenizer must be byte-level BPE to survive that.)
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    special_ids = set(SPECIAL.values())
    it = iter(alphabet)
    for tid in range(VOCAB):
        if tid in special_ids:
            continue
        ch = next(it, None)
        vocab[ch if ch is not None else f"w{tid}"] = tid
    for tok, tid in SPECIAL.items():
        vocab[tok] = tid
    tk = Tokenizer(models.BPE(vocab, []))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(SPECIAL))
    tk.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
                "model_max_length": 32768,
            },
            indent=2,
        )
    )


def write_random_model(
    shape: str, dtype: str, out: Path, tokenizer_from: Path | None = None
) -> int:
    """Write the model to ``out``; the number of parameters."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    body = dict(SHAPES[shape])
    model_type = body.pop("model_type", "qwen2")
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": model_type,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "eos_token_id": SPECIAL["<|im_end|>"],
        **body,
    }
    if tokenizer_from is not None:
        src = json.loads((tokenizer_from / "config.json").read_text())
        config.update({k: src[k] for k in FROM_SOURCE if k in src})
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).exists():
                shutil.copy2(tokenizer_from / name, out / name)
    elif model_type != "qwen2":
        raise SystemExit(f"--shape {shape} needs --tokenizer-from (a model of its family)")
    config["architectures"] = [
        {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[model_type]
    ]
    config["torch_dtype"] = dtype
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.apply(lambda x: x.astype(getattr(mx, dtype)))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_from is None:
        write_tokenizer(out)
    return sum(v.size for v in weights.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--tokenizer-from",
        type=Path,
        help="copy this model directory's tokenizer (and vocabulary size)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    n = write_random_model(
        args.shape,
        args.dtype,
        Path(args.out),
        args.tokenizer_from.expanduser() if args.tokenizer_from else None,
    )
    print(f"wrote {args.out}: {n / 1e6:.0f}M parameters, {args.dtype}")


if __name__ == "__main__":
    main()
