"""Prometheus metrics (metrics.py), structured logs (logs.py), per-request facts (context.py)."""
