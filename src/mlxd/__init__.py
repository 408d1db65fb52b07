"""mlxd: a model server on MLX."""

__version__ = "0.1.0"
