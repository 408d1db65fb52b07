"""Thin adapters over the field's MLX libraries. All MLX calls live below this package."""
