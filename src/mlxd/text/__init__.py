"""A text model's tokenizer side, without MLX: templating, tokenizing, what a grammar is made
of, output parsing, stop strings. Front ends and the engine core both use it, so it sits
below both."""
