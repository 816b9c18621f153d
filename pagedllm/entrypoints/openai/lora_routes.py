"""LoRA adapters on the server (vLLM's interface).

* ``--enable-lora --lora-modules name=path ...`` (or the JSON form
  ``'{"name": ..., "path": ..., "base_model_name": ...}'``): adapters served from start.
* Each adapter is a model: listed in ``/v1/models`` with ``parent`` = the base model, and
  a request picks it by ``model``.  An unknown name is a 404 ``model_not_found``.
* ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and
  ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` change the set at run time.  As in
  vLLM they exist only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (or
  ``PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING``) is true: they make the server read any
  directory it can see, so an operator opts in; like every ``/v1`` route they need the
  API key when one is set.  A bad adapter (missing/corrupt files, rank above
  ``--max-lora-rank``, shapes that do not fit the model) is a 400 naming it; the
  engine never sees it.

Unloading stops new requests from using the adapter; requests already running finish
with it (they carry its path), and its device slot is reused as slots are needed.
"""

from __future__ import annotations

import itertools
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import pagedllm.envs as envs
from pagedllm.entrypoints.openai.json_body import loads_strict
from pagedllm.entrypoints.openai.protocol import RequestError
from pagedllm.lora.request import LoRARequest


class ServerLoRAs:
    """The adapters this server serves, by name (one per server, no globals)."""

    def __init__(self, enabled: bool, base_model: str) -> None:
        self.enabled = enabled
        self.base_model = base_model
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def get(self, model: str | None) -> LoRARequest | None:
        return self.by_name.get(model) if model is not None else None

    def add(self, name: str, path: str, check: Any, served: list[str],
            base_model_name: str | None = None) -> LoRARequest:
        """Validate (``check``: the input processor's registry) and register; a
        ``RequestError`` (400) naming the problem otherwise."""
        if not self.enabled:
            raise RequestError("LoRA is not enabled on this server (--enable-lora)",
                               "lora_name")
        if name in self.by_name or name in served:
            raise RequestError(f"the model name {name!r} is already in use", "lora_name")
        req = LoRARequest(name, next(self._ids), path,
                          base_model_name or self.base_model)
        try:
            check(req)
        except ValueError as e:
            raise RequestError(str(e), "lora_path") from None
        self.by_name[name] = req
        return req


def runtime_updating_allowed() -> bool:
    return envs.allow_runtime_lora_updating()


def add_lora_routes(app: FastAPI, state: Any) -> None:
    """The load/unload routes (only when runtime updating is allowed)."""
    from pagedllm.entrypoints.openai.serving_base import engine_error_response

    if not runtime_updating_allowed():
        return
    loras: ServerLoRAs = state.loras

    async def body_of(raw: Request) -> dict[str, Any]:
        # Strict (json_body.py): a name with a lone surrogate is a 400 before any state
        # changes; /v1/models echoes every registered name.
        body = loads_strict(await raw.body())
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    def field(body: dict[str, Any], key: str) -> str:
        value = body.get(key)
        if not isinstance(value, str) or not value:
            raise RequestError(f"{key} must be a non-empty string", key)
        return value

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw_request: Request) -> Response:
        try:
            body = await body_of(raw_request)
            name, path = field(body, "lora_name"), field(body, "lora_path")
            check = state.engine.input_processor.loras.check
            await state.off_loop(loras.add, name, path, check, state.served_model_names)
        except Exception as e:
            return engine_error_response(e)
        return JSONResponse({"status": "ok",
                             "message": f"Success: LoRA adapter '{name}' added successfully."})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw_request: Request) -> Response:
        try:
            body = await body_of(raw_request)
            name = field(body, "lora_name")
            req = loras.by_name.pop(name, None)
            if req is None:
                raise RequestError(f"The lora adapter '{name}' cannot be found.",
                                   "lora_name", status=404, code="model_not_found",
                                   err_type="NotFoundError")
            state.engine.input_processor.loras.forget(req.lora_int_id)
        except Exception as e:
            return engine_error_response(e)
        return JSONResponse({"status": "ok", "message":
                             f"Success: LoRA adapter '{name}' removed successfully."})
