"""Triton's endpoints around inference: health, server and model metadata, model config, statistics, and the
model repository extension (index, load, unload)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response

from specserve.server.errors import InputError, UnsupportedError
from specserve.server.http import json_response, read_json
from specserve.server.repository import RepositoryError, ServedModel
from specserve.server.request import ServerContext
from specserve.server.triton.protocol import as_bool, as_int, error_json, error_response, resolve_model
from specserve.server.triton.schema import model_config, model_metadata

SERVER_NAME = "specserve"
EXTENSIONS = ["model_repository", "model_configuration", "binary_tensor_data", "parameters", "statistics",
              "generate"]


async def live(request: Request) -> Response:
    return Response(status_code=200)


async def ready(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    return Response(status_code=200 if ctx.is_ready() else 400)


async def server_metadata(request: Request) -> Response:
    return json_response({"name": SERVER_NAME, "version": server_version(), "extensions": EXTENSIONS})


def server_version() -> str:
    try:
        return importlib.metadata.version("specserve")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"


async def metadata(request: Request) -> Response:
    return _model_document(request, model_metadata)


async def config(request: Request) -> Response:
    return _model_document(request, model_config)


def _model_document(request: Request, build: Callable[[ServedModel], dict]) -> Response:
    try:
        return json_response(build(resolve_model(request)))
    except RepositoryError as exc:
        return error_response(None, exc)


async def model_ready(request: Request) -> Response:
    try:
        resolve_model(request)
    except RepositoryError:
        return error_json("Model version not ready", 400)
    return Response(status_code=200)


async def stats(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    name = request.path_params.get("model")
    try:
        models = ctx.repository.ready_models() if name is None else [
            ctx.repository.get(name, request.path_params.get("version"))]
    except RepositoryError as exc:
        return error_response(None, exc)
    return json_response({"model_stats": [ctx.metrics.model_stats(m.name, m.version) for m in models]})


# ------------------------------------------------------------------------------------------------------------------
# the repository extension


def _repository_ctx(request: Request) -> ServerContext:
    check_repository_name(request.path_params.get("repository"))
    return request.app.state.ctx


def check_repository_name(name: str | None) -> None:
    """Only the server's one repository is addressable: a named one is Triton's "not supported" (501)."""
    if name:
        raise UnsupportedError("'repository_name' specification is not supported")


def check_model_control(ctx: ServerContext) -> None:
    """Load and unload requests are allowed only in explicit model-control mode (Triton's status and message
    otherwise)."""
    if ctx.model_control_mode != "explicit":
        raise InputError("explicit model load / unload is not allowed if polling is enabled", status=503)


async def repository_index(request: Request) -> Response:
    try:
        ctx = _repository_ctx(request)
        body = await read_json(request)
        ready_only = as_bool("ready", body.get("ready", False))
    except (UnsupportedError, InputError) as exc:
        return error_response(None, exc)
    return json_response(ctx.repository.index(ready_only))


async def repository_load(request: Request) -> Response:
    try:
        ctx = _repository_ctx(request)
        check_model_control(ctx)  # before the body, as Triton answers
        body = await read_json(request)
        await load_model(ctx, request.path_params["model"], body.get("parameters") or {})
    except (UnsupportedError, InputError, RepositoryError) as exc:
        return error_response(None, exc)
    return Response(status_code=200)


async def load_model(ctx: ServerContext, name: str, parameters) -> None:
    """A load request (HTTP or gRPC): checked, the model loaded off the event loop, then warmed up. Raises
    InputError, RepositoryError."""
    check_model_control(ctx)
    overrides = _load_overrides(parameters)
    model = await asyncio.to_thread(ctx.repository.load, name, overrides or None)
    await ctx.warm_up(model)


def unload_model(ctx: ServerContext, name: str) -> None:
    check_model_control(ctx)
    ctx.repository.unload(name)


def _load_overrides(parameters: dict) -> dict:
    """A load request's `config` parameter -> the max_batch_size / decoupled it overrides."""
    if not isinstance(parameters, dict):
        raise InputError("'parameters' must be a JSON object")
    if any(key.startswith("file:") for key in parameters):
        raise InputError("loading model files through the request ('file:' parameters) is not supported")
    if "config" not in parameters:
        return {}
    try:
        config = json.loads(parameters["config"]) if isinstance(parameters["config"], str) else None
    except ValueError as exc:
        raise InputError(f"failed to parse 'config': {exc}") from None
    if not isinstance(config, dict):
        raise InputError("'config' must be a JSON object encoded as a string")
    overrides = {}
    if "max_batch_size" in config:
        overrides["max_batch_size"] = as_int("max_batch_size", config["max_batch_size"], 0)
    policy = config.get("model_transaction_policy") or {}
    if isinstance(policy, dict) and "decoupled" in policy:
        overrides["decoupled"] = as_bool("decoupled", policy["decoupled"])
    return overrides


async def repository_unload(request: Request) -> Response:
    try:
        ctx = _repository_ctx(request)
        check_model_control(ctx)
        await read_json(request)
        unload_model(ctx, request.path_params["model"])
    except (UnsupportedError, InputError, RepositoryError) as exc:
        return error_response(None, exc)
    return Response(status_code=200)
