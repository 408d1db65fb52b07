"""Front-end processes: HTTP dialects' runtime, tokenizers, streams; no MLX."""
