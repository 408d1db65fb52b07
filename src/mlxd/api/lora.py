"""LoRA adapters at run time, in vLLM's shapes: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``. A loaded adapter is a model name of its own (``model:
"<lora_name>"``, or ``"<base>:<lora_name>"``) that decodes on its base model in the same
batch as every other request (engines/lora.py), and is listed by /v1/models with its
``parent``. Loading reads a directory on the server, so only an admin key may (or anyone,
on a server without keys, which listens on loopback by default)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from mlxd.api.common import runtime
from mlxd.api.owner import principal
from mlxd.api.routing import ApiRoute
from mlxd.api.wire import ModelName, WireModel
from mlxd.core.errors import Forbidden, InvalidRequest, ModelNotFound
from mlxd.frontend.adapters import AdapterEntry

router = APIRouter(route_class=ApiRoute)


class LoadLoraBody(WireModel):
    lora_name: ModelName = Field(description="The model name requests use for the adapter.")
    lora_path: str = Field(
        min_length=1, description="An adapter directory on the server (mlx-lm's or PEFT's)."
    )
    base_model: ModelName | None = Field(
        None, description="mlxd: the model it adapts (default: the default model)."
    )
    load_inplace: bool = Field(False, description="Replace an adapter of the same name.")


class UnloadLoraBody(WireModel):
    lora_name: ModelName
    lora_int_id: int | None = None  # vLLM's; names are what mlxd goes by


def _admin(request: Request) -> None:
    if not principal(request).admin:
        raise Forbidden("loading and unloading LoRA adapters takes an admin key")


# vLLM answers these routes in plain text; errors are OpenAI's JSON, as everywhere
_TEXT_200: dict[int | str, Any] = {
    200: {"description": "Success", "content": {"text/plain": {"schema": {"type": "string"}}}}
}


@router.post("/v1/load_lora_adapter", responses=_TEXT_200)
async def load_lora_adapter(body: LoadLoraBody, request: Request) -> PlainTextResponse:
    _admin(request)
    rt = runtime(request)
    name = body.lora_name
    if rt.adapters.resolve(name) is not None and not body.load_inplace:
        raise InvalidRequest(
            f"The lora adapter '{name}' has already been loaded.", param="lora_name"
        )
    if name in {m["name"] for m in rt.models.installed()}:
        raise InvalidRequest(f"'{name}' already names a model in the store", param="lora_name")
    path = Path(body.lora_path).expanduser()
    if not path.is_dir():
        raise InvalidRequest(f"lora_path '{body.lora_path}' is not a directory", param="lora_path")
    base = rt.catalog.resolve(body.base_model)
    if rt.adapters.resolve(base) is not None:
        raise InvalidRequest("base_model names an adapter, not a model", param="base_model")
    await rt.load_adapter(AdapterEntry(name, base, str(path.resolve()), int(time.time())))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses=_TEXT_200)
async def unload_lora_adapter(body: UnloadLoraBody, request: Request) -> PlainTextResponse:
    _admin(request)
    rt = runtime(request)
    name = body.lora_name
    if rt.adapters.resolve(name) is None:
        raise ModelNotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name")
    await rt.unload_adapter(name)  # a 400 while requests use it
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
