"""The engine core: one process per device that owns everything MLX."""
