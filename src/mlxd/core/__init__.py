"""Protocol-free types, errors and pure helpers that every layer may use, front ends and
engine core alike (nothing here imports MLX or another mlxd package)."""
