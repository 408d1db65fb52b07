"""Owns the device: the worker thread, the loaded models and admission to the batch."""
