"""The LoRA adapters a request may name, as vLLM serves them: ``model: "<adapter>"`` (or
``"<base>:<adapter>"``) decodes on the base model with that adapter, in the same batch as
every other request to the base (engines/lora.py).

Registered at run time (``POST /v1/load_lora_adapter``) or by ``mlxd pull`` of an adapter,
and kept in the model store's ``lora-adapters.json`` (store/adapters.py, where the CLI
reaches it too), so every front end of a server (``--api-workers N``) resolves the same
names, and a restart keeps them. The engine core loads an adapter when the first request
that names it arrives (and again after its base model was unloaded).
"""

from __future__ import annotations

from mlxd.store.adapters import FILE, AdapterEntry, AdapterRegistry

__all__ = ["FILE", "AdapterEntry", "AdapterRegistry"]
