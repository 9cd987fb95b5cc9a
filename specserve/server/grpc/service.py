"""The KServe v2 `inference.GRPCInferenceService` (Triton's gRPC API) over the same models, request path and
metrics as the HTTP front end.

Every RPC is a thin layer over what `server/triton/` already does: the schema and config documents
(`triton/schema.py`), the request reading and validation (`triton/protocol.py` via `triton/infer.py`), submission
with metrics and cancel-by-id (`server/request.py`), the streamed responses (`triton/generate.py`) and the
repository extension (`triton/admin.py`). Only the message forms (`tensors.py`) and the status codes
(`status.py`) are gRPC's own. Shared memory, tracing and log settings are left UNIMPLEMENTED (the generated
servicer's default).
"""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc

from specserve.server.errors import InputError, is_expected
from specserve.server.repository import RepositoryError, ServedModel
from specserve.server.request import ServerContext
from specserve.server.triton.admin import (EXTENSIONS, SERVER_NAME, check_repository_name, load_model,
                                           server_version, unload_model)
from specserve.server.triton.generate import cancel_in_flight, complete, response_outputs
from specserve.server.triton.infer import infer_request, requested_outputs
from specserve.server.triton.protocol import GenerateRequest, error_message
from specserve.server.triton.schema import model_config, model_metadata
from specserve.server.grpc.status import status_code
from specserve.server.grpc.tensors import (infer_response, input_values, parameters_dict,
                                           requested_output_items)

log = logging.getLogger("specserve.server")

STREAMING_ON_UNARY = ("ModelInfer RPC doesn't support streaming responses (stream / streaming = true); use "
                      "ModelStreamInfer")
_END = object()


async def abort(context: grpc.aio.ServicerContext, model: ServedModel | None, exc: BaseException) -> None:
    """End the RPC with the error's status code and the message HTTP would send."""
    if not is_expected(exc):
        log.error("gRPC request failed", exc_info=exc)
    await context.abort(status_code(exc), error_message(model, exc))


def rpc(method):
    """An RPC whose errors (a model not found, bad parameters) end it with their status code."""
    @functools.wraps(method)
    async def run(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - the server stays up
            failure = exc
        await abort(context, None, failure)

    return run


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The RPCs over one server's context (models, metrics, limits, model-control mode, requests in flight)."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    # ---- health and metadata ------------------------------------------------------------------------------------
    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.ctx.is_ready())

    async def ModelReady(self, request, context):
        try:
            self._model(request.name, request.version)
        except RepositoryError:
            return service_pb2.ModelReadyResponse(ready=False)
        return service_pb2.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(name=SERVER_NAME, version=server_version(),
                                                  extensions=EXTENSIONS)

    @rpc
    async def ModelMetadata(self, request, context):
        model = self._model(request.name, request.version)
        return json_format.ParseDict(model_metadata(model), service_pb2.ModelMetadataResponse())

    @rpc
    async def ModelConfig(self, request, context):
        model = self._model(request.name, request.version)
        return json_format.ParseDict({"config": model_config(model)}, service_pb2.ModelConfigResponse())

    @rpc
    async def ModelStatistics(self, request, context):
        models = ([self._model(request.name, request.version)] if request.name
                  else self.ctx.repository.ready_models())
        stats = [self.ctx.metrics.model_stats(m.name, m.version) for m in models]
        return json_format.ParseDict({"model_stats": stats}, service_pb2.ModelStatisticsResponse())

    # ---- the repository extension -------------------------------------------------------------------------------
    @rpc
    async def RepositoryIndex(self, request, context):
        check_repository_name(request.repository_name)
        return json_format.ParseDict({"models": self.ctx.repository.index(request.ready)},
                                     service_pb2.RepositoryIndexResponse())

    @rpc
    async def RepositoryModelLoad(self, request, context):
        check_repository_name(request.repository_name)
        await load_model(self.ctx, request.model_name, parameters_dict(request.parameters))
        return service_pb2.RepositoryModelLoadResponse()

    @rpc
    async def RepositoryModelUnload(self, request, context):
        check_repository_name(request.repository_name)
        unload_model(self.ctx, request.model_name)
        return service_pb2.RepositoryModelUnloadResponse()

    # ---- inference ----------------------------------------------------------------------------------------------
    async def ModelInfer(self, request, context):
        """One response with the whole output; the client cancelling the RPC cancels the request (the handler's
        task is cancelled, and with it the request's handle)."""
        model = None
        try:
            model = self._model(request.model_name, request.model_version)
            req = self._read(model, request)
            if req.cancel:  # answered as an error, but no request failed: not counted
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, cancel_in_flight(self.ctx, req))
            if req.stream:
                raise InputError(STREAMING_ON_UNARY)
            wanted = requested_outputs(requested_output_items(request), model, False)
            outputs = await complete(self.ctx, model, req)
            return infer_response(model, req.request_id, outputs, outputs if wanted is None else wanted)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - the server stays up
            self.ctx.refused(model, exc)
            failure = exc
        await abort(context, model, failure)

    async def ModelStreamInfer(self, request_iterator, context):
        """Decoupled streaming: each request on the stream runs concurrently and sends its responses (one per
        piece of new text when it streams, else one) as they come, the last flagged `triton_final_response`;
        a failing request sends its error in-band (`error_message`), as Triton does, and the stream goes on. The
        stream ends once the client stops sending and every request has answered; a client that cancels the
        stream cancels its requests."""
        responses: asyncio.Queue = asyncio.Queue()
        running: set[asyncio.Task] = set()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.ensure_future(self._stream_one(request, responses.put_nowait))
                    running.add(task)
                    task.add_done_callback(running.discard)
                while running:
                    await asyncio.wait(set(running))
            finally:
                responses.put_nowait(_END)

        reader = asyncio.ensure_future(read())
        try:
            while (response := await responses.get()) is not _END:
                yield response
            await reader  # its error (the request stream broke), if any
        finally:
            for task in [reader, *running]:
                task.cancel()
            await asyncio.gather(reader, *running, return_exceptions=True)

    async def _stream_one(self, request: service_pb2.ModelInferRequest, send) -> None:
        model, handle = None, None
        try:
            model = self._model(request.model_name, request.model_version)
            req = self._read(model, request)
            if req.cancel:
                send(_stream_error(request, model, cancel_in_flight(self.ctx, req)))
                return
            wanted = requested_outputs(requested_output_items(request), model, False)
            handle = await self.ctx.submit(model, req.prompt, req.params, req.request_id)
            async for outputs, final in response_outputs(model, req, handle):
                response = infer_response(model, req.request_id, outputs, outputs if wanted is None else wanted,
                                          final)
                send(service_pb2.ModelStreamInferResponse(infer_response=response))
        except Exception as exc:  # noqa: BLE001 - one request's failure ends only that request
            self.ctx.refused(model, exc)
            if not is_expected(exc):
                log.error("gRPC stream request failed", exc_info=exc)
            send(_stream_error(request, model, error_message(model, exc)))
        finally:
            if handle is not None:
                await handle.aclose()

    # ---- helpers ------------------------------------------------------------------------------------------------
    def _model(self, name: str, version: str) -> ServedModel:
        """The ready model a request names; RepositoryError (NOT_FOUND / UNAVAILABLE) otherwise."""
        return self.ctx.repository.get(name, version or None)

    @staticmethod
    def _read(model: ServedModel, request: service_pb2.ModelInferRequest) -> GenerateRequest:
        return infer_request(model, parameters_dict(request.parameters), input_values(request), request.id)


def _stream_error(request: service_pb2.ModelInferRequest, model: ServedModel | None,
                  message: str) -> service_pb2.ModelStreamInferResponse:
    """An in-band stream error, with the request's id so that a client with several requests on the stream knows
    which one failed."""
    response = service_pb2.ModelInferResponse(model_name=model.name if model else request.model_name,
                                              model_version=model.version if model else request.model_version,
                                              id=request.id)
    return service_pb2.ModelStreamInferResponse(error_message=message, infer_response=response)
