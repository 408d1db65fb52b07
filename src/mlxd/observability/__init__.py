"""Logs (and, later, metrics)."""
